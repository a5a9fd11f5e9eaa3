use super::*;

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::text(role, content)
}

fn render_src(src: &str, messages: &[ChatMessage]) -> Result<String, TextError> {
    ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into()))?.render(messages, true)
}

#[test]
fn kwargs_are_template_variables_below_the_renderers_own() {
    let src = "{% if enable_thinking is false %}no-think {% endif %}{{ messages | length }} {{ add_generation_prompt }}";
    let t = ChatTemplate::new(src, None, None).unwrap();
    let kwargs = |v: serde_json::Value| v.as_object().unwrap().clone();
    let msgs = [msg("user", "hi")];
    assert_eq!(
        t.render_with_kwargs(
            &msgs,
            &[],
            true,
            &kwargs(serde_json::json!({"enable_thinking": false}))
        )
        .unwrap(),
        "no-think 1 True"
    );
    assert_eq!(t.render(&msgs, true).unwrap(), "1 True");
    // The renderer's variables win.
    let forged = kwargs(serde_json::json!({"messages": [1, 2, 3], "add_generation_prompt": false}));
    assert_eq!(
        t.render_with_kwargs(&msgs, &[], true, &forged).unwrap(),
        "1 True"
    );
}

#[test]
fn is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTemplate>();
}

#[test]
fn python_string_methods_work() {
    let src = "{{ messages[0].content.strip() }}|{{ messages[0].content.startswith(' a') }}|\
               {{ messages[0].content.split(',') | length }}";
    assert_eq!(
        render_src(src, &[msg("user", " a,b,c ")]).unwrap(),
        "a,b,c|True|3"
    );
}

#[test]
fn loop_controls_work() {
    let src = "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}\
               {{ m.content }}{% if loop.index0 == 2 %}{% break %}{% endif %}{% endfor %}";
    let msgs = [
        msg("user", "a"),
        msg("user", "b"),
        msg("user", "c"),
        msg("user", "d"),
    ];
    assert_eq!(render_src(src, &msgs).unwrap(), "ac");
}

#[test]
fn raise_exception_keeps_the_templates_message() {
    let src = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok";
    let err = render_src(src, &[msg("system", "x")]).unwrap_err();
    match err {
        TextError::TemplateException(m) => assert_eq!(m, "System role not supported"),
        other => panic!("wrong error: {other:?}"),
    }
    assert_eq!(render_src(src, &[msg("user", "x")]).unwrap(), "ok");
}

#[test]
fn other_render_failures_are_render_errors() {
    let err = render_src(
        "{{ messages[0].content.nosuchmethod() }}",
        &[msg("user", "x")],
    )
    .unwrap_err();
    assert!(matches!(err, TextError::TemplateRender(_)), "{err:?}");
    let err = ChatTemplate::new("{% if %}", None, None).unwrap_err();
    assert!(matches!(err, TextError::TemplateSyntax(_)), "{err:?}");
}

#[test]
fn tojson_is_pythons_json_dumps() {
    // json.dumps({"a": [1, "é<>"], "b": None}) and with indent=2.
    let src = "{{ {'a': [1, 'é<>'], 'b': none} | tojson }}";
    assert_eq!(
        render_src(src, &[]).unwrap(),
        r#"{"a": [1, "é<>"], "b": null}"#
    );
    let src = "{{ {'a': [1, 'é<>'], 'b': none} | tojson(indent=2) }}";
    assert_eq!(
        render_src(src, &[]).unwrap(),
        "{\n  \"a\": [\n    1,\n    \"é<>\"\n  ],\n  \"b\": null\n}"
    );
    let src = "{{ 'é😀' | tojson(ensure_ascii=true) }}";
    assert_eq!(render_src(src, &[]).unwrap(), r#""\u00e9\ud83d\ude00""#);
}

#[test]
fn strftime_now_formats_the_local_date() {
    let want = chrono::Local::now().format("%Y-%m-%d").to_string();
    let got = render_src("{{ strftime_now('%Y-%m-%d') }}", &[]).unwrap();
    assert_eq!(got, want);
    assert!(render_src("{{ strftime_now('%Q%') }}", &[]).is_err());
}

#[test]
fn missing_special_tokens_are_undefined() {
    let t = ChatTemplate::new("[{{ bos_token }}]{{ bos_token is defined }}", None, None).unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "[]False");
}

#[test]
fn trailing_newline_and_block_whitespace_follow_transformers() {
    let src =
        "{% for m in messages %}\n  {% if true %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}\n";
    let msgs = [msg("user", "a"), msg("user", "b")];
    // jinja2 with trim_blocks + lstrip_blocks renders "a\nb\n".
    assert_eq!(render_src(src, &msgs).unwrap(), "a\nb\n");
}
