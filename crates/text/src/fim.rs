//! Fill-in-the-middle (FIM) prompts: code before and after the cursor, and
//! the model writes what goes between (Bavarian et al. 2022, "Efficient
//! Training of Language Models to Fill in the Middle").
//!
//! A model that was trained for it has three control tokens, found here by
//! their vocabulary strings (the same in a `tokenizer.json` and in a GGUF
//! file's vocabulary):
//!
//! | style | prefix | suffix | middle | file separator | repository |
//! | --- | --- | --- | --- | --- | --- |
//! | Qwen2.5-Coder, Qwen3-Coder | `<\|fim_prefix\|>` | `<\|fim_suffix\|>` | `<\|fim_middle\|>` | `<\|file_sep\|>` | `<\|repo_name\|>` |
//! | StarCoder, StarCoder2 | `<fim_prefix>` | `<fim_suffix>` | `<fim_middle>` | `<file_sep>` | `<repo_name>` |
//! | CodeLlama | `▁<PRE>` | `▁<SUF>` | `▁<MID>` | | |
//!
//! The prompt is laid out prefix-suffix-middle, as llama.cpp's `/infill`
//! builds it for every style: the tokens the tokenizer puts before a
//! sequence (a BOS, where the model has one), then the extra context
//! (other files of the project), then `PRE prefix SUF suffix MID`, then
//! the text already typed after the cursor's line start, if any, which the
//! model continues. With file-separator and repository tokens the extra
//! files use the repository-level layout of Qwen2.5-Coder's report (Hui et
//! al. 2024): `<|repo_name|>project\n`, then `<|file_sep|>name\ntext\n`
//! per file, then `<|file_sep|>filename\n` for the file being edited (the
//! client does not name it; llama.cpp's `/infill` writes the same); without
//! them each file is plain text (`name\ntext\n`) before the prefix token.
//! Without extra files the prompt is the plain FIM layout (llama.cpp
//! writes the repository header even then; OpenAI-style `suffix` clients
//! expect the plain layout, and both routes build the same prompt). Every client part is encoded with special-token strings as
//! plain text: code that spells `<|fim_middle|>` cannot steer the prompt.

use mlxcel_engine_api::Infill;

use crate::tokenizer::{TextError, TextTokenizer};

/// The vocabulary strings of one FIM style.
struct Style {
    prefix: &'static str,
    suffix: &'static str,
    middle: &'static str,
    file_sep: Option<&'static str>,
    repo_name: Option<&'static str>,
    /// Other control tokens of the style that end an infill (the model
    /// starting another file or a new FIM block).
    stops: &'static [&'static str],
}

const STYLES: &[Style] = &[
    Style {
        prefix: "<|fim_prefix|>",
        suffix: "<|fim_suffix|>",
        middle: "<|fim_middle|>",
        file_sep: Some("<|file_sep|>"),
        repo_name: Some("<|repo_name|>"),
        stops: &["<|fim_pad|>"],
    },
    Style {
        prefix: "<fim_prefix>",
        suffix: "<fim_suffix>",
        middle: "<fim_middle>",
        file_sep: Some("<file_sep>"),
        repo_name: Some("<repo_name>"),
        stops: &["<fim_pad>"],
    },
    Style {
        prefix: "▁<PRE>",
        suffix: "▁<SUF>",
        middle: "▁<MID>",
        file_sep: None,
        repo_name: None,
        stops: &["▁<EOT>"],
    },
];

/// The repository name written before the extra files (llama.cpp's
/// `/infill` writes a fixed one too: the client does not send one).
const REPOSITORY: &str = "project";

/// The name in the header of the file being edited, after the extra
/// files (the client does not send it; llama.cpp writes this one).
const CURRENT_FILE: &str = "filename";

/// A model's FIM control tokens (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    /// Starts a file of the repository-level layout.
    pub file_sep: Option<u32>,
    /// Starts the repository name of that layout.
    pub repo_name: Option<u32>,
    /// Control tokens that end an infill besides the model's EOS ids: all
    /// of the above and the style's padding or end-of-infill token (the
    /// model writing any of them has left the middle).
    pub stop_ids: Vec<u32>,
}

impl FimTokens {
    /// The FIM tokens of `tokenizer`'s vocabulary, `None` when it has no
    /// complete set (the model was not trained for FIM).
    pub fn from_tokenizer(tokenizer: &TextTokenizer) -> Option<Self> {
        STYLES.iter().find_map(|style| {
            let id = |s: &str| tokenizer.token_to_id(s);
            let (prefix, suffix, middle) =
                (id(style.prefix)?, id(style.suffix)?, id(style.middle)?);
            let file_sep = style.file_sep.and_then(id);
            let repo_name = style.repo_name.and_then(id);
            let mut stop_ids = vec![prefix, suffix, middle];
            stop_ids.extend(file_sep.iter().chain(&repo_name));
            stop_ids.extend(style.stops.iter().filter_map(|s| id(s)));
            Some(FimTokens {
                prefix,
                suffix,
                middle,
                file_sep,
                repo_name,
                stop_ids,
            })
        })
    }

