//! Mistral v11 and Gemma 4 tool calls through the output filter: as text,
//! and with their markers as special tokens.

use super::*;

/// One generated run: text, or a special token the detokenizer skipped.
#[derive(Debug, Clone, Copy)]
enum Run<'a> {
    Text(&'a str),
    Special(&'a str),
}

/// Name, arguments and text of what a choice sent (ids aside).
type Summary = (String, Vec<(String, String)>);

fn summary(sent: &Sent) -> Summary {
    let calls = sent
        .calls
        .iter()
        .map(|c| (c.name.clone(), c.arguments.clone()))
        .collect();
    (sent.text.clone(), calls)
}

/// `runs` through a filter of `format` for functions `names`: whole, each
/// text run cut at every character boundary, every text run in pieces of
/// 1 to 5 characters; every outcome equals the whole one, which is
/// returned.
fn each_cut_special(format: ToolCallFormat, names: &[&str], runs: &[Run]) -> Summary {
    let tools = definitions(names);
    let feed = |cut: &dyn Fn(usize, &str) -> Vec<String>| {
        let mut f = OutputFilter::with_format(&[], &tools, format);
        assert!(f.reads_special_tokens());
        let mut sent = Sent::default();
        for (i, run) in runs.iter().enumerate() {
            match run {
                Run::Text(t) => {
                    for piece in cut(i, t) {
                        sent.take(f.push(&piece));
                    }
                }
                Run::Special(s) => sent.take(f.push_special(s)),
            }
        }
        sent.take(f.finish());
        summary(&sent)
    };
    let whole = feed(&|_, t| vec![t.to_owned()]);
    for (at, run) in runs.iter().enumerate() {
        let Run::Text(text) = run else { continue };
        for c in (1..text.len()).filter(|&c| text.is_char_boundary(c)) {
            let sent = feed(&|i, t| match i == at {
                true => vec![t[..c].to_owned(), t[c..].to_owned()],
                false => vec![t.to_owned()],
            });
            assert_eq!(sent, whole, "run {at} cut at {c}");
        }
    }
    for n in 1..=5 {
        assert_eq!(feed(&|_, t| chunks(t, n)), whole, "pieces of {n}");
    }
    whole
}

/// `text` (markers as text) through a filter of `format`, at every split
/// ([`each_cut`]); the whole outcome.
fn each_cut_text(format: ToolCallFormat, names: &[&str], text: &str) -> Summary {
    let tools = definitions(names);
    let whole = run(&mut OutputFilter::with_format(&[], &tools, format), &[text]);
    each_cut(format, &tools, text, |_| {});
    summary(&whole)
}

/// The markers of `text` as special tokens, the rest as text runs.
fn as_runs<'a>(text: &'a str, markers: &[&str]) -> Vec<Run<'a>> {
    let mut runs = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let next = markers
            .iter()
            .filter_map(|m| rest.find(m).map(|at| (at, *m)))
            .min();
        match next {
            Some((at, marker)) => {
                if at > 0 {
                    runs.push(Run::Text(&rest[..at]));
                }
                runs.push(Run::Special(&rest[at..at + marker.len()]));
                rest = &rest[at + marker.len()..];
            }
            None => {
                runs.push(Run::Text(rest));
                rest = "";
            }
        }
    }
    runs
}

/// `text` both ways: markers as text and as special tokens; the outcomes
/// agree and are returned.
fn both_ways(format: ToolCallFormat, names: &[&str], text: &str) -> Summary {
    let as_text = each_cut_text(format, names, text);
    let runs = as_runs(text, format.special_markers());
    let as_special = each_cut_special(format, names, &runs);
    assert_eq!(as_text, as_special, "{text:?}");
    as_text
}

fn call(name: &str, arguments: &str) -> (String, String) {
    (name.to_owned(), arguments.to_owned())
}

fn json(arguments: &str) -> serde_json::Value {
    serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{arguments:?}: {e}"))
}

// --- Gemma 4 -------------------------------------------------------------------

const G: ToolCallFormat = ToolCallFormat::Gemma4;

#[test]
fn gemma4_calls_become_json() {
    let reply = "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:3,metric:true,\
                 note:null}<tool_call|>";
    let (text, calls) = both_ways(G, &["get_weather"], reply);
    assert_eq!(text, "");
    assert_eq!(
        calls,
        [call(
            "get_weather",
            "{\"city\": \"Paris\", \"days\": 3, \"metric\": true, \"note\": null}"
        )]
    );
}

