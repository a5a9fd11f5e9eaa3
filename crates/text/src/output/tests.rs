use super::*;
use crate::reasoning::{ReasoningMarkers, ReasoningSplitter};

mod formats;

/// A call as the pieces built it.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

/// What a choice sent: its text, its calls, whether a stop string ended
/// it, and every argument fragment in order.
#[derive(Debug, Default)]
struct Sent {
    text: String,
    reasoning: String,
    calls: Vec<Call>,
    stopped: bool,
    fragments: Vec<String>,
}

impl Sent {
    fn take(&mut self, f: Filtered) {
        for piece in f.pieces {
            match piece {
                OutputPiece::Text(t) => self.text += &t,
                OutputPiece::Reasoning(t) => self.reasoning += &t,
                OutputPiece::CallStart { id, name } => self.calls.push(Call {
                    id,
                    name,
                    arguments: String::new(),
                }),
                OutputPiece::CallArguments(a) => {
                    self.calls
                        .last_mut()
                        .expect("arguments before a call")
                        .arguments += &a;
                    self.fragments.push(a);
                }
            }
        }
        self.stopped |= f.stopped;
    }
}

/// Feeds `pieces` one by one, then finishes.
fn run(filter: &mut OutputFilter, pieces: &[&str]) -> Sent {
    let mut sent = Sent::default();
    for p in pieces {
        sent.take(filter.push(p));
        if sent.stopped {
            return sent;
        }
    }
    sent.take(filter.finish());
    sent
}

/// `text` split into pieces of `n` characters (tokens of a sort).
fn chunks(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(n).map(|c| c.iter().collect()).collect()
}

fn run_chunked(filter: &mut OutputFilter, text: &str, n: usize) -> Sent {
    let pieces = chunks(text, n);
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    run(filter, &pieces)
}

fn tools(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| n.to_string()).collect()
}

/// Offered functions named `names`, without parameters.
fn definitions(names: &[&str]) -> Vec<ToolDefinition> {
    names
        .iter()
        .map(|n| ToolDefinition {
            name: n.to_string(),
            description: None,
            parameters: serde_json::json!({"type": "object"}),
        })
        .collect()
}

/// Stop strings and calls are looked for in the answer only: inside
/// the reasoning they are text.
#[test]
fn reasoning_is_split_off_before_stops_and_calls() {
    let text = "<think>\nSTOP is no stop here, nor <tool_call> a call.\n</think>\n\n\
                Calling. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\
                STOP after";
    for n in 1..=text.chars().count() {
        let mut f = OutputFilter::new(&["STOP".into()], &tools(&["f"]))
            .with_reasoning(ReasoningSplitter::new(ReasoningMarkers::THINK, false));
        let sent = run_chunked(&mut f, text, n);
        assert_eq!(
            sent.reasoning, "STOP is no stop here, nor <tool_call> a call.",
            "pieces of {n}"
        );
        assert_eq!(sent.text.trim_end(), "Calling.", "pieces of {n}");
        assert_eq!(sent.calls.len(), 1, "pieces of {n}");
        assert_eq!(sent.calls[0].arguments, "{\"x\": 1}", "pieces of {n}");
        assert!(sent.stopped, "pieces of {n}");
    }
}

#[test]
fn a_stop_string_split_across_pieces_ends_the_text_before_it() {
    let mut f = OutputFilter::new(&["END".into()], &[]);
    assert_eq!(f.push("Hello E").text(), "Hello ");
    assert_eq!(f.push("N").text(), "");
    assert_eq!(f.stop_sequence(), None);
    let last = f.push("D and more");
    assert_eq!(last.text(), "");
    assert!(last.stopped);
    assert_eq!(f.stop_sequence(), Some("END"));
    assert_eq!(f.push("ignored"), Filtered::default());
}

#[test]
fn held_text_that_turns_out_not_to_stop_is_sent() {
    let mut f = OutputFilter::new(&["\n\n".into(), "###".into()], &[]);
    assert_eq!(f.push("a\n").text(), "a");
    assert_eq!(f.push("b#").text(), "\nb");
    assert_eq!(f.push("#x").text(), "##x");
    assert_eq!(f.finish().text(), "");
    let sent = run(&mut OutputFilter::new(&["##".into()], &[]), &["1#", "2#"]);
    assert_eq!((sent.text.as_str(), sent.stopped), ("1#2#", false));
}

#[test]
fn the_earliest_of_several_stop_strings_wins() {
    let stops = ["world".to_string(), "lo w".to_string()];
    let mut f = OutputFilter::new(&stops, &[]);
    let sent = run(&mut f, &["hello world"]);
    assert_eq!((sent.text.as_str(), sent.stopped), ("hel", true));
    assert_eq!(f.stop_sequence(), Some("lo w"));
    let mut f = OutputFilter::new(&stops, &[]);
    run(&mut f, &["no stop here"]);
    assert_eq!(f.stop_sequence(), None);
}

#[test]
fn multibyte_text_is_cut_on_character_boundaries() {
    let mut f = OutputFilter::new(&["éa".into()], &[]);
    assert_eq!(f.push("xyé").text(), "xy");
    assert_eq!(f.push("b").text(), "éb");
}