    /// The token ids of `infill`'s prompt (see the module docs).
    ///
    /// # Errors
    /// [`TextError::Encode`].
    pub fn prompt(
        &self,
        tokenizer: &TextTokenizer,
        infill: &Infill,
    ) -> Result<Vec<u32>, TextError> {
        let text = |s: &str| tokenizer.encode_as_text(s);
        let mut ids = tokenizer.leading_special_ids()?;
        if !infill.extra.is_empty() {
            match (self.repo_name, self.file_sep) {
                (Some(repo), Some(sep)) => {
                    ids.push(repo);
                    ids.extend(text(&format!("{REPOSITORY}\n"))?);
                    for file in &infill.extra {
                        ids.push(sep);
                        ids.extend(text(&format!("{}\n{}", file.filename, file.text))?);
                        if !file.text.ends_with('\n') {
                            ids.extend(text("\n")?);
                        }
                    }
                    // The file being edited: the client does not name it.
                    ids.push(sep);
                    ids.extend(text(&format!("{CURRENT_FILE}\n"))?);
                }
                _ => {
                    for file in &infill.extra {
                        ids.extend(text(&format!("{}\n{}\n", file.filename, file.text))?);
                    }
                }
            }
        }
        ids.push(self.prefix);
        ids.extend(text(&infill.prefix)?);
        ids.push(self.suffix);
        ids.extend(text(&infill.suffix)?);
        ids.push(self.middle);
        ids.extend(text(&infill.middle)?);
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxcel_engine_api::InfillFile;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::{AddedToken, Tokenizer};

    /// The byte-level test vocabulary with `names` added as special
    /// tokens, and a BOS (`<s>`) put before every sequence with `bos`.
    fn tokenizer(names: &[&str], bos: bool) -> TextTokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/bytelevel/tokenizer.json"
        );
        let mut inner = Tokenizer::from_file(path).expect("fixture tokenizer");
        let mut added: Vec<AddedToken> = names
            .iter()
            .map(|n| AddedToken::from(n.to_string(), true))
            .collect();
        if bos {
            added.push(AddedToken::from("<s>", true));
        }
        inner.add_special_tokens(&added);
        if bos {
            let id = inner.token_to_id("<s>").expect("bos id");
            let template = TemplateProcessing::builder()
                .try_single("<s> $A")
                .expect("template")
                .special_tokens(vec![("<s>", id)])
                .build()
                .expect("processor");
            inner.with_post_processor(Some(template));
        }
        TextTokenizer::from_tokenizer(inner, None, None)
    }

    #[test]
    fn starcoder_tokens_lay_out_prefix_suffix_middle_with_the_repository() {
        let names = [
            "<fim_prefix>",
            "<fim_suffix>",
            "<fim_middle>",
            "<file_sep>",
            "<repo_name>",
            "<fim_pad>",
        ];
        let tok = tokenizer(&names, false);
        let id = |s: &str| tok.token_to_id(s).expect(s);
        let fim = FimTokens::from_tokenizer(&tok).expect("StarCoder tokens");
        assert_eq!(
            (fim.prefix, fim.suffix, fim.middle),
            (id("<fim_prefix>"), id("<fim_suffix>"), id("<fim_middle>"))
        );
        for n in names {
            assert!(fim.stop_ids.contains(&id(n)), "{n} ends an infill");
        }
        let text = |s: &str| tok.encode_as_text(s).expect("encode");
        let infill = Infill {
            prefix: "a = ".into(),
            // A client's `<fim_middle>` is code, not the control token.
            suffix: "\nb = '<fim_middle>'".into(),
            extra: vec![InfillFile {
                filename: "x.py".into(),
                text: "X = 1".into(),
            }],
            middle: "1".into(),
        };
        let mut want = vec![id("<repo_name>")];
        want.extend(text("project\n"));
        want.push(id("<file_sep>"));
        want.extend(text("x.py\nX = 1"));
        want.extend(text("\n"));
        want.push(id("<file_sep>"));
        want.extend(text("filename\n"));
        want.push(id("<fim_prefix>"));
        want.extend(text("a = "));
        want.push(id("<fim_suffix>"));
        want.extend(text("\nb = '<fim_middle>'"));
        want.push(id("<fim_middle>"));
        want.extend(text("1"));
        let got = fim.prompt(&tok, &infill).expect("prompt");
        assert_eq!(got, want);
        assert_eq!(
            got.iter().filter(|&&t| t == id("<fim_middle>")).count(),
            1,
            "the typed <fim_middle> stayed text"
        );
    }

    #[test]
    fn codellama_tokens_follow_the_bos_and_put_extra_files_as_text() {
        let tok = tokenizer(&["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"], true);
        let id = |s: &str| tok.token_to_id(s).expect(s);
        let fim = FimTokens::from_tokenizer(&tok).expect("CodeLlama tokens");
        assert_eq!((fim.file_sep, fim.repo_name), (None, None));
        assert!(fim.stop_ids.contains(&id("▁<EOT>")));
        let text = |s: &str| tok.encode_as_text(s).expect("encode");
        let infill = Infill {
            prefix: "p".into(),
            suffix: "s".into(),
            extra: vec![InfillFile {
                filename: "f".into(),
                text: "t".into(),
            }],
            middle: String::new(),
        };
        let mut want = vec![id("<s>")];
        want.extend(text("f\nt\n"));
        want.push(id("▁<PRE>"));
        want.extend(text("p"));
        want.push(id("▁<SUF>"));
        want.extend(text("s"));
        want.push(id("▁<MID>"));
        assert_eq!(fim.prompt(&tok, &infill).expect("prompt"), want);
    }

    #[test]
    fn a_vocabulary_without_a_complete_set_has_no_fim() {
        assert_eq!(FimTokens::from_tokenizer(&tokenizer(&[], false)), None);
        let partial = tokenizer(&["<|fim_prefix|>", "<|fim_suffix|>"], false);
        assert_eq!(FimTokens::from_tokenizer(&partial), None);
    }
}
