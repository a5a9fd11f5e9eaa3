use super::*;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn load(name: &str) -> TextTokenizer {
    TextTokenizer::from_model_dir(&fixture(name)).expect("fixture tokenizer loads")
}

#[test]
fn is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<TextTokenizer>();
}

// Reference ids from the Python `tokenizers` 0.23.3 package in .venv:
// Tokenizer.from_file(f"{d}/tokenizer.json").encode(s).ids
#[test]
fn byte_level_encode_matches_python_tokenizers() {
    let tok = load("bytelevel");
    let ids = tok.encode("Hello world! 🙂 你好", true).unwrap();
    assert_eq!(
        ids,
        [323, 358, 223, 380, 357, 3, 269, 250, 227, 223, 401, 402]
    );
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world! 🙂 你好");
    assert_eq!(tok.encode(" leading", true).unwrap(), [418, 329, 260, 73]);
    assert_eq!(tok.vocab_size(), 420);
}

#[test]
fn sentencepiece_encode_matches_python_tokenizers() {
    let tok = load("spm");
    let ids = tok.encode("Hello world! 🙂 你好", true).unwrap();
    let want = [
        1, 362, 404, 352, 313, 302, 335, 291, 283, 36, 313, 243, 162, 156, 133, 313, 231, 192, 163,
        321,
    ];
    assert_eq!(ids, want);
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world! 🙂 你好");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<s> Hello world! 🙂 你好");
    assert_eq!(
        tok.encode(" leading", true).unwrap(),
        [1, 313, 313, 351, 390, 330, 286]
    );
}

#[test]
fn special_token_strings_become_single_ids() {
    let tok = load("bytelevel");
    let ids = tok
        .encode_chat_prompt("<|im_start|>user\nHi<|im_end|>")
        .unwrap();
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
}

#[test]
fn chat_prompts_never_get_a_second_bos() {
    let tok = load("spm");
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.eos_token(), Some("</s>"));
    let rendered = "<s>[INST] Hi [/INST]";
    let ids = tok.encode_chat_prompt(rendered).unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1);
    assert_eq!(ids[0], 1);
    // Raw text: BOS added unless already there (mlx-lm stream_generate).
    assert_eq!(tok.encode_text_prompt(rendered).unwrap(), ids);
    assert_eq!(tok.encode_text_prompt("Hi").unwrap()[0], 1);
    assert_eq!(
        tok.encode_text_prompt("Hi").unwrap(),
        tok.encode("Hi", true).unwrap()
    );
}

#[test]
fn eos_ids_are_the_ordered_union_of_all_sources() {
    let dir = fixture("bytelevel");
    let tok = load("bytelevel");
    // generation_config: [2, 0]; config: 2; tokenizer_config: "<|im_end|>" = 2.
    assert_eq!(eos_token_ids(&dir, &tok), [2, 0]);
    let spm = fixture("spm");
    assert_eq!(eos_token_ids(&spm, &load("spm")), [2]);
}

#[test]
fn special_tokens_parse_in_both_shapes() {
    let obj: Json = serde_json::json!({"content": "<s>", "lstrip": false});
    assert_eq!(special_token_string(Some(&obj)).as_deref(), Some("<s>"));
    let s: Json = serde_json::json!("</s>");
    assert_eq!(special_token_string(Some(&s)).as_deref(), Some("</s>"));
    assert_eq!(special_token_string(Some(&Json::Null)), None);
    let list: Json = serde_json::json!([1, 2, -1, "x"]);
    assert_eq!(json_ids(Some(&list)), [1, 2]);
    assert_eq!(json_ids(Some(&serde_json::json!(7))), [7]);
}

#[test]
fn byte_fallback_and_special_ids_are_known() {
    let spm = load("spm");
    assert!(spm.has_byte_fallback());
    assert!(spm.is_byte_fallback_token(3)); // <0x00>
    assert!(spm.is_byte_fallback_token(258)); // <0xFF>
    assert!(!spm.is_byte_fallback_token(259));
    assert!(spm.is_special_token(1) && spm.is_special_token(2));
    assert!(!spm.is_special_token(3));
    let bl = load("bytelevel");
    assert!(!bl.has_byte_fallback());
    assert!(bl.is_special_token(0) && bl.is_special_token(2));
    assert!(!bl.is_special_token(3));
}

#[test]
fn missing_tokenizer_is_a_load_error() {
    let err = TextTokenizer::from_model_dir(Path::new("/nonexistent/model")).unwrap_err();
    assert!(matches!(err, TextError::TokenizerLoad { .. }), "{err}");
}

#[test]
fn end_of_generation_tokens_join_the_configured_eos() {
    // ChatML: `<|endoftext|>` (0) and `<|im_end|>` (2) end a reply.
    let tok = load("bytelevel");
    assert_eq!(tok.end_of_generation_ids(), [0, 2]);
    assert_eq!(with_end_of_generation(vec![2], &tok), [2, 0]);
    assert_eq!(with_end_of_generation(vec![2, 0], &tok), [2, 0]);
    // `</s>` is the SentencePiece EOS by its id, not by its text.
    let spm = load("spm");
    assert!(spm.end_of_generation_ids().is_empty());
    assert_eq!(with_end_of_generation(vec![2], &spm), [2]);
}
