//! Constrained decoding on the real SmolLM2-135M-Instruct tokenizer
//! (`MLXCEL_TEST_MODEL`, or `models/SmolLM2-135M-Instruct` at the repository
//! root, made by `scripts/setup.sh`; a missing model fails, never skips).
//!
//! No model runs: a seeded pseudo-random "model" scores every token, the
//! decoder masks the scores, the best allowed token is fed back, until the
//! grammar finishes or EOS is picked. The text is then checked by hand with
//! `serde_json`.

mod common;
use common::model_dir;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use mlxcel_text::constraint::{ConstrainedDecoder, ConstraintError, Grammar, GrammarTokenizer};
use mlxcel_text::output::{forced_call_prefix, OutputFilter, OutputPiece};
use mlxcel_text::tokenizer::{eos_token_ids, TextTokenizer};
use serde_json::{json, Value};

/// SmolLM2's `<|im_end|>`, its EOS.
const EOS: u32 = 2;
/// Extra output rows beyond the tokenizer's 49152 ids, to check padding.
const PAD_ROWS: usize = 64;

fn load(dir: &std::path::Path, extra_rows: usize) -> (TextTokenizer, GrammarTokenizer) {
    let text = TextTokenizer::from_model_dir(dir).unwrap();
    let eos = eos_token_ids(dir, &text);
    let rows = text.vocab_size() + extra_rows;
    let gt = GrammarTokenizer::new(&text, rows, &eos).unwrap();
    (text, gt)
}

/// splitmix64: a tiny seeded generator, enough for test scores.
struct Rng(u64);
impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// The output of a walk and the median time per mask.
struct Walk {
    ids: Vec<u32>,
    text: String,
    /// Median time of one `mask_logits` call.
    mask_time: Duration,
}

/// Drives a decoder with seeded random scores: pure noise for the first 16
/// steps, then a bias to tokens that close strings, objects and arrays (and
/// `eos_bonus` to EOS) so every walk ends. Fails after 600 steps.
fn walk(gt: &GrammarTokenizer, grammar: &Grammar, seed: u64, eos_bonus: f32) -> Walk {
    let mut dec = ConstrainedDecoder::new(gt, grammar).unwrap();
    let mut rng = Rng(seed);
    let mut ids = Vec::new();
    let mut bytes = Vec::new();
    let mut mask_times = Vec::new();
    let mut steps = 0u32;
    // Closing characters in each token, the late-walk bias.
    let closers: Vec<f32> = (0..gt.vocab_size() as u32)
        .map(|id| {
            let b = gt.token_bytes(id);
            b.iter().filter(|c| b"\"}]".contains(c)).count() as f32
        })
        .collect();
    while !dec.is_finished() {
        assert!(
            steps < 600,
            "no end after 600 steps: {:?}",
            String::from_utf8_lossy(&bytes)
        );
        let mut logits: Vec<f32> = (0..gt.vocab_size()).map(|_| rng.next_f32()).collect();
        if steps >= 16 {
            for (l, c) in logits.iter_mut().zip(&closers) {
                *l += 2.0 * c;
            }
            logits[EOS as usize] += eos_bonus;
        }
        let t0 = Instant::now();
        dec.mask_logits(&mut logits).unwrap();
        mask_times.push(t0.elapsed());
        let best = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap();
        assert!(logits[best].is_finite(), "no token allowed at step {steps}");
        dec.accept(best as u32).unwrap();
        steps += 1;
        if best as u32 == EOS {
            assert!(dec.is_finished());
            break;
        }
        ids.push(best as u32);
        bytes.extend(gt.token_bytes(best as u32));
    }
    let text = String::from_utf8(bytes).expect("grammar output is UTF-8");
    Walk {
        ids,
        text,
        mask_time: {
            mask_times.sort();
            mask_times[mask_times.len() / 2]
        },
    }
}

/// `value` is an object with exactly the properties of `weather_schema`.
fn check_weather_args(args: &Value) {
    let obj = args.as_object().expect("arguments are an object");
    assert!(obj["city"].is_string(), "{args}");
    assert!(["celsius", "fahrenheit"].contains(&obj["unit"].as_str().unwrap()));
    assert!(obj.keys().all(|k| k == "city" || k == "unit"), "{args}");
}

fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}
        },
        "required": ["city", "unit"],
        "additionalProperties": false
    })
}

fn time_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"],
        "additionalProperties": false
    })
}

/// The calls of a reply to `tool_choice: "required"` whose generated part
/// is `text`, read by the engine's own output filter after the forced
/// prefix: `(name, arguments)` each, and any text the filter let through.
fn tool_calls(text: &str, names: &[&str]) -> (Vec<(String, Value)>, String) {
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let filter = OutputFilter::forced(&[], &names, &forced_call_prefix(None));
    calls_of(filter, text)
}

/// The calls `filter` reads from `text`, as `(name, arguments)`, and the
/// text it lets through.
fn calls_of(mut filter: OutputFilter, text: &str) -> (Vec<(String, Value)>, String) {
    let mut out = filter.push(text);
    out.extend(filter.finish());
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut other = String::new();
    for piece in out.pieces {
        match piece {
            OutputPiece::CallStart { name, .. } => calls.push((name, String::new())),
            OutputPiece::CallArguments(a) => calls.last_mut().unwrap().1.push_str(&a),
            OutputPiece::Text(t) | OutputPiece::Reasoning(t) => other.push_str(&t),
        }
    }
    let calls = calls
        .into_iter()
        .map(|(name, args)| {
            let args = serde_json::from_str(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            (name, args)
        })
        .collect();
    (calls, other)
}

#[test]
fn json_object_walks_parse_as_objects() {
    let t0 = Instant::now();
    let (text_tok, gt) = load(&model_dir(), PAD_ROWS);
    eprintln!("GrammarTokenizer::new: {:?}", t0.elapsed());
    for seed in 0..4 {
        let w = walk(&gt, &Grammar::JsonObject, seed, 100.0);
        let v: Value =
            serde_json::from_str(&w.text).unwrap_or_else(|e| panic!("{:?}: {e}", w.text));
        assert!(v.is_object(), "{}", w.text);
        assert!(!w.text.contains('\n'), "no free whitespace: {:?}", w.text);
        // The trie's bytes agree with the tokenizer's own decoding.
        assert_eq!(text_tok.decode(&w.ids, false).unwrap(), w.text);
        eprintln!(
            "json_object seed {seed}: {} tokens, {:?}/mask: {}",
            w.ids.len(),
            w.mask_time,
            w.text
        );
    }
}

#[test]
fn json_schema_walks_satisfy_the_schema() {
    let (_, gt) = load(&model_dir(), 0);
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer"},
            "color": {"enum": ["red", "green", "blue"]}
        },
        "required": ["name", "age", "color"],
        "additionalProperties": false
    });
    let grammar = Grammar::JsonSchema(schema);
    grammar.validate().unwrap();
    for seed in 10..14 {
        let w = walk(&gt, &grammar, seed, 100.0);
        let v: Value =
            serde_json::from_str(&w.text).unwrap_or_else(|e| panic!("{:?}: {e}", w.text));
        let obj = v.as_object().unwrap();
        assert_eq!(obj.len(), 3, "{}", w.text);
        assert!(obj["name"].as_str().unwrap().chars().count() <= 30);
        assert!(obj["age"].is_i64() || obj["age"].is_u64(), "{}", w.text);
        assert!(["red", "green", "blue"].contains(&obj["color"].as_str().unwrap()));
        // Fixed separators: `", "` and `": "`.
        assert!(w.text.contains("\"age\": "), "{}", w.text);
        eprintln!("schema seed {seed}: {:?}/mask: {}", w.mask_time, w.text);
    }
}