#[test]
fn tool_calls_are_parsed_and_their_text_withheld() {
    let mut f = OutputFilter::new(&[], &tools(&["get_weather", "now", "f"]));
    let pieces = [
        "Let me check.",
        "<tool_",
        "call>\n{\"name\": \"get_weather\", ",
        "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "\n<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>\n",
    ];
    let sent = run(&mut f, &pieces);
    assert_eq!(sent.text, "Let me check.");
    assert_eq!(sent.calls.len(), 2);
    assert_eq!(sent.calls[0].name, "get_weather");
    // The arguments exactly as generated.
    assert_eq!(sent.calls[0].arguments, r#"{"city": "Paris"}"#);
    assert_eq!(sent.calls[1].name, "now");
    assert_eq!(sent.calls[1].arguments, "{}");
    assert!(sent.calls[0].id.starts_with("call_") && sent.calls[0].id.len() == 29);
    assert_ne!(sent.calls[0].id, sent.calls[1].id);
    assert_eq!(f.tool_calls(), 2);
}

#[test]
fn arguments_stream_as_they_are_generated() {
    let args = r#"{"city": "Paris", "days": [1, 2, {"x": "}"}]}"#;
    let call =
        format!("<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {args}}}\n</tool_call>");
    let mut f = OutputFilter::new(&[], &tools(&["get_weather"]));
    let pieces = chunks(&call, 3);
    let mut started_at = None;
    let mut sent = Sent::default();
    for (i, p) in pieces.iter().enumerate() {
        sent.take(f.push(p));
        if started_at.is_none() && !sent.calls.is_empty() {
            started_at = Some(i);
        }
    }
    sent.take(f.finish());
    // The call starts as soon as `"arguments": {` is read, long before
    // the arguments end, and the fragments add up to them.
    let header = call.find("{\"city\"").unwrap();
    assert_eq!(started_at, Some(header / 3));
    assert!(sent.fragments.len() > 5, "{:?}", sent.fragments);
    assert_eq!(sent.calls.len(), 1);
    assert_eq!(sent.calls[0].arguments, args);
    assert_eq!(sent.text, "");
}

#[test]
fn a_closing_tag_inside_an_argument_string_is_argument_text() {
    // Every piece of the wrapper inside strings: the call ends where its
    // JSON does, whatever the split.
    let code = r#"<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call> } </tool_call"#;
    let args = format!("{{\"code\": \"{code}\"}}");
    let streamed = format!("<tool_call>\n{{\"name\": \"f\", \"arguments\": {args}}}\n</tool_call>");
    // Keys in the other order: held whole, parsed at its end.
    let held = format!("<tool_call>\n{{\"arguments\": {args}, \"name\": \"f\"}}\n</tool_call>");
    for call in [&streamed, &held] {
        for n in [1, 2, 5, 64] {
            let sent = run_chunked(&mut OutputFilter::new(&[], &tools(&["f"])), call, n);
            assert_eq!(sent.text, "", "{call} by {n}");
            assert_eq!(sent.calls.len(), 1, "{call} by {n}");
            let parsed: serde_json::Value = serde_json::from_str(&sent.calls[0].arguments).unwrap();
            let want: serde_json::Value = serde_json::from_str(&args).unwrap();
            assert_eq!(parsed, want, "{call} by {n}");
        }
    }
}

#[test]
fn a_call_without_a_closing_tag_is_parsed_at_the_end() {
    let sent = run(
        &mut OutputFilter::new(&[], &tools(&["get_weather", "now", "f"])),
        &["<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}"],
    );
    assert_eq!(sent.text, "");
    // String-encoded arguments are sent decoded.
    assert_eq!(sent.calls[0].arguments, "{\"a\": 1}");
}

#[test]
fn text_after_a_call_without_its_closing_tag_is_kept() {
    let sent = run(
        &mut OutputFilter::new(&[], &tools(&["now"])),
        &[
            "<tool_call>{\"name\": \"now\", \"arguments\": {}",
            "} Done.",
        ],
    );
    assert_eq!(sent.calls.len(), 1);
    assert_eq!(sent.text, "Done.");
}

#[test]
fn malformed_calls_and_lookalike_text_stay_text() {
    let sent = run(
        &mut OutputFilter::new(&[], &tools(&["get_weather", "now", "f"])),
        &["a <tool", "_cal", "l>not json</tool_call> b <to"],
    );
    assert!(sent.calls.is_empty());
    assert_eq!(sent.text, "a <tool_call>not json</tool_call> b <to");
}

#[test]
fn calls_of_functions_not_offered_stay_text() {
    let call = "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>";
    let sent = run(&mut OutputFilter::new(&[], &tools(&["now"])), &[call]);
    assert!(sent.calls.is_empty());
    assert_eq!(sent.text, call);
    let sent = run(
        &mut OutputFilter::new(&[], &tools(&["now", "rm_rf"])),
        &[call],
    );
    assert_eq!((sent.text.as_str(), sent.calls.len()), ("", 1));
}

#[test]
fn without_tool_parsing_tags_are_plain_text() {
    let sent = run(
        &mut OutputFilter::new(&[], &[]),
        &["<tool_call>{\"name\": \"f\"}</tool_call>"],
    );
    assert!(sent.calls.is_empty());
    assert_eq!(sent.text, "<tool_call>{\"name\": \"f\"}</tool_call>");
}

#[test]
fn a_named_forced_call_is_its_generated_arguments() {
    let prefix = forced_call_prefix(Some("get_weather"));
    assert_eq!(
        prefix,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
    );
    let names = tools(&["get_weather", "now"]);
    // Complete: the grammar ends the choice after the arguments.
    let mut f = OutputFilter::forced(&[], &names, &prefix);
    let sent = run(&mut f, &["{\"city\"", ": \"Pa", "ris\"}"]);
    assert_eq!(sent.text, "");
    assert_eq!(sent.calls.len(), 1);
    assert_eq!(sent.calls[0].name, "get_weather");
    assert_eq!(sent.calls[0].arguments, "{\"city\": \"Paris\"}");
    assert_eq!(sent.fragments.len(), 3);
    // Cut by max_tokens: the call stands, with the arguments as
    // generated; no wrapper text.
    let mut f = OutputFilter::forced(&[], &names, &prefix);
    let sent = run(&mut f, &["{\"city\"", ": \"Pa"]);
    assert_eq!(sent.text, "");
    assert_eq!(sent.calls[0].arguments, "{\"city\": \"Pa");
    assert_eq!(f.tool_calls(), 1);
}

#[test]
fn required_calls_continue_the_prefix_and_never_leave_wrapper_text() {
    let prefix = forced_call_prefix(None);
    let names = tools(&["get_weather", "now"]);
    let reply = "now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"</tool_call>\"}}\n</tool_call>\n";
    for n in [1, 3, 200] {
        let sent = run_chunked(&mut OutputFilter::forced(&[], &names, &prefix), reply, n);
        assert_eq!(sent.text, "", "by {n}");
        let got: Vec<(&str, &str)> = sent
            .calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("now", "{}"),
                ("get_weather", "{\"city\": \"</tool_call>\"}")
            ],
            "by {n}"
        );
    }
    // Cut inside the closing tag: the calls, and no text.
    let cut = &reply[..reply.find("</tool_call>\n<tool_call>").unwrap() + 6];
    let sent = run_chunked(&mut OutputFilter::forced(&[], &names, &prefix), cut, 4);
    assert_eq!((sent.text.as_str(), sent.calls.len()), ("", 1));
    let sent = run_chunked(
        &mut OutputFilter::new(&[], &names),
        &format!("{prefix}{cut}"),
        4,
    );
    assert_eq!((sent.text.as_str(), sent.calls.len()), ("", 1));
    // Cut inside the name: no call, and no text either.
    let mut f = OutputFilter::forced(&[], &names, &prefix);
    let sent = run(&mut f, &["get_wea"]);
    assert_eq!((sent.text.as_str(), sent.calls.len()), ("", 0));
}