#[test]
fn gemma4_nested_arguments_and_several_calls() {
    let reply = "Checking both.\n<|tool_call>call:search{q:<|\"|>rust<|\"|>,filters:{langs:\
                 [<|\"|>en<|\"|>,<|\"|>fr<|\"|>],min:-1.5e2,deep:{ok:false,xs:[]}},tags:[]}\
                 <tool_call|><|tool_call>call:now{}<tool_call|>";
    let (text, calls) = both_ways(G, &["search", "now"], reply);
    assert_eq!(text, "Checking both.\n");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].0, "search");
    assert_eq!(
        json(&calls[0].1),
        serde_json::json!({"q": "rust", "filters": {"langs": ["en", "fr"], "min": -150.0,
            "deep": {"ok": false, "xs": []}}, "tags": []})
    );
    assert_eq!(calls[1], call("now", "{}"));
}

#[test]
fn gemma4_strings_hold_the_formats_markup() {
    // Braces, colons, commas, quotes, backslashes, newlines, `call:` and
    // the call markers inside a string are text of the string.
    let inner = "a{b:c},d\"e\\f\n call:g{x:1} <|tool_call> <tool_call|> ]";
    let reply = format!("<|tool_call>call:echo{{text:<|\"|>{inner}<|\"|>,n:1}}<tool_call|>");
    let (text, calls) = both_ways(G, &["echo", "g"], &reply);
    assert_eq!(text, "");
    assert_eq!(calls.len(), 1);
    assert_eq!(
        json(&calls[0].1),
        serde_json::json!({"text": inner, "n": 1})
    );
}

#[test]
fn gemma4_streams_the_name_then_the_arguments() {
    let tools = definitions(&["echo"]);
    let mut f = OutputFilter::with_format(&[], &tools, G);
    let mut sent = Sent::default();
    sent.take(f.push_special("<|tool_call>"));
    sent.take(f.push("call:echo{text:"));
    assert_eq!(sent.calls.len(), 1, "the name is out");
    sent.take(f.push_special("<|\"|>"));
    sent.take(f.push("hello wor"));
    assert_eq!(sent.calls[0].arguments, "{\"text\": \"hello wor");
    sent.take(f.push("ld"));
    sent.take(f.push_special("<|\"|>"));
    sent.take(f.push("}"));
    sent.take(f.push_special("<tool_call|>"));
    sent.take(f.finish());
    assert_eq!(sent.calls[0].arguments, "{\"text\": \"hello world\"}");
    assert_eq!(sent.text, "");
}

#[test]
fn gemma4_blocks_that_are_not_calls_are_text() {
    for reply in [
        // A function that was not offered.
        "<|tool_call>call:other{a:1}<tool_call|>",
        // No `call:`.
        "<|tool_call>get_weather{a:1}<tool_call|>",
        // Prose around the words of a call, without the marker.
        "Use call:get_weather{city:Paris} yourself.",
        // The marker alone, and its start at the end.
        "Text <|tool_call>",
        "Text <|tool_ca",
    ] {
        let (text, calls) = both_ways(G, &["get_weather"], reply);
        assert!(calls.is_empty(), "{reply:?}");
        assert_eq!(text, reply, "{reply:?}");
    }
}

#[test]
fn gemma4_broken_arguments_are_closed_and_the_rest_is_text() {
    // `)` breaks the notation: the arguments are closed there.
    let reply = "<|tool_call>call:f{a:<|\"|>x<|\"|>)}<tool_call|> after";
    let (text, calls) = both_ways(G, &["f"], reply);
    assert_eq!(calls, [call("f", "{\"a\": \"x\"}")]);
    assert_eq!(text, ")}<tool_call|> after");
    // The call's end before its arguments closed.
    let (text, calls) = both_ways(G, &["f"], "<|tool_call>call:f{a:[1,2<tool_call|>Done.");
    assert_eq!(calls, [call("f", "{\"a\": [1, 2]}")]);
    assert_eq!(text, "Done.");
    // Bare words are strings; Python's spellings are JSON's.
    let (_, calls) = both_ways(G, &["f"], "<|tool_call>call:f{u:metric,b:True,n:None}");
    assert_eq!(
        calls,
        [call("f", "{\"u\": \"metric\", \"b\": true, \"n\": null}")]
    );
}