#[test]
fn required_tool_calls_use_the_given_tools() {
    let (_, gt) = load(&model_dir(), 0);
    let grammar = Grammar::ToolCalls {
        tools: vec![
            ("get_weather".into(), weather_schema()),
            ("get_time".into(), time_schema()),
        ],
        single: false,
    };
    grammar.validate().unwrap();
    let mut names = Vec::new();
    let mut counts = Vec::new();
    for seed in 30..36 {
        // No EOS bonus: after each call, another call and EOS are equally likely.
        let w = walk(&gt, &grammar, seed, 0.0);
        let (calls, other) = tool_calls(&w.text, &["get_weather", "get_time"]);
        assert_eq!(other, "", "{}", w.text);
        counts.push(calls.len());
        for (name, args) in calls {
            match name.as_str() {
                "get_weather" => check_weather_args(&args),
                "get_time" => {
                    assert!(args["zone"].is_string() && args.as_object().unwrap().len() == 1)
                }
                other => panic!("unknown tool {other}"),
            }
            names.push(name);
        }
        eprintln!("required tools seed {seed}: {}", w.text);
    }
    assert!(names.iter().any(|n| n == "get_weather") && names.iter().any(|n| n == "get_time"));
    assert!(counts.iter().all(|&n| n >= 1), "{counts:?}");
    assert!(
        counts.iter().any(|&n| n > 1),
        "never more than one call: {counts:?}"
    );
}

#[test]
fn one_call_only_without_parallel_tool_calls() {
    let (_, gt) = load(&model_dir(), 0);
    let grammar = Grammar::ToolCalls {
        tools: vec![
            ("get_weather".into(), weather_schema()),
            ("get_time".into(), time_schema()),
        ],
        single: true,
    };
    for seed in 30..33 {
        let w = walk(&gt, &grammar, seed, 0.0);
        let (calls, other) = tool_calls(&w.text, &["get_weather", "get_time"]);
        assert_eq!((calls.len(), other.as_str()), (1, ""), "{}", w.text);
    }
}

#[test]
fn invalid_grammars_are_rejected() {
    let (_, gt) = load(&model_dir(), 0);
    let bad = [
        Grammar::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "nonsense"}}})),
        Grammar::JsonSchema(json!({"$ref": "#/$defs/missing"})),
        Grammar::JsonSchema(json!(42)),
        Grammar::ToolCalls {
            tools: vec![],
            single: false,
        },
        Grammar::ToolCalls {
            tools: vec![("f".into(), json!({"type": "wat"}))],
            single: false,
        },
    ];
    for g in &bad {
        let err = ConstrainedDecoder::new(&gt, g).err().unwrap();
        assert!(
            matches!(err, ConstraintError::InvalidGrammar(_)),
            "{g:?}: {err}"
        );
        let err = g.validate().unwrap_err();
        assert!(
            matches!(err, ConstraintError::InvalidGrammar(_)),
            "{g:?}: {err}"
        );
    }
}

#[test]
fn mask_at_the_start_of_a_json_object() {
    let (text, gt) = load(&model_dir(), PAD_ROWS);
    let n_tok = text.vocab_size();
    let brace = text.token_to_id("{").unwrap();
    let a = text.token_to_id("a").unwrap();
    let space_brace = text.token_to_id("Ġ{").unwrap();
    let mut dec = ConstrainedDecoder::new(&gt, &Grammar::JsonObject).unwrap();
    let mut logits = vec![0.0f32; n_tok + PAD_ROWS];
    dec.mask_logits(&mut logits).unwrap();
    let allowed: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize] == 0.0)
        .collect();
    assert!(allowed.contains(&brace));
    for id in [a, space_brace, EOS, 0] {
        assert!(!allowed.contains(&id), "token {id} allowed");
    }
    assert!(
        allowed.iter().all(|&id| (id as usize) < n_tok),
        "a padding row is allowed"
    );
    for &id in &allowed {
        assert_eq!(gt.token_bytes(id).first(), Some(&b'{'), "token {id}");
    }
    // Every one-token `{` prefix the tokenizer has is in the set, e.g. `{"`.
    let quote = text.token_to_id("{\"").unwrap();
    assert!(allowed.contains(&quote));
    // A wrong length is an error, not a panic.
    assert!(matches!(
        dec.mask_logits(&mut [0.0; 10]),
        Err(ConstraintError::Matcher(_))
    ));
}