/// A required choice cut by `max_tokens` anywhere between two calls (the
/// next call's wrapper half written: `\n<`, `\n<tool`, `\n<tool_call`,
/// ...) sends the first call and no text at all.
#[test]
fn a_required_reply_cut_between_calls_sends_no_wrapper_text() {
    let prefix = forced_call_prefix(None);
    let names = tools(&["get_weather", "now"]);
    let reply = "now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}";
    let first_end = reply.find("}}").unwrap() + 2;
    let second_name = reply.find("get_weather").unwrap();
    for cut in first_end..second_name {
        for n in [1, 2, 5, 200] {
            let sent = run_chunked(
                &mut OutputFilter::forced(&[], &names, &prefix),
                &reply[..cut],
                n,
            );
            assert_eq!(
                (sent.text.as_str(), sent.calls.len()),
                ("", 1),
                "cut after {:?}, chunks of {n}",
                &reply[first_end..cut]
            );
        }
    }
}

// --- Llama 3.1-3.3's bare JSON calls ----------------------------------------

/// Every split of `text` into pieces of 1 to 7 characters, through a
/// filter reading calls of `names` in `format`.
fn each_split(format: ToolCallFormat, names: &[&str], text: &str, check: impl Fn(&Sent, usize)) {
    let tools = definitions(names);
    for n in 1..=7 {
        let mut filter = OutputFilter::with_format(&[], &tools, format);
        check(&run_chunked(&mut filter, text, n), n);
    }
}

fn llama3_each_split(names: &[&str], text: &str, check: impl Fn(&Sent, usize)) {
    each_split(ToolCallFormat::Llama3Json, names, text, check)
}

#[test]
fn llama3_json_calls_stream_as_calls() {
    let reply =
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": [1, 2]}}";
    llama3_each_split(&["get_weather"], reply, |sent, n| {
        assert_eq!(sent.text, "", "pieces of {n}");
        assert_eq!(sent.calls.len(), 1, "pieces of {n}");
        assert_eq!(sent.calls[0].name, "get_weather");
        assert_eq!(
            sent.calls[0].arguments, "{\"city\": \"Paris\", \"days\": [1, 2]}",
            "pieces of {n}"
        );
    });
    // After `<|python_tag|>` and whitespace; two calls separated by `;`.
    let two = "\n<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}";
    llama3_each_split(&["a", "b"], two, |sent, n| {
        assert_eq!(sent.text, "", "pieces of {n}");
        let names: Vec<&str> = sent.calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"], "pieces of {n}");
        assert_eq!(sent.calls[1].arguments, "{\"x\": 1}");
    });
}

