//! The text side of mlxcel: everything between a request's messages and
//! token ids, and between generated ids and what a client sees. No tensor
//! work and no MLX: its tests run without a model runtime (the GGUF header
//! that [`gguf`] reads comes from `mlxcel-gguf`).
//!
//! - [`tokenizer`]: text ↔ ids through a Hugging Face `tokenizer.json`,
//!   special-token marking, EOS ids; [`TextError`], the error of all text
//!   modules.
//! - [`chat_template`]: Hugging Face Jinja chat templates (`minijinja`).
//! - [`client_text`]: special-token strings the client typed, marked so they
//!   stay text.
//! - [`detokenizer`]: generated ids into text deltas.
//! - [`fim`]: fill-in-the-middle prompts from a model's FIM tokens.
//! - [`reasoning`]: a reasoning model's `<think>` block split off.
//! - [`constraint`]: output grammars (`llguidance`).
//! - [`output`]: what a choice's text becomes on its stream (stop strings,
//!   tool calls).
//! - [`gguf`]: the tokenizer and chat template from a GGUF header.
//! - [`Text`]: all of it for one model, loaded once.

pub mod chat_template;
pub mod client_text;
pub mod constraint;
pub mod detokenizer;
pub mod fim;
pub mod gguf;
pub mod output;
pub mod reasoning;
mod text;
pub mod tokenizer;

pub use text::Text;
pub use tokenizer::{TextError, TextTokenizer};