#[test]
fn accept_rejects_forbidden_tokens_and_keeps_state() {
    let (text, gt) = load(&model_dir(), PAD_ROWS);
    let id = |s: &str| text.token_to_id(s).unwrap();
    let mut dec = ConstrainedDecoder::new(&gt, &Grammar::JsonObject).unwrap();
    for bad in [id("a"), EOS, (text.vocab_size() + 3) as u32, u32::MAX] {
        let err = dec.accept(bad).unwrap_err();
        assert!(
            matches!(err, ConstraintError::Rejected { token, .. } if token == bad),
            "{err}"
        );
    }
    // Still usable: `{` `}` completes the object and the grammar ends itself.
    dec.accept(id("{")).unwrap();
    assert!(!dec.is_finished());
    dec.accept(id("}")).unwrap();
    assert!(dec.is_finished());
    // Finished: only EOS is allowed, and accepting it is harmless.
    let mut logits = vec![0.0f32; gt.vocab_size()];
    dec.mask_logits(&mut logits).unwrap();
    let allowed: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] == 0.0).collect();
    assert_eq!(allowed, [EOS as usize]);
    assert!(dec.accept(id("a")).is_err());
    dec.accept(EOS).unwrap();
    assert!(dec.is_finished());
}

#[test]
fn eos_is_allowed_only_where_the_grammar_can_end() {
    let (text, gt) = load(&model_dir(), 0);
    let id = |s: &str| {
        let ids = text.encode(s, false).unwrap();
        assert_eq!(ids.len(), 1, "{s:?} is one token");
        ids[0] as usize
    };
    for single in [false, true] {
        let grammar = Grammar::ToolCalls {
            tools: vec![("get_time".into(), time_schema())],
            single,
        };
        let mut dec = ConstrainedDecoder::new(&gt, &grammar).unwrap();
        // The reply after `<tool_call>\n{"name": "`.
        let call = "get_time\", \"arguments\": {\"zone\": \"UTC\"}";
        for (i, t) in text.encode(call, false).unwrap().into_iter().enumerate() {
            let mut logits = vec![0.0f32; gt.vocab_size()];
            dec.mask_logits(&mut logits).unwrap();
            assert_eq!(
                logits[EOS as usize],
                f32::NEG_INFINITY,
                "EOS allowed at step {i}"
            );
            assert_eq!(
                logits[t as usize], 0.0,
                "token {t} of the call masked at step {i}"
            );
            dec.accept(t).unwrap();
        }
        // The arguments are complete: the reply may end, or close the call.
        let mut logits = vec![0.0f32; gt.vocab_size()];
        dec.mask_logits(&mut logits).unwrap();
        assert_eq!(logits[EOS as usize], 0.0);
        assert_eq!(logits[id("}")], 0.0);
        for t in text.encode("}\n</tool_call>\n", false).unwrap() {
            dec.accept(t).unwrap();
        }
        // After one complete call and a newline: with one call only, the
        // reply is complete; else it may end or call again.
        assert_eq!(dec.is_finished(), single);
        let mut logits = vec![0.0f32; gt.vocab_size()];
        dec.mask_logits(&mut logits).unwrap();
        assert_eq!(logits[EOS as usize], 0.0);
        assert_eq!(logits[id("<")] == 0.0, !single, "single: {single}");
        dec.accept(EOS).unwrap();
        assert!(dec.is_finished());
    }
}

#[test]
fn token_bytes_are_exact() {
    let (text, gt) = load(&model_dir(), PAD_ROWS);
    assert_eq!(gt.token_bytes(text.token_to_id("Ġthe").unwrap()), b" the");
    assert_eq!(gt.token_bytes(EOS), b"<|im_end|>");
    assert_eq!(gt.token_bytes(text.token_to_id("Ċ").unwrap()), b"\n");
    assert!(
        gt.token_bytes(text.vocab_size() as u32).is_empty(),
        "padding row"
    );
    assert!(gt.token_bytes(u32::MAX).is_empty());
    assert_eq!(gt.vocab_size(), text.vocab_size() + PAD_ROWS);
}

#[test]
fn bad_tokenizer_arguments_are_errors() {
    let text = TextTokenizer::from_model_dir(&model_dir()).unwrap();
    let n = text.vocab_size();
    for (rows, eos) in [(n - 1, vec![EOS]), (n + 8, vec![(n + 1) as u32])] {
        let err = GrammarTokenizer::new(&text, rows, &eos).err().unwrap();
        assert!(matches!(err, ConstraintError::Tokenizer(_)), "{err}");
    }
}

/// Qwen-style tokenizers have `<tool_call>`/`</tool_call>` as single added
/// tokens; the grammar must then use those tokens, not their spelled-out text.
#[test]
fn tool_tags_use_added_tokens_when_the_tokenizer_has_them() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("constraint-tool-tags");
    std::fs::create_dir_all(&dir).unwrap();
    let src = model_dir();
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    for (id, tag) in [(49152, "<tool_call>"), (49153, "</tool_call>")] {
        json["added_tokens"].as_array_mut().unwrap().push(json!({
            "id": id, "content": tag, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": false
        }));
    }
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    for f in [
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
    ] {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
    }
    let (text, gt) = load(&dir, 0);
    assert_eq!(text.vocab_size(), 49154);
    let grammar = Grammar::ToolCalls {
        tools: vec![("get_weather".into(), weather_schema())],
        single: false,
    };
    // Enough noise that the walk calls twice: the second call opens with
    // the `<tool_call>` token.
    let w = (40..60)
        .map(|seed| walk(&gt, &grammar, seed, 0.0))
        .find(|w| w.ids.contains(&49152))
        .expect("a walk with two calls");
    let pos = |id: u32| w.ids.iter().position(|&t| t == id);
    assert!(pos(49153) < pos(49152), "{}", w.text);
    // No tag is spelled out in plain text.
    let plain: Vec<u8> = w
        .ids
        .iter()
        .filter(|&&t| t < 49152)
        .flat_map(|&t| gt.token_bytes(t))
        .collect();
    assert!(
        !String::from_utf8_lossy(&plain).contains("tool_call>"),
        "{}",
        w.text
    );
    let (calls, other) = tool_calls(&w.text, &["get_weather"]);
    assert_eq!(other, "");
    assert!(calls.len() >= 2);
    calls.iter().for_each(|(_, args)| check_weather_args(args));
    // Qwen3-Coder's XML calls close (and a second call opens) with the
    // same tag tokens.
    let tools = [
        ("get_weather", xml_weather_schema()),
        ("get_time", time_schema()),
    ];
    let required = Grammar::XmlCalls {
        tools: tools
            .iter()
            .map(|(n, p)| (n.to_string(), p.clone()))
            .collect(),
        named: false,
        single: false,
    };
    let prefix = mlxcel_text::output::tool_calls::qwen3_coder::xml_forced_call_prefix(None);
    let w = (0..30)
        .map(|seed| walk(&gt, &required, seed, 0.0))
        .find(|w| w.ids.contains(&49152))
        .expect("an XML walk with two calls");
    assert!(w.ids.contains(&49153), "{}", w.text);
    let plain: Vec<u8> = w
        .ids
        .iter()
        .filter(|&&t| t < 49152)
        .flat_map(|&t| gt.token_bytes(t))
        .collect();
    assert!(
        !String::from_utf8_lossy(&plain).contains("tool_call>"),
        "{}",
        w.text
    );
    let (calls, other) = xml_calls(&w.text, &prefix, &tools);
    assert_eq!(other, "", "{}", w.text);
    assert!(calls.len() >= 2, "{}", w.text);
}