#[test]
fn llama3_json_markup_inside_arguments_is_argument_text() {
    // The format's own markup (`<|python_tag|>`, a call object, `;`, `}`)
    // inside an argument string stays in the argument.
    let inner = "<|python_tag|>{\\\"name\\\": \\\"a\\\", \\\"parameters\\\": {}}; }";
    let reply = format!("{{\"name\": \"echo\", \"parameters\": {{\"text\": \"{inner}\"}}}}");
    llama3_each_split(&["echo", "a"], &reply, |sent, n| {
        assert_eq!(sent.text, "", "pieces of {n}");
        assert_eq!(sent.calls.len(), 1, "pieces of {n}");
        assert_eq!(
            sent.calls[0].arguments,
            format!("{{\"text\": \"{inner}\"}}"),
            "pieces of {n}"
        );
    });
}

#[test]
fn llama3_json_replies_that_are_not_calls_are_text() {
    for (names, reply) in [
        // Prose, even with a call-shaped object later: calls open a reply.
        (&["f"][..], "Sure: {\"name\": \"f\", \"parameters\": {}}"),
        // JSON that is not a call.
        (&["f"][..], "{\"answer\": 42, \"name\": \"f\"}"),
        // A function that was not offered.
        (&["f"][..], "{\"name\": \"g\", \"parameters\": {\"x\": 1}}"),
        // Whitespace, then prose.
        (&["f"][..], "  \n The answer is 4."),
        // The start of the marker, then prose.
        (&["f"][..], "<|python"),
    ] {
        llama3_each_split(names, reply, |sent, n| {
            assert!(sent.calls.is_empty(), "{reply:?} in pieces of {n}");
            assert_eq!(sent.text, reply, "{reply:?} in pieces of {n}");
        });
    }
}

#[test]
fn the_tool_call_format_follows_the_chat_template() {
    let llama31 = "{%- if tools %}<|start_header_id|>system<|end_header_id|>{%- endif %}\
        {{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}";
    assert_eq!(
        ToolCallFormat::from_template(llama31),
        ToolCallFormat::Llama3Json
    );
    let qwen = "<|im_start|>{%- if tools %}<tool_call>\n{\"name\": ...}</tool_call>{%- endif %}";
    assert_eq!(ToolCallFormat::from_template(qwen), ToolCallFormat::Hermes);
    // A Llama 3 template without tools: Hermes (mlxcel describes tools in
    // that format to templates that do not know them).
    let plain = "<|start_header_id|>{{ message['role'] }}<|end_header_id|>";
    assert_eq!(ToolCallFormat::from_template(plain), ToolCallFormat::Hermes);
}

// --- Mistral's v3 JSON list of calls -----------------------------------------

fn mistral_each_split(names: &[&str], text: &str, check: impl Fn(&Sent, usize)) {
    each_split(ToolCallFormat::MistralJson, names, text, check)
}

#[test]
fn mistral_json_lists_of_calls_stream_as_calls() {
    let reply = " [{\"name\": \"a\", \"arguments\": {\"q\": \"x], {\\\"name\\\": 1}\"}}, {\"name\": \"b\", \"arguments\": {}}]";
    mistral_each_split(&["a", "b"], reply, |sent, n| {
        assert_eq!(sent.text, "", "pieces of {n}");
        let names: Vec<&str> = sent.calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"], "pieces of {n}");
        assert_eq!(
            sent.calls[0].arguments, "{\"q\": \"x], {\\\"name\\\": 1}\"}",
            "pieces of {n}"
        );
        assert_eq!(sent.calls[1].arguments, "{}", "pieces of {n}");
    });
}

#[test]
fn mistral_json_replies_that_are_not_calls_are_text() {
    for reply in [
        "Hello [{\"name\": \"a\", \"arguments\": {}}]",
        "[1, 2, 3]",
        "[{\"answer\": 4}]",
        "[{\"name\": \"z\", \"arguments\": {}}]",
        "[",
    ] {
        mistral_each_split(&["a"], reply, |sent, n| {
            assert!(sent.calls.is_empty(), "{reply:?} in pieces of {n}");
            assert_eq!(sent.text, reply, "{reply:?} in pieces of {n}");
        });
    }
    let v3 = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]";
    assert_eq!(
        ToolCallFormat::from_template(v3),
        ToolCallFormat::MistralJson
    );
    let v11 = "[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}";
    assert_eq!(
        ToolCallFormat::from_template(v11),
        ToolCallFormat::MistralV11
    );
}

// --- Qwen3-Coder's XML calls -----------------------------------------------

/// `text` through a filter reading `tools` in `format`: whole, cut once at
/// every character boundary, and in pieces of 1 to 7 characters; `check`
/// sees every outcome, and every outcome equals the whole one.
fn each_cut(format: ToolCallFormat, tools: &[ToolDefinition], text: &str, check: impl Fn(&Sent)) {
    let summary = |s: &Sent| {
        let calls: Vec<(String, String)> = s
            .calls
            .iter()
            .map(|c| (c.name.clone(), c.arguments.clone()))
            .collect();
        (s.text.clone(), s.reasoning.clone(), calls)
    };
    let whole = run(&mut OutputFilter::with_format(&[], tools, format), &[text]);
    check(&whole);
    let want = summary(&whole);
    for cut in (1..text.len()).filter(|&i| text.is_char_boundary(i)) {
        let mut filter = OutputFilter::with_format(&[], tools, format);
        let sent = run(&mut filter, &[&text[..cut], &text[cut..]]);
        assert_eq!(summary(&sent), want, "cut at {cut}: {text:?}");
    }
    for n in 1..=7 {
        let mut filter = OutputFilter::with_format(&[], tools, format);
        let sent = run_chunked(&mut filter, text, n);
        assert_eq!(summary(&sent), want, "pieces of {n}: {text:?}");
    }
}

