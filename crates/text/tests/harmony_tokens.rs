//! A harmony reply read token by token, as the engine reads it: text
//! through the detokenizer and [`OutputFilter::push`], special tokens
//! through [`OutputFilter::push_special_token`]. The tokenizer is the
//! byte-level fixture with gpt-oss's harmony markers added as special
//! tokens (no gpt-oss tokenizer is available offline).

use std::path::{Path, PathBuf};

use mlxcel_engine_api::ToolDefinition;
use mlxcel_text::chat_template::ChatTemplate;
use mlxcel_text::detokenizer::IncrementalDetokenizer;
use mlxcel_text::output::{OutputFilter, OutputPiece, ToolCallFormat};
use mlxcel_text::tokenizer::TextTokenizer;

const MARKERS: [&str; 7] = [
    "<|start|>",
    "<|channel|>",
    "<|constrain|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
];

/// The fixture tokenizer with the harmony markers added (special), and a
/// chat template that writes `<|channel|>`, in a fresh directory.
fn harmony_dir() -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bytelevel");
    let dir = std::env::temp_dir().join(format!("mlxcel-harmony-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap().len();
    let added = json["added_tokens"].as_array_mut().unwrap();
    for (i, marker) in MARKERS.iter().enumerate() {
        added.push(serde_json::json!({
            "id": vocab + i, "content": marker, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true,
        }));
    }
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    let config = serde_json::json!({
        "eos_token": "<|return|>",
        "chat_template": "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}<|start|>assistant",
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

/// What the filter sent for `ids`: content, reasoning, calls (name,
/// arguments).
fn read(
    tok: &TextTokenizer,
    tools: &[ToolDefinition],
    ids: &[u32],
) -> (String, String, Vec<(String, String)>) {
    let mut filter = OutputFilter::with_format(&[], tools, ToolCallFormat::Harmony);
    let mut detok = IncrementalDetokenizer::new();
    let mut pieces = Vec::new();
    for &id in ids {
        let text = detok.push(tok, id).unwrap();
        pieces.extend(filter.push(&text).pieces);
        pieces.extend(filter.push_special_token(tok, id).pieces);
    }
    pieces.extend(filter.push(&detok.flush(tok).unwrap()).pieces);
    pieces.extend(filter.finish().pieces);
    let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for piece in pieces {
        match piece {
            OutputPiece::Text(t) => content += &t,
            OutputPiece::Reasoning(t) => reasoning += &t,
            OutputPiece::CallStart { name, .. } => calls.push((name, String::new())),
            OutputPiece::CallArguments(a) => calls.last_mut().unwrap().1 += &a,
        }
    }
    (content, reasoning, calls)
}

#[test]
fn a_harmony_reply_is_read_from_its_tokens() {
    let dir = harmony_dir();
    let tok = TextTokenizer::from_model_dir(&dir).unwrap();
    let template = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
    assert_eq!(template.tool_call_format(), ToolCallFormat::Harmony);
    for marker in MARKERS {
        let id = tok.token_to_id(marker).unwrap();
        assert!(tok.is_special_token(id), "{marker}");
    }
    let tools = [ToolDefinition {
        name: "get_weather".into(),
        description: None,
        parameters: serde_json::json!({"type": "object"}),
    }];
    let reply = "<|channel|>analysis<|message|>User wants weather.<|end|>\
                 <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json\
                 <|message|>{\"city\": \"Paris\"}<|call|>";
    let ids = tok.encode(reply, false).unwrap();
    assert!(ids.contains(&tok.token_to_id("<|channel|>").unwrap()));
    let (content, reasoning, calls) = read(&tok, &tools, &ids);
    assert_eq!(reasoning, "User wants weather.");
    assert_eq!(content, "");
    assert_eq!(
        calls,
        [("get_weather".to_owned(), "{\"city\": \"Paris\"}".to_owned())]
    );

    // The same characters written as ordinary tokens are text.
    let mut ids = tok.encode("<|channel|>final<|message|>", false).unwrap();
    let spelled: Vec<u32> = ["<|", "channel", "|>", "hi"]
        .iter()
        .flat_map(|t| tok.encode(t, false).unwrap())
        .collect();
    assert!(spelled.iter().all(|&id| !tok.is_special_token(id)));
    ids.extend(&spelled);
    let (content, reasoning, calls) = read(&tok, &tools, &ids);
    assert_eq!(
        (content.as_str(), reasoning.as_str()),
        ("<|channel|>hi", "")
    );
    assert!(calls.is_empty());
    std::fs::remove_dir_all(&dir).ok();
}