/// Mistral v11 tokenizers have `[TOOL_CALLS]` and `[ARGS]` as special
/// tokens: a required call writes those tokens (never their spelled-out
/// text), and the Mistral reader makes calls of the reply.
#[test]
fn mistral_calls_use_the_marker_tokens() {
    use mlxcel_engine_api::ToolDefinition;
    use mlxcel_text::output::tool_calls::mistral::mistral_forced_call_prefix;
    use mlxcel_text::output::ToolCallFormat;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("constraint-mistral-markers");
    std::fs::create_dir_all(&dir).unwrap();
    let src = model_dir();
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    for (id, marker) in [(49152, "[TOOL_CALLS]"), (49153, "[ARGS]")] {
        json["added_tokens"].as_array_mut().unwrap().push(json!({
            "id": id, "content": marker, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    }
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    for f in [
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
    ] {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
    }
    let (_, gt) = load(&dir, 0);
    let grammar = Grammar::MistralCalls {
        tools: vec![("get_weather".into(), weather_schema())],
        single: false,
    };
    grammar.validate().unwrap();
    // EOS may end the reply after any call; its bias outweighs the one
    // `[TOOL_CALLS]` gets for its `]` most of the time: the walks end, and
    // some call again first.
    let w = (0..60)
        .map(|seed| walk(&gt, &grammar, seed, 2.3))
        .find(|w| w.ids.contains(&49152))
        .expect("a walk that calls twice");
    assert!(w.ids.contains(&49153), "{}", w.text);
    let plain: Vec<u8> = w
        .ids
        .iter()
        .filter(|&&t| t < 49152)
        .flat_map(|&t| gt.token_bytes(t))
        .collect();
    let plain = String::from_utf8_lossy(&plain);
    assert!(
        !plain.contains("[ARGS]") && !plain.contains("[TOOL_CALLS]"),
        "{}",
        w.text
    );
    let tools = [ToolDefinition {
        name: "get_weather".into(),
        description: None,
        parameters: weather_schema(),
    }];
    let prefix = mistral_forced_call_prefix(None);
    let filter = OutputFilter::forced_in(ToolCallFormat::MistralV11, &[], &tools, &prefix);
    let (calls, other) = calls_of(filter, &w.text);
    assert_eq!(other, "", "{}", w.text);
    assert!(calls.len() >= 2, "{}", w.text);
    calls.iter().for_each(|(_, args)| check_weather_args(args));
}

#[test]
fn handles_cross_threads() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<ConstrainedDecoder>();
    send_sync::<GrammarTokenizer>();
}

/// Feeds `text`'s tokens to a fresh decoder of `grammar`, then says which
/// of `next` (strings of one token each) the grammar allows.
fn allowed_after(
    text: &TextTokenizer,
    gt: &GrammarTokenizer,
    grammar: &Grammar,
    prefix: &str,
    next: &[&str],
) -> Vec<bool> {
    let mut dec = ConstrainedDecoder::new(gt, grammar).unwrap();
    for t in text.encode(prefix, false).unwrap() {
        dec.accept(t).unwrap_or_else(|e| panic!("{prefix:?}: {e}"));
    }
    let mut logits = vec![0.0f32; gt.vocab_size()];
    dec.mask_logits(&mut logits).unwrap();
    next.iter()
        .map(|s| {
            let ids = text.encode(s, false).unwrap();
            assert_eq!(ids.len(), 1, "{s:?} is one token");
            logits[ids[0] as usize] == 0.0
        })
        .collect()
}

#[test]
fn listed_properties_close_an_object_unless_the_schema_opens_it() {
    // Missing `additionalProperties` counts as false (as llama.cpp and
    // xgrammar read it): after `{"a": 1` only `}` may follow, in nested
    // objects too; the model cannot invent keys.
    let (text, gt) = load(&model_dir(), 0);
    let closed = json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "object", "properties": {"c": {"type": "integer"}}}},
        "required": ["a"]
    });
    let g = Grammar::JsonSchema(closed.clone());
    assert_eq!(
        allowed_after(&text, &gt, &g, "{\"a\": 1, \"b\": {\"c\": 2", &[",", "}"]),
        [false, true]
    );
    // `a` and `b` both given: nothing else may follow.
    assert_eq!(
        allowed_after(&text, &gt, &g, "{\"a\": 1, \"b\": {\"c\": 2}", &[",", "}"]),
        [false, true]
    );
    // Explicitly open: more keys may follow.
    let mut open = closed.clone();
    open["additionalProperties"] = json!(true);
    let g = Grammar::JsonSchema(open);
    assert_eq!(
        allowed_after(&text, &gt, &g, "{\"a\": 1, \"b\": {\"c\": 2}", &[",", "}"]),
        [true, true]
    );
    // A bare object (no properties) stays any object.
    let g = Grammar::JsonSchema(json!({"type": "object"}));
    assert_eq!(
        allowed_after(&text, &gt, &g, "{\"x\": 1", &[",", "}"]),
        [true, true]
    );
    // Tool parameters are closed the same way.
    let params =
        json!({"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]});
    let g = Grammar::ToolCalls {
        tools: vec![("get_time".into(), params)],
        single: true,
    };
    let prefix = "get_time\", \"arguments\": {\"zone\": \"UTC\"";
    // (the wrapper's own `}` follows at once, so `}}` is the closing token)
    assert_eq!(
        allowed_after(&text, &gt, &g, prefix, &[",", "}}"]),
        [false, true]
    );
}

/// A string a grammar forces that holds a special token's text (a schema's
/// `enum` or `const`, a named call's argument) is spelled with ordinary
/// tokens: no special id is ever allowed inside it (the tokenizer's own
/// encoder would turn `<|im_end|>` into the EOS id and end the reply), and
/// the text comes out whole.
#[test]
fn special_token_text_in_forced_strings_is_spelled_as_text() {
    let (text_tok, gt) = load(&model_dir(), 0);
    let specials: Vec<u32> = (0..gt.vocab_size() as u32)
        .filter(|&id| text_tok.is_special_token(id))
        .collect();
    assert!(specials.contains(&EOS), "{specials:?}");
    for special in ["<|im_end|>", "<|im_start|>", "<|endoftext|>"] {
        let value = format!("x {special} y");
        let grammars = [
            json!({"type": "object", "properties": {"text": {"type": "string", "enum": [value]}},
                   "required": ["text"]}),
            json!({"type": "object", "properties": {"text": {"const": value}},
                   "required": ["text"], "additionalProperties": false}),
            json!({"type": "object", "properties": {"text": {"type": "string", "enum": [value, "other"]}},
                   "required": ["text"], "additionalProperties": false}),
        ];
        for schema in grammars {
            for seed in 0..3 {
                let w = walk(&gt, &Grammar::JsonSchema(schema.clone()), seed, 50.0);
                assert!(
                    !w.ids.iter().any(|id| specials.contains(id)),
                    "{special}: special ids in {:?}",
                    w.ids
                );
                let v: Value =
                    serde_json::from_str(&w.text).unwrap_or_else(|e| panic!("{:?}: {e}", w.text));
                assert!(
                    v["text"] == value.as_str() || v["text"] == "other",
                    "{special}: {}",
                    w.text
                );
            }
        }
        // A required call whose one tool takes only that string.
        let tools = vec![(
            "echo".to_string(),
            json!({"type": "object", "properties": {"text": {"const": value}},
                   "required": ["text"], "additionalProperties": false}),
        )];
        let grammar = Grammar::ToolCalls {
            tools,
            single: true,
        };
        let w = walk(&gt, &grammar, 7, 50.0);
        assert!(!w.ids.iter().any(|id| specials.contains(id)), "{:?}", w.ids);
        let (calls, other) = tool_calls(&w.text, &["echo"]);
        assert_eq!(other, "");
        assert_eq!(calls, vec![("echo".to_string(), json!({"text": value}))]);
    }
}

/// The calls a harmony reply to `tool_choice: "required"` makes, read
/// token by token (special tokens apart, as the engine reads them) by the
/// forced harmony filter: `(name, arguments)` each, and any text.
fn harmony_calls(text_tok: &TextTokenizer, ids: &[u32]) -> (Vec<(String, Value)>, String) {
    use mlxcel_engine_api::ToolDefinition;
    use mlxcel_text::detokenizer::IncrementalDetokenizer;
    use mlxcel_text::output::{harmony, ToolCallFormat};
    let tools: Vec<ToolDefinition> = ["get_weather", "get_time"]
        .iter()
        .map(|n| ToolDefinition {
            name: n.to_string(),
            description: None,
            parameters: json!({"type": "object"}),
        })
        .collect();
    let prefix = harmony::forced_call_prefix(None);
    let mut filter = OutputFilter::forced_in(ToolCallFormat::Harmony, &[], &tools, &prefix);
    let mut detok = IncrementalDetokenizer::new();
    let mut pieces = Vec::new();
    for &id in ids {
        let text = detok.push(text_tok, id).unwrap();
        pieces.extend(filter.push(&text).pieces);
        pieces.extend(filter.push_special_token(text_tok, id).pieces);
    }
    pieces.extend(filter.push(&detok.flush(text_tok).unwrap()).pieces);
    pieces.extend(filter.finish().pieces);
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut other = String::new();
    for piece in pieces {
        match piece {
            OutputPiece::CallStart { name, .. } => calls.push((name, String::new())),
            OutputPiece::CallArguments(a) => calls.last_mut().unwrap().1.push_str(&a),
            OutputPiece::Text(t) | OutputPiece::Reasoning(t) => other.push_str(&t),
        }
    }
    let calls = calls
        .into_iter()
        .map(|(name, args)| {
            let args = serde_json::from_str(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            (name, args)
        })
        .collect();
    (calls, other)
}

/// A required call in harmony: the grammar writes a name, the markers (as
/// the tokenizer's special tokens when it has them, else as text) and
/// arguments valid against the function's schema; the forced harmony
/// filter reads it back as that one call.
#[test]
fn harmony_required_calls_follow_the_schema() {
    let grammar = Grammar::HarmonyCall {
        tools: vec![
            ("get_weather".into(), weather_schema()),
            ("get_time".into(), time_schema()),
        ],
    };
    // The SmolLM2 tokenizer with gpt-oss's markers added as special tokens.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("constraint-harmony");
    std::fs::create_dir_all(&dir).unwrap();
    let src = model_dir();
    let mut tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    let markers = ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"];
    for (i, marker) in markers.iter().enumerate() {
        tokenizer["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(json!({
                "id": 49152 + i, "content": marker, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
    }
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    for f in [
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
    ] {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
    }
    let (harmony_text, harmony_gt) = load(&dir, 0);
    let (plain_text, plain_gt) = load(&model_dir(), 0);
    let mut names = std::collections::HashSet::new();
    for (text_tok, gt, special) in [
        (&harmony_text, &harmony_gt, true),
        (&plain_text, &plain_gt, false),
    ] {
        for seed in 0..6 {
            let w = walk(gt, &grammar, seed, 0.0);
            let constrain = w.text.find("<|constrain|>json<|message|>");
            assert!(constrain.is_some(), "{}", w.text);
            // The markers are one special token each, or none of them.
            assert_eq!(w.ids.contains(&49153), special, "{}", w.text);
            if !special {
                // Spelled as text, the markers are text to the filter too
                // (gpt-oss's tokenizer has them as special tokens).
                continue;
            }
            let (calls, other) = harmony_calls(text_tok, &w.ids);
            assert_eq!(other, "", "{}", w.text);
            assert_eq!(calls.len(), 1, "{}", w.text);
            let (name, args) = &calls[0];
            match name.as_str() {
                "get_weather" => check_weather_args(args),
                "get_time" => assert!(args["zone"].is_string(), "{args}"),
                other => panic!("called {other}"),
            }
            names.insert(name.clone());
        }
    }
    assert!(!names.is_empty());
}

/// `get_weather`'s schema with a typed (integer) and an optional
/// parameter, for the XML format.
fn xml_weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 20},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "note": {"type": "string", "maxLength": 10}
        },
        "required": ["city", "days", "unit"],
    })
}

