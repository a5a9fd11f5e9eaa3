//! [`Text`]: a model's tokenizer, chat template, EOS ids and grammar
//! vocabulary, loaded once at start-up.

use std::path::Path;
use std::time::Instant;

use mlxcel_engine_api::TokenLogprob;

use crate::chat_template::ChatTemplate;
use crate::constraint::GrammarTokenizer;
use crate::fim::FimTokens;
use crate::gguf::{GgufHeader, GgufText};
use crate::tokenizer::{eos_token_ids, with_end_of_generation, TextError, TextTokenizer};

/// The text side of a served model, shared by the request handlers
/// (prompts) and the engine thread (decoding, grammars, logprobs).
pub struct Text {
    /// The model's tokenizer.
    pub tokenizer: TextTokenizer,
    /// The chat template (`None`: the model has none; chat requests are
    /// refused).
    pub template: Option<ChatTemplate>,
    /// Token ids that end a generation.
    pub eos: Vec<u32>,
    /// The vocabulary as byte strings, for grammars and logprob bytes;
    /// `None` when llguidance cannot read this tokenizer (then constrained
    /// output is refused with a 400, and everything else works).
    pub grammar: Option<GrammarTokenizer>,
    /// The tokenizer's fill-in-the-middle tokens (`None`: the model has
    /// none; infill requests are refused).
    pub fim: Option<FimTokens>,
}

impl Text {
    /// The text side of the checkpoint directory `dir`: `tokenizer.json`,
    /// the chat template (`template_file` if given, else the model's own),
    /// the EOS ids (`generation_config.json`, `config.json` and the
    /// tokenizer's EOS, then the vocabulary's end-of-generation tokens:
    /// [`crate::tokenizer::END_OF_GENERATION_TOKENS`]), and the grammar vocabulary for `vocab_size` logit
    /// rows (the model's output size; see [`Text::new`]).
    ///
    /// # Errors
    /// An unreadable or invalid tokenizer, tokenizer config or template.
    pub fn from_model_dir(
        dir: &Path,
        template_file: Option<&Path>,
        vocab_size: usize,
    ) -> Result<Text, TextError> {
        let tokenizer = TextTokenizer::from_model_dir(dir)?;
        let template = match template_file {
            Some(path) => Some(ChatTemplate::from_file(path, dir)?),
            None => ChatTemplate::from_model_dir(dir)?,
        };
        // generation_config.json, config.json and the tokenizer's EOS, then
        // every end-of-generation token of the vocabulary.
        let eos = with_end_of_generation(eos_token_ids(dir, &tokenizer), &tokenizer);
        Ok(Text::new(tokenizer, template, eos, vocab_size))
    }

    /// The text side of the GGUF file at `path`, whose header is `header`:
    /// the tokenizer built from `tokenizer.ggml.*`, the chat template
    /// (`template_file` if given, else `tokenizer.chat_template`), the EOS
    /// ids (`eos`, `eot` and `eom` ids, the EOS token's, then the
    /// vocabulary's end-of-generation tokens), and the
    /// grammar vocabulary for `vocab_size` logit rows.
    ///
    /// # Errors
    /// An unsupported tokenizer (model or pre-tokenizer), missing keys, an
    /// unreadable template file, a template that does not compile.
    pub fn from_gguf_header(
        path: &Path,
        header: &GgufHeader,
        template_file: Option<&Path>,
        vocab_size: usize,
    ) -> Result<Text, TextError> {
        let text = GgufText::from_header(path, header)?;
        let source = match template_file {
            Some(file) => Some(
                std::fs::read_to_string(file).map_err(|source| TextError::Io {
                    path: file.to_path_buf(),
                    source,
                })?,
            ),
            None => text.chat_template.clone(),
        };
        let template = source
            .map(|s| ChatTemplate::new(s, text.bos_token.clone(), text.eos_token.clone()))
            .transpose()?;
        let mut eos = text.eos_ids;
        if let Some(id) = text
            .eos_token
            .as_deref()
            .and_then(|t| text.tokenizer.token_to_id(t))
        {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let eos = with_end_of_generation(eos, &text.tokenizer);
        Ok(Text::new(text.tokenizer, template, eos, vocab_size))
    }

    /// Puts the parts together and builds the grammar vocabulary for
    /// `vocab_size` logit rows (rows past the tokenizer's vocabulary are
    /// padding; about a second for a 50k vocabulary, logged). A tokenizer
    /// llguidance cannot read leaves `grammar` empty, with a warning.
    pub fn new(
        tokenizer: TextTokenizer,
        template: Option<ChatTemplate>,
        eos: Vec<u32>,
        vocab_size: usize,
    ) -> Text {
        let trie_started = Instant::now();
        let grammar = match GrammarTokenizer::new(&tokenizer, vocab_size, &eos) {
            Ok(g) => {
                tracing::info!(
                    ms = trie_started.elapsed().as_secs_f64() * 1e3,
                    "grammar tokenizer ready"
                );
                Some(g)
            }
            Err(e) => {
                tracing::warn!(error = %e, "no constrained decoding for this tokenizer");
                None
            }
        };
        let fim = FimTokens::from_tokenizer(&tokenizer);
        Text {
            tokenizer,
            template,
            eos,
            grammar,
            fim,
        }
    }

    /// The exact bytes of token `id` (without a grammar tokenizer: its
    /// decoded text, lossy for partial UTF-8).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match &self.grammar {
            Some(g) => g.token_bytes(id),
            None => self
                .tokenizer
                .decode(&[id], false)
                .map(String::into_bytes)
                .unwrap_or_default(),
        }
    }

    /// `logprob` of token `id`, with its text and exact bytes.
    pub fn token_logprob(&self, id: u32, logprob: f32) -> TokenLogprob {
        let bytes = self.token_bytes(id);
        TokenLogprob {
            id,
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob,
        }
    }
}