/// `get_weather(city: string, days: integer, units: ["string", "null"],
/// options: object)` and `now()`.
fn weather_tools() -> Vec<ToolDefinition> {
    let mut tools = definitions(&["get_weather", "now"]);
    tools[0].parameters = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"type": ["string", "null"]},
            "options": {"type": "object"},
        },
    });
    tools
}

#[test]
fn the_qwen3_coder_template_picks_the_xml_format() {
    let coder = "{%- if tools %}<tools>...</tools>{%- endif %}<tool_call>\n<function=\
                 {{ tool_call.name }}>\n<parameter={{ args_name }}>\n{{ args_value }}\n\
                 </parameter>\n</function>\n</tool_call>";
    assert_eq!(
        ToolCallFormat::from_template(coder),
        ToolCallFormat::Qwen3CoderXml
    );
}

#[test]
fn qwen3_coder_calls_read_values_as_the_schema_says() {
    let reply = "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n\
                 New \"York\"\n</parameter>\n<parameter=days>\n3\n</parameter>\n\
                 <parameter=units>\n42\n</parameter>\n<parameter=options>\n\
                 {\"hourly\": true, \"n\": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n\
                 <tool_call>\n<function=now>\n</function>\n</tool_call>";
    each_cut(
        ToolCallFormat::Qwen3CoderXml,
        &weather_tools(),
        reply,
        |sent| {
            assert_eq!(sent.text, "Let me check.\n");
            let names: Vec<&str> = sent.calls.iter().map(|c| c.name.as_str()).collect();
            assert_eq!(names, ["get_weather", "now"]);
            assert_eq!(
                sent.calls[0].arguments,
                "{\"city\": \"New \\\"York\\\"\", \"days\": 3, \"units\": \"42\", \
             \"options\": {\"hourly\": true, \"n\": [1, 2]}}"
            );
            let parsed: serde_json::Value = serde_json::from_str(&sent.calls[0].arguments).unwrap();
            assert_eq!(parsed["days"], 3);
            assert_eq!(parsed["units"], "42");
            assert_eq!(sent.calls[1].arguments, "{}");
        },
    );
}

#[test]
fn qwen3_coder_typed_values_that_are_not_json_stay_strings() {
    let reply = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n\
                 <parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>";
    each_cut(
        ToolCallFormat::Qwen3CoderXml,
        &weather_tools(),
        reply,
        |sent| {
            assert_eq!(sent.text, "");
            // `extra` is not in the schema: a string.
            assert_eq!(
                sent.calls[0].arguments,
                "{\"days\": \"three\", \"extra\": \"7\"}"
            );
        },
    );
}

/// A value that holds the format's own markup (code writing XML calls):
/// only `</parameter>` followed by `<parameter=` or `</function>` ends it.
#[test]
fn qwen3_coder_markup_inside_a_value_is_value_text() {
    let code = "if x:\n    s = \"<parameter=x>\\n</function>\"\n</parameter> is not the end\n\
                <tool_call></tool_call>\n";
    let reply = format!(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n{code}\n</parameter>\n\
         </function>\n</tool_call>"
    );
    each_cut(
        ToolCallFormat::Qwen3CoderXml,
        &weather_tools(),
        &reply,
        |sent| {
            assert_eq!(sent.text, "");
            assert_eq!(sent.calls.len(), 1);
            let parsed: serde_json::Value = serde_json::from_str(&sent.calls[0].arguments).unwrap();
            assert_eq!(parsed, serde_json::json!({ "city": code }));
        },
    );
}