/// The calls of a forced XML reply whose generated part is `text`, read by
/// the forced XML filter after `prefix`: `(name, arguments)` each, and any
/// text.
fn xml_calls(text: &str, prefix: &str, tools: &[(&str, Value)]) -> (Vec<(String, Value)>, String) {
    use mlxcel_engine_api::ToolDefinition;
    use mlxcel_text::output::ToolCallFormat;
    let tools: Vec<ToolDefinition> = tools
        .iter()
        .map(|(n, p)| ToolDefinition {
            name: n.to_string(),
            description: None,
            parameters: p.clone(),
        })
        .collect();
    let filter = OutputFilter::forced_in(ToolCallFormat::Qwen3CoderXml, &[], &tools, prefix);
    calls_of(filter, text)
}

/// Forced XML calls (Qwen3-Coder): the grammar writes parameters in the
/// format, typed ones as JSON valid for their schema, and the forced XML
/// filter reads them back as calls whose arguments match the schema.
#[test]
fn xml_forced_calls_follow_the_schema() {
    use mlxcel_text::output::tool_calls::qwen3_coder::xml_forced_call_prefix;
    let (_, gt) = load(&model_dir(), PAD_ROWS);
    let check = |args: &Value| {
        let obj = args.as_object().expect("object");
        let city = obj["city"].as_str().expect("city is a string");
        assert!((1..=20).contains(&city.chars().count()), "{args}");
        let note = obj
            .get("note")
            .map_or(Some(""), Value::as_str)
            .expect("note");
        assert!(note.chars().count() <= 10, "{args}");
        let days = obj["days"].as_i64().expect("days is an integer");
        assert!((1..=9).contains(&days), "{args}");
        assert!(["celsius", "fahrenheit"].contains(&obj["unit"].as_str().unwrap()));
        assert!(obj
            .keys()
            .all(|k| ["city", "days", "unit", "note"].contains(&k.as_str())));
    };
    let named = Grammar::XmlCalls {
        tools: vec![("get_weather".into(), xml_weather_schema())],
        named: true,
        single: true,
    };
    let prefix = xml_forced_call_prefix(Some("get_weather"));
    for seed in 0..6 {
        let w = walk(&gt, &named, seed, 0.0);
        let (calls, other) = xml_calls(&w.text, &prefix, &[("get_weather", xml_weather_schema())]);
        assert_eq!(other, "", "{}", w.text);
        assert_eq!(calls.len(), 1, "{}", w.text);
        check(&calls[0].1);
    }
    let tools = [
        ("get_weather", xml_weather_schema()),
        ("get_time", time_schema()),
    ];
    let required = Grammar::XmlCalls {
        tools: tools
            .iter()
            .map(|(n, p)| (n.to_string(), p.clone()))
            .collect(),
        named: false,
        single: false,
    };
    let prefix = xml_forced_call_prefix(None);
    let mut seen = std::collections::HashSet::new();
    for seed in 0..12 {
        let w = walk(&gt, &required, seed, 0.0);
        let (calls, other) = xml_calls(&w.text, &prefix, &tools);
        assert_eq!(other, "", "{}", w.text);
        assert!(!calls.is_empty(), "{}", w.text);
        for (name, args) in &calls {
            match name.as_str() {
                "get_weather" => check(args),
                "get_time" => assert!(args["zone"].is_string(), "{args}"),
                other => panic!("called {other}"),
            }
            seen.insert(name.clone());
        }
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
}

/// Whether `grammar` accepts `text` whole: every token of its encoding
/// (`text_tok`'s, so markers the tokenizer has as tokens are those ids),
/// then EOS.
fn accepts(text_tok: &TextTokenizer, gt: &GrammarTokenizer, grammar: &Grammar, text: &str) -> bool {
    accepts_ids(gt, grammar, &text_tok.encode(text, false).unwrap())
}

/// Whether `grammar` accepts the tokens `ids`, then EOS.
fn accepts_ids(gt: &GrammarTokenizer, grammar: &Grammar, ids: &[u32]) -> bool {
    let mut dec = ConstrainedDecoder::new(gt, grammar).unwrap();
    ids.iter().all(|&t| dec.accept(t).is_ok()) && dec.accept(EOS).is_ok()
}

/// Tools with a nested object, an array of objects, an enum, optional
/// keys, integers and numbers, `anyOf`, a type list, and schemas the
/// Gemma 4 translator cannot translate (no type, `$ref`).
fn gemma4_tools() -> Vec<(String, Value)> {
    vec![
        (
            "get_weather".into(),
            json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {
                        "type": "object",
                        "properties": {"deg": {"enum": ["C", "F"]}, "wind": {"type": "string"}},
                        "required": ["deg"]
                    }
                },
                "required": ["city"]
            }),
        ),
        (
            "route".into(),
            json!({
                "type": "object",
                "properties": {
                    "stops": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "lat": {"type": "number"}},
                            "required": ["name", "lat"]
                        }
                    },
                    "v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
                    "flag": {"type": ["boolean", "null"]}
                },
                "required": ["stops"]
            }),
        ),
        (
            "anything".into(),
            json!({
                "type": "object",
                "properties": {"x": {}, "y": {"$ref": "#/$defs/y"}},
                "required": ["x"]
            }),
        ),
    ]
}

