//! Chat templates rendered and tokenized exactly as `transformers` does.
//!
//! Every expected string/id list below was produced with the project venv
//! (`/work/main/.venv`, transformers 5.24.0, tokenizers 0.23.3, jinja2 3.1.6):
//!
//! ```python
//! from transformers.utils.chat_template_utils import render_jinja_template
//! out, _ = render_jinja_template(conversations=[msgs], chat_template=src,
//!                                add_generation_prompt=gen, bos_token=..., eos_token=...)
//! # and for ids:
//! AutoTokenizer.from_pretrained(fixture_dir).apply_chat_template(msgs,
//!     add_generation_prompt=True, tokenize=True)
//! ```
//!
//! The SmolLM2 template is `tokenizer.chat_template` of
//! `SmolLM2-135M-Instruct.Q4_1.gguf` (read with the `gguf` package); the
//! Qwen2.5 and Llama-3.2 templates are those of Qwen/Qwen2.5-0.5B-Instruct
//! and meta-llama/Llama-3.2-1B-Instruct. The Llama-3.2 reference was
//! rendered on 29 Nov 2026; the test substitutes today's date.

use std::path::{Path, PathBuf};

use mlxcel_engine_api::ChatMessage;
use mlxcel_text::chat_template::ChatTemplate;
use mlxcel_text::tokenizer::{TextError, TextTokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read(name: &str) -> String {
    std::fs::read_to_string(fixtures().join(name)).expect("fixture exists")
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::text(role, content)
}

fn hi() -> Vec<ChatMessage> {
    vec![msg("user", "Hi")]
}

fn conversation() -> Vec<ChatMessage> {
    vec![
        msg("system", "  Be brief.  "),
        msg("user", "What is 2+2?"),
        msg("assistant", "4"),
        msg("user", " Thanks! 🙂 "),
    ]
}

fn template(file: &str, bos: Option<&str>, eos: Option<&str>) -> ChatTemplate {
    ChatTemplate::new(read(file), bos.map(Into::into), eos.map(Into::into))
        .expect("template compiles")
}

const SMOL_SYSTEM: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";
const CONV_CHATML: &str = "<|im_start|>system\n  Be brief.  <|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n Thanks! 🙂 <|im_end|>\n";

#[test]
fn smollm2_template_matches_transformers() {
    let t = template(
        "smollm2_chat_template.jinja",
        Some("<|im_start|>"),
        Some("<|im_end|>"),
    );
    let one = format!("{SMOL_SYSTEM}<|im_start|>user\nHi<|im_end|>\n");
    assert_eq!(
        t.render(&hi(), true).unwrap(),
        format!("{one}<|im_start|>assistant\n")
    );
    assert_eq!(t.render(&hi(), false).unwrap(), one);
    assert_eq!(
        t.render(&conversation(), true).unwrap(),
        format!("{CONV_CHATML}<|im_start|>assistant\n")
    );
    assert_eq!(t.render(&conversation(), false).unwrap(), CONV_CHATML);
}

#[test]
fn qwen25_template_matches_transformers() {
    let t = template("qwen25_chat_template.jinja", None, Some("<|im_end|>"));
    let one = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n";
    assert_eq!(
        t.render(&hi(), true).unwrap(),
        format!("{one}<|im_start|>assistant\n")
    );
    assert_eq!(t.render(&hi(), false).unwrap(), one);
    assert_eq!(
        t.render(&conversation(), true).unwrap(),
        format!("{CONV_CHATML}<|im_start|>assistant\n")
    );
    assert_eq!(t.render(&conversation(), false).unwrap(), CONV_CHATML);
}

#[test]
fn llama32_template_matches_transformers() {
    let t = template(
        "llama32_chat_template.jinja",
        Some("<|begin_of_text|>"),
        Some("<|eot_id|>"),
    );
    let cases = [
        (hi(), true, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 29 Nov 2026\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
        (hi(), false, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 29 Nov 2026\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"),
        (conversation(), true, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 29 Nov 2026\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nThanks! 🙂<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
        (conversation(), false, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 29 Nov 2026\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nThanks! 🙂<|eot_id|>"),
    ];
    for (messages, gen, reference) in cases {
        // Render between two clock reads so a midnight in between is seen.
        let (before, got, after) = loop {
            let before = chrono::Local::now().format("%d %b %Y").to_string();
            let got = t.render(&messages, gen).unwrap();
            let after = chrono::Local::now().format("%d %b %Y").to_string();
            if before == after {
                break (before, got, after);
            }
        };
        assert_eq!(before, after);
        assert_eq!(got, reference.replace("29 Nov 2026", &before));
    }
}

#[test]
fn llama2_style_template_from_a_named_list() {
    // tokenizer_config.json holds [{name: default}, {name: tool_use}].
    let t = ChatTemplate::from_model_dir(&fixtures().join("spm"))
        .unwrap()
        .expect("spm fixture has a template");
    assert_eq!(t.bos_token(), Some("<s>"));
    assert_eq!(
        t.render(&conversation(), true).unwrap(),
        "<s>[INST] <<SYS>>\n  Be brief.  \n<</SYS>>\n\nWhat is 2+2? [/INST] 4 </s><s>[INST] Thanks! 🙂 [/INST]"
    );
    let err = t
        .render(&[msg("user", "a"), msg("user", "b")], true)
        .unwrap_err();
    match err {
        TextError::TemplateException(m) => assert_eq!(
            m,
            "Conversation roles must alternate user/assistant/user/assistant/..."
        ),
        other => panic!("wrong error {other:?}"),
    }
}

#[test]
fn chat_prompt_ids_match_apply_chat_template() {
    let dir = fixtures().join("bytelevel");
    let tok = TextTokenizer::from_model_dir(&dir).unwrap();
    let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
    let ids = tok
        .encode_chat_prompt(&t.render(&conversation(), true).unwrap())
        .unwrap();
    let want: Vec<u32> = vec![
        1, 85, 91, 85, 86, 71, 79, 201, 223, 223, 36, 71, 223, 337, 75, 71, 72, 16, 261, 2, 201, 1,
        87, 85, 270, 201, 57, 74, 331, 416, 223, 20, 13, 20, 33, 2, 201, 1, 67, 375, 271, 377, 86,
        201, 22, 2, 201, 1, 87, 85, 270, 201, 223, 326, 284, 77, 85, 3, 269, 250, 227, 223, 2, 201,
        1, 67, 375, 271, 377, 86, 201,
    ];
    assert_eq!(ids, want);
    assert_eq!(
        tok.encode_text_prompt("Hi there").unwrap(),
        [42, 75, 264, 262, 296]
    );

    let dir = fixtures().join("spm");
    let tok = TextTokenizer::from_model_dir(&dir).unwrap();
    let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
    let ids = tok
        .encode_chat_prompt(&t.render(&conversation(), true).unwrap())
        .unwrap();
    let want: Vec<u32> = vec![
        1, 313, 279, 275, 276, 86, 277, 96, 313, 63, 63, 86, 278, 86, 65, 65, 259, 313, 313, 69,
        284, 313, 398, 288, 403, 264, 313, 313, 259, 63, 63, 50, 86, 278, 86, 65, 65, 374, 90, 287,
        392, 313, 337, 313, 266, 46, 266, 271, 313, 279, 50, 275, 276, 86, 277, 96, 313, 55, 313,
        2, 1, 313, 279, 275, 276, 86, 277, 96, 341, 287, 348, 290, 298, 36, 313, 243, 162, 156,
        133, 313, 279, 50, 275, 276, 86, 277, 96,
    ];
    assert_eq!(ids, want);
    assert_eq!(
        tok.encode_text_prompt("Hi there").unwrap(),
        [1, 362, 288, 331, 332, 360]
    );
}

#[test]
fn model_dir_template_sources() {
    let tmp = std::env::temp_dir().join(format!("mlxcel-text-test-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    // No template anywhere: None.
    assert!(ChatTemplate::from_model_dir(&tmp).unwrap().is_none());
    // tokenizer_config.json string template.
    std::fs::write(
        tmp.join("tokenizer_config.json"),
        r#"{"chat_template": "cfg {{ eos_token }}", "eos_token": {"content": "</s>"}}"#,
    )
    .unwrap();
    let t = ChatTemplate::from_model_dir(&tmp).unwrap().unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "cfg </s>");
    // chat_template.jinja wins over tokenizer_config.json.
    std::fs::write(tmp.join("chat_template.jinja"), "file {{ eos_token }}\n").unwrap();
    let t = ChatTemplate::from_model_dir(&tmp).unwrap().unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "file </s>");
    std::fs::remove_file(tmp.join("chat_template.jinja")).unwrap();
    // A list without "default" is a model error.
    std::fs::write(
        tmp.join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "tool_use", "template": "x"}]}"#,
    )
    .unwrap();
    let err = ChatTemplate::from_model_dir(&tmp).unwrap_err();
    assert!(matches!(err, TextError::InvalidModelFile { .. }), "{err:?}");
    std::fs::remove_dir_all(&tmp).unwrap();
}