#[test]
fn qwen3_coder_string_values_stream_as_generated() {
    let tools = weather_tools();
    let mut f = OutputFilter::with_format(&[], &tools, ToolCallFormat::Qwen3CoderXml);
    let mut sent = Sent::default();
    sent.take(f.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"));
    assert_eq!(sent.calls.len(), 1);
    assert_eq!(sent.calls[0].arguments, "{\"city\": \"Pa");
    sent.take(f.push("ris\n</param"));
    assert_eq!(sent.calls[0].arguments, "{\"city\": \"Paris");
    sent.take(f.push("eter>\n<parameter=days>\n1"));
    assert_eq!(sent.calls[0].arguments, "{\"city\": \"Paris\", \"days\": ");
    sent.take(f.push("2\n</parameter>\n</function>"));
    assert_eq!(
        sent.calls[0].arguments,
        "{\"city\": \"Paris\", \"days\": 12}"
    );
    sent.take(f.finish());
    assert_eq!(sent.text, "");
}

#[test]
fn qwen3_coder_markup_that_is_not_a_call_is_text() {
    for reply in [
        // A function that was not offered.
        "<tool_call>\n<function=nope>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        // Not the XML format after the tag.
        "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
        // A name cut by a line break.
        "<tool_call>\n<function=now\n</function>\n</tool_call>",
        // Cut inside the function tag.
        "Hi <tool_call>\n<function=no",
        "<tool_ca",
    ] {
        each_cut(
            ToolCallFormat::Qwen3CoderXml,
            &weather_tools(),
            reply,
            |sent| {
                assert!(sent.calls.is_empty(), "{reply:?}");
                assert_eq!(sent.text, reply);
            },
        );
    }
}

#[test]
fn qwen3_coder_broken_markup_after_a_call_starts_ends_it() {
    // After the committed call, stray text where a parameter or the
    // function's end belongs closes the arguments; it and what follows
    // are text.
    let reply = "<tool_call>\n<function=get_weather>\noops</function>\n</tool_call> ok";
    each_cut(
        ToolCallFormat::Qwen3CoderXml,
        &weather_tools(),
        reply,
        |sent| {
            assert_eq!(sent.calls.len(), 1);
            assert_eq!(sent.calls[0].arguments, "{}");
            assert_eq!(sent.text, "oops</function>\n</tool_call> ok");
        },
    );
    let reply = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n\
                 <parameter=city\n</function>";
    each_cut(
        ToolCallFormat::Qwen3CoderXml,
        &weather_tools(),
        reply,
        |sent| {
            assert_eq!(sent.calls.len(), 1);
            assert_eq!(sent.calls[0].arguments, "{\"days\": 2}");
            assert_eq!(sent.text, "<parameter=city\n</function>");
        },
    );
    // Cut inside a value (max_tokens): the arguments as far as they came.
    let cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
    each_cut(
        ToolCallFormat::Qwen3CoderXml,
        &weather_tools(),
        cut,
        |sent| {
            assert_eq!(sent.calls.len(), 1);
            assert_eq!(sent.calls[0].arguments, "{\"city\": \"Par");
            assert_eq!(sent.text, "");
        },
    );
}

// --- gpt-oss harmony ----------------------------------------------------------

/// A generated token run: ordinary text, or one special token.
#[derive(Clone, Copy)]
enum Tok<'a> {
    Text(&'a str),
    Special(&'a str),
}

/// The reply `toks` through a harmony filter for `tools`: text whole, then
/// each text run cut at every character boundary, then every text run in
/// pieces of 1 to 5 characters; every outcome equals the whole one, which
/// `check` sees.
fn harmony_each_cut(
    tools: &[ToolDefinition],
    stop: &[String],
    toks: &[Tok],
    check: impl Fn(&Sent),
) {
    let feed = |cut: &dyn Fn(usize, &str) -> Vec<String>| {
        let mut f = OutputFilter::with_format(stop, tools, ToolCallFormat::Harmony);
        assert!(f.reads_special_tokens());
        let mut sent = Sent::default();
        for (i, tok) in toks.iter().enumerate() {
            match tok {
                Tok::Text(t) => {
                    for piece in cut(i, t) {
                        sent.take(f.push(&piece));
                    }
                }
                Tok::Special(s) => sent.take(f.push_special(s)),
            }
        }
        sent.take(f.finish());
        sent
    };
    let summary = |s: &Sent| {
        let calls: Vec<(String, String)> = s
            .calls
            .iter()
            .map(|c| (c.name.clone(), c.arguments.clone()))
            .collect();
        (s.text.clone(), s.reasoning.clone(), calls, s.stopped)
    };
    let whole = feed(&|_, t| vec![t.to_owned()]);
    check(&whole);
    let want = summary(&whole);
    for (at, tok) in toks.iter().enumerate() {
        let Tok::Text(text) = tok else { continue };
        for c in (1..text.len()).filter(|&c| text.is_char_boundary(c)) {
            let sent = feed(&|i, t| {
                if i == at {
                    vec![t[..c].to_owned(), t[c..].to_owned()]
                } else {
                    vec![t.to_owned()]
                }
            });
            assert_eq!(summary(&sent), want, "run {at} cut at {c}");
        }
    }
    for n in 1..=5 {
        let sent = feed(&|_, t| chunks(t, n));
        assert_eq!(summary(&sent), want, "pieces of {n}");
    }
}

#[test]
fn harmony_channels_become_reasoning_content_and_calls() {
    use Tok::{Special as S, Text as T};
    let reply = [
        S("<|channel|>"),
        T("analysis"),
        S("<|message|>"),
        T("Need the weather in Paris."),
        S("<|end|>"),
        S("<|start|>"),
        T("assistant"),
        S("<|channel|>"),
        T("commentary"),
        S("<|message|>"),
        T("Checking now."),
        S("<|end|>"),
        S("<|start|>"),
        T("assistant"),
        S("<|channel|>"),
        T("commentary to=functions.get_weather "),
        S("<|constrain|>"),
        T("json"),
        S("<|message|>"),
        T("{\"city\": \"Paris <|call|>\", \"days\": 2}"),
    ];
    harmony_each_cut(&weather_tools(), &[], &reply, |sent| {
        assert_eq!(sent.reasoning, "Need the weather in Paris.");
        assert_eq!(sent.text, "Checking now.");
        assert_eq!(sent.calls.len(), 1);
        assert_eq!(sent.calls[0].name, "get_weather");
        assert_eq!(
            sent.calls[0].arguments,
            "{\"city\": \"Paris <|call|>\", \"days\": 2}"
        );
    });
    // The recipient before the channel; an answer on the final channel.
    let reply = [
        S("<|channel|>"),
        T("analysis"),
        S("<|message|>"),
        T("Call it."),
        S("<|end|>"),
        S("<|start|>"),
        T("assistant to=functions.now"),
        S("<|channel|>"),
        T("commentary json"),
        S("<|message|>"),
        T("{}"),
        S("<|call|>"),
        S("<|start|>"),
        T("assistant"),
        S("<|channel|>"),
        T("final"),
        S("<|message|>"),
        T("It is noon."),
    ];
    harmony_each_cut(&weather_tools(), &[], &reply, |sent| {
        assert_eq!(sent.reasoning, "Call it.");
        assert_eq!(sent.text, "It is noon.");
        let calls: Vec<(&str, &str)> = sent
            .calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(calls, [("now", "{}")]);
    });
}

#[test]
fn harmony_calls_of_functions_not_offered_are_text() {
    use Tok::{Special as S, Text as T};
    let reply = [
        S("<|channel|>"),
        T("commentary to=functions.delete_all "),
        S("<|constrain|>"),
        T("json"),
        S("<|message|>"),
        T("{\"x\": 1}"),
        S("<|call|>"),
    ];
    harmony_each_cut(&weather_tools(), &[], &reply, |sent| {
        assert!(sent.calls.is_empty());
        assert_eq!(
            sent.text,
            "<|channel|>commentary to=functions.delete_all <|constrain|>json<|message|>{\"x\": 1}<|call|>"
        );
    });
}

/// The markers are special tokens: the same characters as ordinary text
/// (a model quoting them) are text, and without tools a harmony reply
/// still has its reasoning split off.
#[test]
fn harmony_marker_text_in_ordinary_tokens_is_text() {
    use Tok::{Special as S, Text as T};
    let quoted = "Write <|channel|>final<|message|>x<|return|> to answer; <|start|>assistant to=functions.now";
    let reply = [
        S("<|channel|>"),
        T("analysis"),
        S("<|message|>"),
        T("They ask about <|end|> markers."),
        S("<|end|>"),
        S("<|start|>"),
        T("assistant"),
        S("<|channel|>"),
        T("final"),
        S("<|message|>"),
        T(quoted),
        S("<|return|>"),
    ];
    for tools in [weather_tools(), Vec::new()] {
        harmony_each_cut(&tools, &[], &reply, |sent| {
            assert_eq!(sent.reasoning, "They ask about <|end|> markers.");
            assert_eq!(sent.text, quoted);
            assert!(sent.calls.is_empty());
        });
    }
    // A reply without markers (held to a grammar) is content.
    harmony_each_cut(&[], &[], &[T("{\"a\": 1}")], |sent| {
        assert_eq!(
            (sent.text.as_str(), sent.reasoning.as_str()),
            ("{\"a\": 1}", "")
        );
    });
}

#[test]
fn harmony_stop_strings_apply_to_content_only() {
    use Tok::{Special as S, Text as T};
    let reply = [
        S("<|channel|>"),
        T("analysis"),
        S("<|message|>"),
        T("END is not a stop here."),
        S("<|end|>"),
        S("<|start|>"),
        T("assistant"),
        S("<|channel|>"),
        T("final"),
        S("<|message|>"),
        T("Done. END more"),
        S("<|return|>"),
    ];
    harmony_each_cut(&[], &["END".into()], &reply, |sent| {
        assert_eq!(sent.reasoning, "END is not a stop here.");
        assert_eq!(sent.text, "Done. ");
        assert!(sent.stopped);
    });
    // Cut inside a header: the header is dropped.
    let cut = [
        S("<|channel|>"),
        T("analysis"),
        S("<|message|>"),
        T("Hm."),
        S("<|end|>"),
        S("<|start|>"),
        T("assist"),
    ];
    harmony_each_cut(&[], &[], &cut, |sent| {
        assert_eq!((sent.text.as_str(), sent.reasoning.as_str()), ("", "Hm."));
    });
}

#[test]
fn the_gpt_oss_template_picks_harmony() {
    let gpt_oss = "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}\
                   <|channel|>final<|message|>{{ content }}<|end|><tool_call>";
    assert_eq!(
        ToolCallFormat::from_template(gpt_oss),
        ToolCallFormat::Harmony
    );
}

/// A forced harmony reply: the prefix in the prompt, the generated rest
/// (special tokens apart) makes the call, named or required.
#[test]
fn forced_harmony_replies_make_the_call() {
    use Tok::{Special as S, Text as T};
    let tools = weather_tools();
    let run_forced = |prefix: &str, toks: &[Tok]| {
        let mut f = OutputFilter::forced_in(ToolCallFormat::Harmony, &[], &tools, prefix);
        let mut sent = Sent::default();
        for tok in toks {
            match tok {
                T(t) => sent.take(f.push(t)),
                S(s) => sent.take(f.push_special(s)),
            }
        }
        sent.take(f.finish());
        sent
    };
    let named = harmony::forced_call_prefix(Some("get_weather"));
    assert_eq!(
        named,
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    );
    let sent = run_forced(&named, &[T("{\"city\": "), T("\"Oslo\"}")]);
    assert_eq!(sent.text, "");
    assert_eq!(sent.calls.len(), 1);
    assert_eq!(sent.calls[0].name, "get_weather");
    assert_eq!(sent.calls[0].arguments, "{\"city\": \"Oslo\"}");
    // The call starts at the first output even when nothing was generated.
    let sent = run_forced(&named, &[]);
    assert_eq!(sent.calls.len(), 1);

    let required = harmony::forced_call_prefix(None);
    let reply = [
        T("no"),
        T("w "),
        S("<|constrain|>"),
        T("json"),
        S("<|message|>"),
        T("{}"),
    ];
    let sent = run_forced(&required, &reply);
    assert_eq!(sent.text, "");
    let calls: Vec<(&str, &str)> = sent
        .calls
        .iter()
        .map(|c| (c.name.as_str(), c.arguments.as_str()))
        .collect();
    assert_eq!(calls, [("now", "{}")]);
    // Cut inside the name: no call, no text.
    let sent = run_forced(&required, &[T("get_wea")]);
    assert_eq!((sent.text.as_str(), sent.calls.len()), ("", 0));
}

/// Gemma 4: its thought channel (`<|channel>thought` … `<channel|>`, both
/// markers special tokens the detokenizer leaves out) split off before
/// its calls (markers special tokens too) are read; a special token that
/// is neither (`<end_of_turn>`) stays out of the reply.
#[test]
fn gemma4_thought_channel_then_a_call_from_special_tokens() {
    use crate::output::tool_calls::gemma4::{GEMMA4_CALL_CLOSE, GEMMA4_CALL_OPEN, GEMMA4_QUOTE};
    let tools = [ToolDefinition {
        name: "get_weather".into(),
        description: None,
        parameters: serde_json::json!({"type": "object"}),
    }];
    let mut f = OutputFilter::with_format(&[], &tools, ToolCallFormat::Gemma4).with_reasoning(
        ReasoningSplitter::new(ReasoningMarkers::GEMMA4_CHANNEL, false),
    );
    assert!(f.reads_special_tokens());
    // (special?, text) as the engine hands them over.
    let runs = [
        (true, "<|channel>"),
        (false, "thought\nThe user wants "),
        (false, "Paris' weather, <tool_call|> is text here."),
        (true, "<channel|>"),
        (false, "Checking."),
        (true, GEMMA4_CALL_OPEN),
        (false, "call:get_weather{city:"),
        (true, GEMMA4_QUOTE),
        (false, "Paris}, {x"),
        (true, GEMMA4_QUOTE),
        (false, "}"),
        (true, GEMMA4_CALL_CLOSE),
        (true, "<end_of_turn>"),
    ];
    let mut sent = Sent::default();
    for (special, text) in runs {
        sent.take(if special {
            f.push_special(text)
        } else {
            f.push(text)
        });
    }
    sent.take(f.finish());
    assert_eq!(
        sent.reasoning,
        "The user wants Paris' weather, <tool_call|> is text here."
    );
    assert_eq!(sent.text.trim(), "Checking.");
    assert_eq!(sent.calls.len(), 1, "{sent:?}");
    assert_eq!(sent.calls[0].name, "get_weather");
    let args: serde_json::Value = serde_json::from_str(&sent.calls[0].arguments).expect("JSON");
    assert_eq!(args, serde_json::json!({"city": "Paris}, {x"}));
}

/// Gemma 4: a call written inside a thought block that never closes ends
/// the block (its markers are special tokens: they cannot be text of the
/// reasoning); a second thought block is reasoning again, and a stray
/// channel token never reaches the content.
#[test]
fn gemma4_a_call_ends_an_unclosed_thought_block() {
    use crate::output::tool_calls::gemma4::{GEMMA4_CALL_CLOSE, GEMMA4_CALL_OPEN, GEMMA4_QUOTE};
    let tools = definitions(&["f"]);
    let runs = [
        (true, "<|channel>"),
        (false, "thought\nCall f. "),
        (true, GEMMA4_CALL_OPEN),
        (false, "call:f{x:"),
        (true, GEMMA4_QUOTE),
        (false, "a"),
        (true, GEMMA4_QUOTE),
        (false, "}"),
        (true, GEMMA4_CALL_CLOSE),
        (true, "<|channel>"),
        (false, "thought Done."),
        (true, "<channel|>"),
        (false, "Bye"),
        (true, "<channel|>"),
    ];
    let mut f = OutputFilter::with_format(&[], &tools, ToolCallFormat::Gemma4).with_reasoning(
        ReasoningSplitter::new(ReasoningMarkers::GEMMA4_CHANNEL, false),
    );
    let mut sent = Sent::default();
    for (special, text) in runs {
        sent.take(if special {
            f.push_special(text)
        } else {
            f.push(text)
        });
    }
    sent.take(f.finish());
    assert_eq!(sent.reasoning, "Call f.Done.");
    assert_eq!(sent.text.trim(), "Bye");
    assert_eq!(sent.calls.len(), 1, "{sent:?}");
    assert_eq!(sent.calls[0].arguments, "{\"x\": \"a\"}");
}