/// Gemma 4's forced calls (markers as text): the grammar accepts the
/// notation of valid arguments and nothing else.
#[test]
fn gemma4_grammar_accepts_valid_arguments_only() {
    let (text_tok, gt) = load(&model_dir(), 0);
    let required = |single| Grammar::Gemma4Calls {
        tools: gemma4_tools(),
        named: false,
        single,
    };
    let grammar = required(false);
    grammar.validate().unwrap();
    let q = "<|\"|>";
    let s = |v: &str| format!("{q}{v}{q}");
    let end = "<tool_call|>";
    let valid = [
        // Every key, nested object.
        format!(
            "get_weather{{city:{},days:3,units:{{deg:{},wind:{}}}}}{end}",
            s("Paris"),
            s("C"),
            s("")
        ),
        // Optional keys left out, in order.
        format!("get_weather{{city:{}}}{end}", s("Paris")),
        format!(
            "get_weather{{city:{},units:{{deg:{}}}}}{end}",
            s("a}, b: call:x,"),
            s("F")
        ),
        format!("get_weather{{city:{},days:-12}}{end}", s("")),
        // An array of objects; a number may be an integer.
        format!(
            "route{{stops:[{{name:{},lat:48.85}},{{name:{},lat:2}}]}}{end}",
            s("A"),
            s("B")
        ),
        format!("route{{stops:[],v:7,flag:null}}{end}"),
        format!("route{{stops:[],v:{},flag:true}}{end}", s("abc")),
        // No type, `$ref`: any value of the notation.
        format!(
            "anything{{x:{{a:[1,{},null],b:true}},y:-0.5e3}}{end}",
            s("s")
        ),
        format!("anything{{x:{}}}{end}", s("t")),
        // Several calls.
        format!(
            "get_weather{{city:{}}}{end}<|tool_call>call:route{{stops:[]}}{end}",
            s("A")
        ),
    ];
    for text in &valid {
        assert!(accepts(&text_tok, &gt, &grammar, text), "{text}");
    }
    let invalid = [
        // Missing required key (top level, nested, in an array item).
        format!("get_weather{{days:3}}{end}"),
        format!("get_weather{{city:{},units:{{}}}}{end}", s("P")),
        format!("route{{stops:[{{name:{}}}]}}{end}", s("A")),
        // Wrong types.
        format!("get_weather{{city:{},days:3.5}}{end}", s("P")),
        format!("get_weather{{city:{},days:{}}}{end}", s("P"), s("3")),
        format!("get_weather{{city:3}}{end}"),
        format!("route{{stops:[{{name:{},lat:{}}}]}}{end}", s("A"), s("1")),
        format!("route{{stops:[],flag:1}}{end}"),
        format!("route{{stops:[],v:true}}{end}"),
        format!("route{{stops:[],v:{}}}{end}", s("abcd")),
        // Not in the enum.
        format!(
            "get_weather{{city:{},units:{{deg:{}}}}}{end}",
            s("P"),
            s("K")
        ),
        // Keys out of the schema's order, unknown keys.
        format!("get_weather{{days:3,city:{}}}{end}", s("P")),
        format!("get_weather{{city:{},wind:3}}{end}", s("P")),
        // An unknown function.
        format!("get_time{{zone:{}}}{end}", s("UTC")),
        // A string without its closing marker; a call without its end.
        format!("get_weather{{city:{q}Paris}}{end}"),
        format!("get_weather{{city:{}}}", s("P")),
        // JSON is not the notation.
        format!("get_weather{{\"city\":\"P\"}}{end}"),
        format!("get_weather{{city: {}}}{end}", s("P")),
        format!("anything{{x:}}{end}"),
    ];
    for text in &invalid {
        assert!(!accepts(&text_tok, &gt, &grammar, text), "{text}");
    }
    // One call only without parallel tool calls.
    assert!(!accepts(&text_tok, &gt, &required(true), &valid[9]));
    assert!(accepts(&text_tok, &gt, &required(true), &valid[1]));
    // A named function: the prompt holds `<|tool_call>call:NAME{`.
    let named = Grammar::Gemma4Calls {
        tools: vec![gemma4_tools().remove(0)],
        named: true,
        single: true,
    };
    assert!(accepts(
        &text_tok,
        &gt,
        &named,
        &format!("city:{}}}{end}", s("P"))
    ));
    assert!(!accepts(&text_tok, &gt, &named, &valid[1]));
    assert!(!accepts(&text_tok, &gt, &named, &format!("days:1}}{end}")));
    // Bad requests.
    for bad in [
        Grammar::Gemma4Calls {
            tools: vec![],
            named: false,
            single: false,
        },
        Grammar::Gemma4Calls {
            tools: gemma4_tools(),
            named: true,
            single: true,
        },
    ] {
        assert!(matches!(
            bad.validate(),
            Err(ConstraintError::InvalidGrammar(_))
        ));
    }
}