#[test]
fn gemma4_variants_of_the_notation() {
    // Whitespace and newlines between tokens, quoted keys (both ways), a
    // JSON string value, multibyte text, a name with a dot and a dash.
    let reply = "<|tool_call>call:fs.read-file{ path : <|\"|>/tmp/é ü 😀<|\"|> ,\n\
                 <|\"|>odd key<|\"|>:1, \"q\":\"a\\\"b\" , xs: [ 1 , 2 ] }<tool_call|>";
    let (text, calls) = both_ways(G, &["fs.read-file"], reply);
    assert_eq!(text, "");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, "fs.read-file");
    assert_eq!(
        json(&calls[0].1),
        serde_json::json!({"path": "/tmp/é ü 😀", "odd key": 1, "q": "a\"b", "xs": [1, 2]})
    );
    // Arguments as a JSON object inside the braces (the template writes
    // string arguments back that way, and models copy it).
    let doubled = "<|tool_call>call:post{{\"data\": \"x}\", \"n\": [1]}}<tool_call|>";
    let (text, calls) = both_ways(G, &["post"], doubled);
    assert_eq!(text, "");
    assert_eq!(calls, [call("post", "{\"data\": \"x}\", \"n\": [1]}")]);
}

/// A seeded run of replies made of the format's `pieces` (separated by
/// `·`), cut at random: no panic, calls are made, and a reply in which no
/// call was made comes back as its text.
fn fuzz(format: ToolCallFormat, pieces: &str) {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    let pieces: Vec<&str> = pieces.split('·').collect();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
    let tools = definitions(&["f", "g"]);
    let mut made = 0;
    for round in 0..3000 {
        let len = 1 + rng.next_u32() as usize % 12;
        let reply: String = (0..len)
            .map(|_| pieces[rng.next_u32() as usize % pieces.len()])
            .collect();
        let mut cuts: Vec<usize> = (0..3)
            .map(|_| rng.next_u32() as usize % (reply.len() + 1))
            .filter(|&c| reply.is_char_boundary(c))
            .collect();
        cuts.sort_unstable();
        let mut f = OutputFilter::with_format(&[], &tools, format);
        let mut sent = Sent::default();
        let mut from = 0;
        for cut in cuts.into_iter().chain([reply.len()]) {
            sent.take(f.push(&reply[from..cut]));
            from = cut;
        }
        sent.take(f.finish());
        if sent.calls.is_empty() {
            assert_eq!(sent.text, reply, "round {round}");
        }
        made += sent.calls.len();
    }
    assert!(made > 300, "{made} calls");
}

#[test]
fn gemma4_random_replies_never_lose_text() {
    let pieces = "<|tool_call>call:f{·a:·<|tool_call>·<tool_call|>·<|\"|>·call:·f·g·h·{·}·[·]·:·,\
                  ·a·1·true· ·\n·\"·<·|·é";
    fuzz(G, pieces);
}

#[test]
fn mistral_v11_random_replies_never_lose_text() {
    let pieces = "[TOOL_CALLS]f[ARGS]{·[TOOL_CALLS]·[ARGS]·[CALL_ID]·f·g·h·{·}·[·]·\"·:·,·a·1\
                  · ·\n·\\\\·é";
    fuzz(M, pieces);
}

#[test]
fn gemma4_cut_calls_keep_their_arguments_so_far() {
    let (text, calls) = both_ways(G, &["f"], "<|tool_call>call:f{a:<|\"|>half a str");
    assert_eq!(text, "");
    assert_eq!(calls, [call("f", "{\"a\": \"half a str")]);
}

#[test]
fn gemma4_markers_are_text_without_tools() {
    let mut f = OutputFilter::with_format(&[], &[], G);
    assert!(!f.reads_special_tokens());
    let mut sent = Sent::default();
    sent.take(f.push("a"));
    sent.take(f.push_special("<|tool_call>"));
    sent.take(f.finish());
    assert_eq!(sent.text, "a");
}

#[test]
fn the_gemma4_template_picks_its_format() {
    let gemma4 = "{%- for tool_call in message.tool_calls -%}<|tool_call>call:\
                  {{ tool_call.function.name }}{ {{- format_argument(v) -}} }<tool_call|>\
                  {%- endfor -%}{{ '<|\"|>' + value + '<|\"|>' }}";
    assert_eq!(
        ToolCallFormat::from_template(gemma4),
        ToolCallFormat::Gemma4
    );
}

// --- Mistral v11 -----------------------------------------------------------------

