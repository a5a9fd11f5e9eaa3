//! HTTP layer (see ARCHITECTURE.md, crates/server).