/// The calls of a forced Gemma 4 reply whose generated part is `text`.
fn gemma4_calls(text: &str, prefix: &str, names: &[&str]) -> (Vec<(String, Value)>, String) {
    use mlxcel_engine_api::ToolDefinition;
    use mlxcel_text::output::ToolCallFormat;
    let tools: Vec<ToolDefinition> = names
        .iter()
        .map(|n| ToolDefinition {
            name: n.to_string(),
            description: None,
            parameters: json!({"type": "object"}),
        })
        .collect();
    calls_of(
        OutputFilter::forced_in(ToolCallFormat::Gemma4, &[], &tools, prefix),
        text,
    )
}

/// Gemma 4's tokenizer has `<|tool_call>`, `<tool_call|>` and `<|"|>` as
/// special tokens: the grammar writes those tokens (never their
/// spelled-out text), and the forced Gemma 4 reader makes calls of the
/// reply; with the markers as text, the same.
#[test]
fn gemma4_calls_use_the_marker_tokens() {
    use mlxcel_text::output::tool_calls::gemma4::gemma4_forced_call_prefix;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("constraint-gemma4-markers");
    std::fs::create_dir_all(&dir).unwrap();
    let src = model_dir();
    let mut tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    let markers = [
        (49152, "<|tool_call>"),
        (49153, "<tool_call|>"),
        (49154, "<|\"|>"),
    ];
    for (id, marker) in markers {
        tokenizer["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(json!({
                "id": id, "content": marker, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
    }
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    for f in [
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
    ] {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
    }
    let (text_tok, gt) = load(&dir, 0);
    let tools = vec![
        ("get_weather".to_string(), weather_schema()),
        ("get_time".to_string(), time_schema()),
    ];
    let grammar = Grammar::Gemma4Calls {
        tools: tools.clone(),
        named: false,
        single: false,
    };
    // The notation with the marker tokens is accepted; a marker spelled
    // out as text is not.
    let valid = "get_weather{city:<|\"|>a\"|><|\"|>,unit:<|\"|>celsius<|\"|>}<tool_call|>";
    let ids = text_tok.encode(valid, false).unwrap();
    assert_eq!(ids.iter().filter(|&&t| t == 49154).count(), 4, "{ids:?}");
    assert!(accepts_ids(&gt, &grammar, &ids));
    let spelled: Vec<u32> = [
        "get_weather{city:<|\"|",
        ">a<|\"|>,unit:<|\"|>celsius<|\"|>}<tool_call|>",
    ]
    .iter()
    .flat_map(|t| text_tok.encode(t, false).unwrap())
    .collect();
    assert_eq!(
        spelled.iter().filter(|&&t| t == 49154).count(),
        3,
        "{spelled:?}"
    );
    assert!(!accepts_ids(&gt, &grammar, &spelled));
    // Nor inside a string between the quote tokens (the reader would end
    // the string there); the same string without it is accepted.
    let ids_of = |inner: &[&str]| -> Vec<u32> {
        let mut ids = text_tok.encode("get_weather{city:", false).unwrap();
        ids.push(49154);
        for piece in inner {
            ids.extend(text_tok.encode(piece, false).unwrap());
        }
        ids.push(49154);
        ids.extend(
            text_tok
                .encode(",unit:<|\"|>celsius<|\"|>}<tool_call|>", false)
                .unwrap(),
        );
        ids
    };
    assert!(accepts_ids(&gt, &grammar, &ids_of(&["a<|\"|", "b"])));
    assert!(!accepts_ids(&gt, &grammar, &ids_of(&["a<|\"|", ">b"])));
    // Walks: the markers come as their tokens, the reader makes calls.
    let prefix = gemma4_forced_call_prefix(None);
    let mut twice = false;
    for seed in 0..8 {
        let w = walk(&gt, &grammar, seed, 2.3);
        assert!(
            w.ids.contains(&49153) && w.ids.contains(&49154),
            "{}",
            w.text
        );
        let plain: Vec<u8> = w
            .ids
            .iter()
            .filter(|&&t| t < 49152)
            .flat_map(|&t| gt.token_bytes(t))
            .collect();
        let plain = String::from_utf8_lossy(&plain);
        for (_, marker) in markers {
            assert!(!plain.contains(marker), "{}", w.text);
        }
        let (calls, other) = gemma4_calls(&w.text, &prefix, &["get_weather", "get_time"]);
        assert_eq!(other, "", "{}", w.text);
        assert!(!calls.is_empty(), "{}", w.text);
        twice |= calls.len() > 1;
        for (name, args) in &calls {
            match name.as_str() {
                "get_weather" => check_weather_args(args),
                "get_time" => assert!(
                    args["zone"]
                        .as_str()
                        .is_some_and(|z| z.chars().count() <= 12),
                    "{args}"
                ),
                other => panic!("called {other}"),
            }
        }
    }
    assert!(twice, "no walk called twice");
    // A named call, markers as text (the SmolLM2 tokenizer as it is).
    let (_, plain_gt) = load(&model_dir(), 0);
    let named = Grammar::Gemma4Calls {
        tools: vec![tools[0].clone()],
        named: true,
        single: true,
    };
    let prefix = gemma4_forced_call_prefix(Some("get_weather"));
    for seed in 0..4 {
        let w = walk(&plain_gt, &named, seed, 0.0);
        let (calls, other) = gemma4_calls(&w.text, &prefix, &["get_weather"]);
        assert_eq!(other, "", "{}", w.text);
        assert_eq!(calls.len(), 1, "{}", w.text);
        check_weather_args(&calls[0].1);
    }
}

/// The rest of the Gemma 4 translator: a key that is not a plain word
/// (written as a string), `const` of an object, objects without
/// `properties` (open to keys whose values follow `additionalProperties`,
/// or closed), `minItems`, and the depth bound (nesting past it is any
/// value of the notation).
#[test]
fn gemma4_grammar_quotes_keys_and_bounds_depth() {
    let (text_tok, gt) = load(&model_dir(), 0);
    let mut deep = json!({"type": "integer"});
    for _ in 0..20 {
        deep = json!({"type": "object", "properties": {"n": deep}, "required": ["n"]});
    }
    let schema = json!({
        "type": "object",
        "properties": {
            "odd key": {"const": {"a": [1, "x"]}},
            "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
            "none": {"type": "object", "additionalProperties": false},
            "list": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "deep": deep
        },
        "required": ["odd key", "tags", "none", "list", "deep"]
    });
    let grammar = Grammar::Gemma4Calls {
        tools: vec![("f".into(), schema)],
        named: false,
        single: true,
    };
    let q = "<|\"|>";
    let nested = |levels: usize, inner: &str| {
        format!("{}{inner}{}", "{n:".repeat(levels), "}".repeat(levels))
    };
    let args = |odd: &str, tags: &str, none: &str, list: &str, deep: &str| {
        format!("f{{{odd}:{{a:[1,{q}x{q}]}},tags:{tags},none:{none},list:{list},deep:{deep}}}<tool_call|>")
    };
    let odd = format!("{q}odd key{q}");
    let (tags, list) = ("{a:1,b_2:-3}".to_owned(), format!("[{q}{q},{q}y{q}]"));
    assert!(accepts(
        &text_tok,
        &gt,
        &grammar,
        &args(&odd, &tags, "{}", &list, &nested(20, "5"))
    ));
    assert!(accepts(
        &text_tok,
        &gt,
        &grammar,
        &args(&odd, "{}", "{}", &list, &nested(20, "5"))
    ));
    // Past the depth bound any value goes; before it, the schema holds.
    assert!(accepts(
        &text_tok,
        &gt,
        &grammar,
        &args(&odd, &tags, "{}", &list, &nested(19, &format!("{q}s{q}")))
    ));
    assert!(!accepts(
        &text_tok,
        &gt,
        &grammar,
        &args(&odd, &tags, "{}", &list, &nested(3, &format!("{q}s{q}")))
    ));
    for (odd, tags, none, list) in [
        ("odd key", tags.as_str(), "{}", list.as_str()),
        (&odd, "{a:true}", "{}", &list),
        (&odd, &tags, "{a:1}", &list),
        (&odd, &tags, "{}", "[]"),
        (&odd, &tags, "{}", "[1]"),
    ] {
        let text = args(odd, tags, none, list, &nested(20, "5"));
        assert!(!accepts(&text_tok, &gt, &grammar, &text), "{text}");
    }
    let other_const = args(&odd, &tags, "{}", &list, &nested(20, "5")).replace("[1,", "[2,");
    assert!(!accepts(&text_tok, &gt, &grammar, &other_const));
}