const M: ToolCallFormat = ToolCallFormat::MistralV11;

#[test]
fn mistral_v11_calls_stream_as_calls() {
    let reply = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"days\": [1, 2]}";
    let (text, calls) = both_ways(M, &["get_weather"], reply);
    assert_eq!(text, "");
    assert_eq!(
        calls,
        [call(
            "get_weather",
            "{\"city\": \"Paris\", \"days\": [1, 2]}"
        )]
    );
}

#[test]
fn mistral_v11_several_calls_text_before_and_call_ids() {
    let reply = "Let me check.[TOOL_CALLS]a[ARGS]{\"x\": {\"y\": [1, {}]}}\n\
                 [TOOL_CALLS]b[CALL_ID]Ab12Cd34e[ARGS] {}";
    let (text, calls) = both_ways(M, &["a", "b"], reply);
    assert_eq!(text, "Let me check.");
    assert_eq!(
        calls,
        [call("a", "{\"x\": {\"y\": [1, {}]}}"), call("b", "{}")]
    );
}

#[test]
fn mistral_v11_strings_hold_the_formats_markup() {
    // As JSON string text: markers, an escaped quote, an escaped backslash.
    let inner = "[ARGS] [TOOL_CALLS]b[ARGS]{} <|\\\"|> [CALL_ID]x } \\\\ \\\" {";
    let reply = format!("[TOOL_CALLS]echo[ARGS]{{\"text\": \"{inner}\"}}");
    let (text, calls) = both_ways(M, &["echo", "b"], &reply);
    assert_eq!(text, "");
    assert_eq!(calls, [call("echo", &format!("{{\"text\": \"{inner}\"}}"))]);
    assert!(json(&calls[0].1)["text"].is_string());
}

#[test]
fn mistral_v11_streams_the_name_then_the_arguments() {
    let tools = definitions(&["echo"]);
    let mut f = OutputFilter::with_format(&[], &tools, M);
    let mut sent = Sent::default();
    sent.take(f.push_special("[TOOL_CALLS]"));
    sent.take(f.push("echo"));
    sent.take(f.push_special("[ARGS]"));
    sent.take(f.push("{\"text\": \"hel"));
    assert_eq!(sent.calls.len(), 1);
    assert_eq!(sent.calls[0].arguments, "{\"text\": \"hel");
    sent.take(f.push("lo\"}"));
    sent.take(f.finish());
    assert_eq!(sent.calls[0].arguments, "{\"text\": \"hello\"}");
}

#[test]
fn mistral_v11_replies_that_are_not_calls_are_text() {
    for reply in [
        // A function that was not offered.
        "[TOOL_CALLS]other[ARGS]{\"a\": 1}",
        // Arguments that are not an object.
        "[TOOL_CALLS]f[ARGS][1]",
        // A name with a space; no `[ARGS]`.
        "[TOOL_CALLS]f g[ARGS]{}",
        "See [TOOL_CALLS]f and more",
        // The marker and a name cut at the end.
        "[TOOL_CALLS]f",
        "Text [TOOL_CA",
    ] {
        let (text, calls) = both_ways(M, &["f"], reply);
        assert!(calls.is_empty(), "{reply:?}");
        assert_eq!(text, reply, "{reply:?}");
    }
    // After a call, text is text.
    let (text, calls) = both_ways(M, &["f"], "[TOOL_CALLS]f[ARGS]{} Done.");
    assert_eq!(calls, [call("f", "{}")]);
    assert_eq!(text, " Done.");
}

#[test]
fn mistral_v11_cut_calls_keep_their_arguments_so_far() {
    let (text, calls) = both_ways(M, &["f"], "[TOOL_CALLS]f[ARGS]{\"a\": \"hal");
    assert_eq!(text, "");
    assert_eq!(calls, [call("f", "{\"a\": \"hal")]);
}

/// A forced Gemma 4 reply, its markers fed as special tokens (as the
/// engine feeds them) or as text: the summary of the whole, checked equal
/// to the one of every text run fed one character at a time.
fn forced_gemma4(prefix: &str, names: &[&str], generated: &str, special: bool) -> Summary {
    let tools = definitions(names);
    let runs = match special {
        true => as_runs(generated, G.special_markers()),
        false => vec![Run::Text(generated)],
    };
    let feed = |n: Option<usize>| {
        let mut f = OutputFilter::forced_in(G, &[], &tools, prefix);
        let mut sent = Sent::default();
        for run in &runs {
            match (run, n) {
                (Run::Text(t), Some(n)) => chunks(t, n)
                    .iter()
                    .for_each(|piece| sent.take(f.push(piece))),
                (Run::Text(t), None) => sent.take(f.push(t)),
                (Run::Special(s), _) => sent.take(f.push_special(s)),
            }
        }
        sent.take(f.finish());
        summary(&sent)
    };
    let whole = feed(None);
    assert_eq!(feed(Some(1)), whole, "one character at a time");
    whole
}

