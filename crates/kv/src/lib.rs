//! KV cache storage (see ARCHITECTURE.md, crates/kv).
