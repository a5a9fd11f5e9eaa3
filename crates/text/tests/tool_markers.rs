//! Mistral v11 and Gemma 4 replies read token by token, as the engine
//! reads them: text through the detokenizer and [`OutputFilter::push`],
//! the formats' markers (special tokens) through
//! [`OutputFilter::push_special_token`], the detokenizer releasing the text
//! before a marker ([`OutputFilter::reads_marker`]). The tokenizers are the
//! fixtures with the markers added as special tokens (no Gemma 4 or
//! Mistral v11 tokenizer is available offline); the sentencepiece one
//! spells rare characters with byte tokens, as Gemma's does.

use std::path::{Path, PathBuf};

use mlxcel_engine_api::ToolDefinition;
use mlxcel_text::detokenizer::IncrementalDetokenizer;
use mlxcel_text::output::{OutputFilter, OutputPiece, ToolCallFormat};
use mlxcel_text::tokenizer::TextTokenizer;

/// Fixture `fixture` with `format`'s markers added as special tokens.
fn tokenizer(fixture: &str, format: ToolCallFormat) -> TextTokenizer {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    let dir: PathBuf = std::env::temp_dir().join(format!(
        "mlxcel-markers-{fixture}-{format:?}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    let base = TextTokenizer::from_model_dir(&src).unwrap().vocab_size();
    let added = json["added_tokens"].as_array_mut().unwrap();
    for (i, marker) in format.special_markers().iter().enumerate() {
        added.push(serde_json::json!({
            "id": base + i, "content": marker, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true,
        }));
    }
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    for f in ["tokenizer_config.json", "special_tokens_map.json"] {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
    }
    TextTokenizer::from_model_dir(&dir).unwrap()
}

/// Content and calls (name, arguments) the filter sent for `ids`.
fn read(
    tok: &TextTokenizer,
    format: ToolCallFormat,
    names: &[&str],
    ids: &[u32],
) -> (String, Vec<(String, String)>) {
    let tools: Vec<ToolDefinition> = names
        .iter()
        .map(|n| ToolDefinition {
            name: n.to_string(),
            description: None,
            parameters: serde_json::json!({"type": "object"}),
        })
        .collect();
    let mut filter = OutputFilter::with_format(&[], &tools, format);
    let mut detok = IncrementalDetokenizer::new();
    let mut pieces = Vec::new();
    for &id in ids {
        let text = if filter.reads_marker(tok, id) {
            detok.push_marker(tok, id).unwrap()
        } else {
            detok.push(tok, id).unwrap()
        };
        pieces.extend(filter.push(&text).pieces);
        pieces.extend(filter.push_special_token(tok, id).pieces);
    }
    pieces.extend(filter.push(&detok.flush(tok).unwrap()).pieces);
    pieces.extend(filter.finish().pieces);
    let (mut content, mut calls) = (String::new(), Vec::<(String, String)>::new());
    for piece in pieces {
        match piece {
            OutputPiece::Text(t) => content.push_str(&t),
            OutputPiece::CallStart { name, .. } => calls.push((name, String::new())),
            OutputPiece::CallArguments(a) => calls.last_mut().unwrap().1.push_str(&a),
            OutputPiece::Reasoning(_) => panic!("no reasoning here"),
        }
    }
    (content, calls)
}

#[test]
fn gemma4_markers_arrive_as_special_tokens() {
    let reply = "Sure. <|tool_call>call:get_weather{city:<|\"|>Zürich 🙂<|\"|>,days:3}\
                 <tool_call|><|tool_call>call:now{}<tool_call|>";
    for fixture in ["bytelevel", "spm"] {
        let tok = tokenizer(fixture, ToolCallFormat::Gemma4);
        let ids = tok.encode(reply, false).unwrap();
        let markers = ids.iter().filter(|&&id| tok.is_special_token(id)).count();
        assert_eq!(markers, 6, "{fixture}: the markers are single tokens");
        let (content, calls) = read(&tok, ToolCallFormat::Gemma4, &["get_weather", "now"], &ids);
        assert_eq!(content.trim(), "Sure.", "{fixture}");
        let args: serde_json::Value = serde_json::from_str(&calls[0].1).unwrap();
        assert_eq!(args["days"], 3, "{fixture}");
        // The sentencepiece fixture's pre-tokenizer starts each run of text
        // between special tokens with a space (a full decode shows it too);
        // the emoji's byte tokens end right before the closing `<|"|>`.
        assert_eq!(
            args["city"].as_str().map(str::trim_start),
            Some("Zürich 🙂")
        );
        assert_eq!(calls[1], ("now".to_string(), "{}".to_string()), "{fixture}");
        // Without tools the markers are skipped, as before.
        let (content, calls) = read(&tok, ToolCallFormat::Gemma4, &[], &ids);
        assert!(
            calls.is_empty() && !content.contains("<|"),
            "{fixture}: {content}"
        );
    }
}

#[test]
fn mistral_v11_markers_arrive_as_special_tokens() {
    let reply = "Checking.[TOOL_CALLS]get_weather[CALL_ID]a1b2C3d4e[ARGS]{\"city\": \"Zürich 🙂\"}\
                 [TOOL_CALLS]now[ARGS]{}";
    for fixture in ["bytelevel", "spm"] {
        let tok = tokenizer(fixture, ToolCallFormat::MistralV11);
        let ids = tok.encode(reply, false).unwrap();
        let (content, calls) = read(
            &tok,
            ToolCallFormat::MistralV11,
            &["get_weather", "now"],
            &ids,
        );
        assert_eq!(content, "Checking.", "{fixture}");
        assert_eq!(
            calls,
            [
                (
                    "get_weather".to_string(),
                    "{\"city\": \"Zürich 🙂\"}".to_string()
                ),
                ("now".to_string(), "{}".to_string())
            ],
            "{fixture}"
        );
    }
}