#[test]
fn forced_gemma4_replies_continue_their_prefix() {
    use crate::output::tool_calls::gemma4::gemma4_forced_call_prefix;
    // A named function: the prefix holds the name and `{`, the model the
    // members, `}` and the closing marker. The string holds the notation's
    // own markup.
    let named = gemma4_forced_call_prefix(Some("f"));
    assert_eq!(named, "<|tool_call>call:f{");
    let generated = "a:<|\"|>x}, b:1, call:g{\"q\"<|\"|>,n:[1.5,{k:null}],ok:false}<tool_call|>";
    let expected = call(
        "f",
        "{\"a\": \"x}, b:1, call:g{\\\"q\\\"\", \"n\": [1.5, {\"k\": null}], \"ok\": false}",
    );
    assert_eq!(
        json(&expected.1),
        serde_json::json!({"a": "x}, b:1, call:g{\"q\"", "n": [1.5, {"k": null}], "ok": false})
    );
    for special in [false, true] {
        assert_eq!(
            forced_gemma4(&named, &["f", "g"], generated, special),
            (String::new(), vec![expected.clone()]),
            "special: {special}"
        );
    }
    // Required: the model writes the name, and calls again.
    let required = gemma4_forced_call_prefix(None);
    assert_eq!(required, "<|tool_call>call:");
    let generated = "g{x:[<|\"|>a,b<|\"|>]}<tool_call|><|tool_call>call:f{}<tool_call|>";
    for special in [false, true] {
        assert_eq!(
            forced_gemma4(&required, &["f", "g"], generated, special),
            (
                String::new(),
                vec![call("g", "{\"x\": [\"a,b\"]}"), call("f", "{}")]
            ),
            "special: {special}"
        );
    }
    // Cut inside a string: the arguments as far as they came (as an
    // unforced reply's), no wrapper text.
    assert_eq!(
        forced_gemma4(&named, &["f"], "a:<|\"|>hal", true),
        (String::new(), vec![call("f", "{\"a\": \"hal")])
    );
    // Cut before the name was complete: nothing, no wrapper text.
    assert_eq!(
        forced_gemma4(&required, &["f", "g"], "f", false),
        (String::new(), vec![])
    );
}

#[test]
fn forced_mistral_v11_replies_continue_their_prefix() {
    use crate::output::tool_calls::mistral::mistral_forced_call_prefix;
    let tools = definitions(&["f", "g"]);
    // A named function: the prefix holds the name, the model the arguments.
    let named = mistral_forced_call_prefix(Some("f"));
    assert_eq!(named, "[TOOL_CALLS]f[ARGS]");
    let mut f = OutputFilter::forced_in(M, &[], &tools, &named);
    let sent = run(&mut f, &["{\"a\":", " 1}"]);
    assert_eq!(
        summary(&sent),
        (String::new(), vec![call("f", "{\"a\": 1}")])
    );
    // Required: the model writes names, markers as special tokens, and
    // calls again.
    let required = mistral_forced_call_prefix(None);
    let mut f = OutputFilter::forced_in(M, &[], &tools, &required);
    assert!(f.reads_special_tokens());
    let mut sent = Sent::default();
    sent.take(f.push("f"));
    sent.take(f.push_special("[ARGS]"));
    sent.take(f.push("{}"));
    sent.take(f.push_special("[TOOL_CALLS]"));
    sent.take(f.push("g"));
    sent.take(f.push_special("[ARGS]"));
    sent.take(f.push("{\"x\": [2]}"));
    sent.take(f.finish());
    assert_eq!(
        summary(&sent),
        (
            String::new(),
            vec![call("f", "{}"), call("g", "{\"x\": [2]}")]
        )
    );
    // Cut before the name was complete: nothing, no wrapper text.
    let mut f = OutputFilter::forced_in(M, &[], &tools, &required);
    let sent = run(&mut f, &["f"]);
    assert_eq!(summary(&sent), (String::new(), vec![]));
}
