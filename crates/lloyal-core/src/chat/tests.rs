//! Unit tests of `chat`: template choice, built-in rendering, errors, output parsing.

use serde_json::json;

use serde_json::Value as Json;

use super::parse::*;
use super::render::*;
use super::templates::builtin_template;
use super::ChatFamily;
use crate::error::LloyalError;

fn vars(add_generation_prompt: bool) -> RenderVars<'static> {
    RenderVars { add_generation_prompt, bos_token: "<bos>", eos_token: "<eos>", ..Default::default() }
}

fn builtin(f: ChatFamily, messages: Json, add_gen: bool) -> String {
    let Json::Array(m) = messages else { panic!("not a list") };
    render(&builtin_template(f), &m, &vars(add_gen)).unwrap()
}

#[test]
fn gemma_folds_system_and_uses_model_role() {
    let out = builtin(
        ChatFamily::Gemma,
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]),
        true,
    );
    assert_eq!(
        out,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    let no_gen = builtin(ChatFamily::Gemma, json!([{"role": "user", "content": "Hi"}]), false);
    assert_eq!(no_gen, "<bos><start_of_turn>user\nHi<end_of_turn>\n");
}

#[test]
fn gemma_rejects_mid_conversation_system() {
    let m = vec![json!({"role": "user", "content": "a"}), json!({"role": "system", "content": "b"})];
    let err = render(&builtin_template(ChatFamily::Gemma), &m, &vars(true)).unwrap_err();
    assert!(matches!(&err, LloyalError::ChatTemplate(s) if s.contains("no 'system' role")), "{err}");
}

#[test]
fn chatml_and_llama3_turns() {
    let m = json!([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]);
    assert_eq!(
        builtin(ChatFamily::ChatMl, m.clone(), true),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        builtin(ChatFamily::Llama3, m, true),
        "<bos><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\
         \n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn phi3_and_mistral_turns() {
    let m = json!([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                   {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]);
    assert_eq!(
        builtin(ChatFamily::Phi3, m.clone(), true),
        "<|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\nA<|end|>\n<|user|>\nV<|end|>\n<|assistant|>\n"
    );
    // Mistral: the system message joins the first user turn; the answer ends with EOS.
    assert_eq!(builtin(ChatFamily::Mistral, m, true), "<bos>[INST] S\n\nU [/INST]A<eos>[INST] V [/INST]");
    let err = render(
        &builtin_template(ChatFamily::Mistral),
        &[json!({"role": "user", "content": "a"}), json!({"role": "system", "content": "b"})],
        &vars(true),
    )
    .unwrap_err();
    assert!(matches!(&err, LloyalError::ChatTemplate(s) if s.contains("no 'system' role")), "{err}");
}

#[test]
fn warm_turn_is_the_suffix_of_a_full_render() {
    for f in
        [ChatFamily::Gemma, ChatFamily::ChatMl, ChatFamily::Llama3, ChatFamily::Phi3, ChatFamily::Mistral]
    {
        let first =
            builtin(f, json!([{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]), true);
        let full = builtin(
            f,
            json!([{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                   {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]),
            true,
        );
        let turn_vars = RenderVars { continuation: true, ..vars(true) };
        let delta =
            render(&builtin_template(f), &[json!({"role": "user", "content": "U2"})], &turn_vars).unwrap();
        // Mistral's separator is the EOS token ("</s>" in its vocabulary, "<eos>" here).
        let sep = if f == ChatFamily::Mistral { "<eos>" } else { f.turn_separator() };
        assert_eq!(full, format!("{first}A1{sep}{delta}"), "{f:?}");
    }
}

#[test]
fn tool_calls_and_tools_render() {
    let tools =
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let m = json!([{"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                   {"role": "tool", "content": "sunny"}]);
    let Json::Array(m) = m else { unreachable!() };
    let v = RenderVars { tools: Some(&tools), ..vars(true) };
    let out = render(&builtin_template(ChatFamily::ChatMl), &m, &v).unwrap();
    assert!(
        out.contains(
            r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}"#
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        ),
        "{out}"
    );
    assert!(out.contains("<tool_response>\nsunny\n</tool_response>"), "{out}");
    let gemma = render(&builtin_template(ChatFamily::Gemma), &m, &v).unwrap();
    assert!(gemma.starts_with("<bos><start_of_turn>user\nYou can call these tools."), "{gemma}");
    let llama = render(&builtin_template(ChatFamily::Llama3), &m, &v).unwrap();
    assert!(
        llama.contains(r#"{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>"#),
        "{llama}"
    );
    assert!(llama.contains("<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>"), "{llama}");
}

#[test]
fn hf_style_templates_work() {
    let t = "{{ bos_token }}{% for m in messages %}{{ m['role'].upper() }}:{{ m.content.strip() }}|\
             {% if m.get('x', 'd') == 'd' %}ok{% endif %}{% endfor %}{{ tools|tojson }}\
             {% if add_generation_prompt %}>{% endif %}";
    let m = [json!({"role": "user", "content": "  hé <b>  "})];
    let tools = json!([{"name": "f", "d": [1, 2]}]);
    let out = render(t, &m, &RenderVars { tools: Some(&tools), ..vars(true) }).unwrap();
    assert_eq!(out, r#"<bos>USER:hé <b>|ok[{"name": "f", "d": [1, 2]}]>"#);
    let pretty = render("{{ {'a': [1]}|tojson(indent=2) }}", &[], &vars(false)).unwrap();
    assert_eq!(pretty, "{\n  \"a\": [\n    1\n  ]\n}");
    let date = render("{{ strftime_now('%Y') }}", &[], &vars(false)).unwrap();
    assert_eq!(date.len(), 4);
}

#[test]
fn raise_exception_and_syntax_errors_are_chat_template_errors() {
    let err = render("{{ raise_exception('roles must alternate') }}", &[], &vars(true)).unwrap_err();
    assert!(matches!(&err, LloyalError::ChatTemplate(s) if s.contains("roles must alternate")), "{err}");
    let err = render("{% for %}", &[], &vars(true)).unwrap_err();
    assert!(matches!(err, LloyalError::ChatTemplate(_)));
}

#[test]
fn template_choice_order() {
    let g = Some(ChatFamily::Gemma);
    assert_eq!(choose_template(Some("o"), Some("m"), g).unwrap().0, "override");
    assert_eq!(choose_template(None, Some("m"), g).unwrap().0, "model");
    assert_eq!(choose_template(None, Some("  "), g).unwrap().0, "builtin:gemma");
    assert_eq!(choose_template(None, None, Some(ChatFamily::ChatMl)).unwrap().0, "builtin:chatml");
    let err = choose_template(None, None, None).unwrap_err();
    assert!(matches!(&err, LloyalError::ChatTemplate(s) if s.contains("template=")));
}

#[test]
fn message_shapes_are_checked() {
    assert!(parse_messages(r#"[{"role": "user", "content": "x"}, {"role": "assistant", "content": null}]"#)
        .is_ok());
    for (bad, needle) in [
        (r#"{"role": "user"}"#, "list of dicts"),
        (r#"["hi"]"#, "messages[0]: must be a dict"),
        (r#"[{"content": "x"}]"#, "missing 'role'"),
        (r#"[{"role": "user", "content": 3}]"#, "'content' must be"),
        (r#"[{"role": 1, "content": "x"}]"#, "'role' must be"),
    ] {
        let err = parse_messages(bad).unwrap_err();
        assert!(matches!(&err, LloyalError::InvalidArgument(s) if s.contains(needle)), "{bad}: {err}");
    }
}

#[test]
fn parses_think_and_end_markers() {
    let out = parse_chat_output("<think>\n2+2 is 4\n</think>\n\nThe answer is 4.<end_of_turn>");
    assert_eq!(out.reasoning_content.as_deref(), Some("2+2 is 4"));
    assert_eq!(out.content, "The answer is 4.");
    assert!(out.tool_calls.is_empty());
    let open_in_prompt = parse_chat_output("hmm</think>ok<|im_end|>");
    assert_eq!(
        (open_in_prompt.reasoning_content.as_deref(), open_in_prompt.content.as_str()),
        (Some("hmm"), "ok")
    );
    let plain = parse_chat_output("Paris.<|eot_id|>");
    assert_eq!((plain.reasoning_content, plain.content.as_str()), (None, "Paris."));
}

#[test]
fn parses_hermes_tool_calls() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                <tool_call>{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}</tool_call><|im_end|>";
    let out = parse_chat_output(text);
    assert_eq!(out.content, "Let me check.");
    assert_eq!(
        out.tool_calls,
        vec![
            ToolCall { name: "get_weather".into(), arguments: json!({"city": "Paris"}) },
            ToolCall { name: "get_time".into(), arguments: json!({"tz": "CET"}) },
        ]
    );
}

#[test]
fn invalid_tool_call_json_stays_content() {
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": {oops}</tool_call>";
    let out = parse_chat_output(text);
    assert!(out.tool_calls.is_empty());
    assert_eq!(out.content, text);
    let mixed = parse_chat_output("<tool_call>nope</tool_call> <tool_call>{\"name\": \"g\"}</tool_call>");
    assert_eq!(mixed.content, "<tool_call>nope</tool_call>");
    assert_eq!(mixed.tool_calls, vec![ToolCall { name: "g".into(), arguments: json!({}) }]);
}

#[test]
fn parses_llama3_json_tool_calls() {
    let out = parse_chat_output(
        "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"q\": \"rust\"}}<|eom_id|>",
    );
    assert_eq!(out.content, "");
    assert_eq!(out.tool_calls, vec![ToolCall { name: "search".into(), arguments: json!({"q": "rust"}) }]);
    let bare = parse_chat_output(
        " {\"name\": \"a\", \"parameters\": {}} {\"name\": \"b\", \"parameters\": {\"x\": 1}}",
    );
    assert_eq!(bare.tool_calls.len(), 2);
    // JSON that is not a call (no parameters) is an answer, not a tool call.
    let answer = parse_chat_output("{\"name\": \"Bob\"}");
    assert_eq!((answer.content.as_str(), answer.tool_calls.len()), ("{\"name\": \"Bob\"}", 0));
    let broken = parse_chat_output("{\"name\": \"a\", \"parameters\": {");
    assert!(broken.tool_calls.is_empty() && broken.content.starts_with('{'));
}

/// As vLLM's parsers read them: a Hermes call left open at the end, Llama 3 calls apart by
/// `; `, and Mistral's list of calls (its `[TOOL_CALLS]` marker renders as no text).
#[test]
fn open_calls_semicolons_and_call_lists_parse() {
    let open = parse_chat_output(
        "Sure. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n",
    );
    assert_eq!((open.content.as_str(), open.tool_calls.len()), ("Sure.", 1));
    assert_eq!(open.tool_calls[0].name, "get_weather");
    let cut = parse_chat_output("<tool_call>{\"name\": \"a\", \"argu");
    assert!(cut.tool_calls.is_empty() && cut.content.starts_with("<tool_call>"));
    let two = parse_chat_output(
        "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}",
    );
    let names: Vec<&str> = two.tool_calls.iter().map(|c| c.name.as_str()).collect();
    assert_eq!((names, two.content.as_str()), (vec!["a", "b"], ""));
    let mistral = parse_chat_output(" [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"t\", \"arguments\": {}}]");
    assert_eq!(mistral.tool_calls.len(), 2);
    assert_eq!(mistral.tool_calls[0].arguments, json!({"city": "Paris"}));
    let plain_list = parse_chat_output("[1, 2, 3]");
    assert!(plain_list.tool_calls.is_empty() && plain_list.content == "[1, 2, 3]");
}

#[test]
fn python_json_matches_json_dumps() {
    let v = json!({"b": 1, "a": [true, null, "é\"x"], "e": {}, "f": []});
    assert_eq!(python_json(&v, None), r#"{"b": 1, "a": [true, null, "é\"x"], "e": {}, "f": []}"#);
}

/// What transformers' templates use beyond plain Jinja: loop controls (`jinja2.ext.loopcontrols`)
/// and `tojson`'s `json.dumps` options, as jinja2 renders them.
#[test]
fn loop_controls_and_tojson_options_render_as_transformers_does() {
    let m = vec![json!({"role": "user", "content": "x"})];
    let t = "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}\
             {% endif %}{{ i }}{% endfor %}";
    assert_eq!(render(t, &m, &vars(false)).unwrap(), "02");
    let t = "{{ {'b': 1, 'a': {'d': 'é', 'c': [1, 2]}} | tojson(sort_keys=true) }}|\
             {{ 'é😀' | tojson(ensure_ascii=true) }}|{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}|\
             {{ {'a': 1} | tojson(indent=2, sort_keys=true) }}";
    assert_eq!(
        render(t, &m, &vars(false)).unwrap(),
        "{\"a\": {\"c\": [1, 2], \"d\": \"é\"}, \"b\": 1}|\"\\u00e9\\ud83d\\ude00\"|{\"a\":[1,2]}|{\n  \"a\": 1\n}"
    );
    let err = render("{{ 1 | tojson(nope=1) }}", &m, &vars(false)).unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");
}

/// A template is input: one whose loops would run for minutes stops with a ChatTemplateError.
#[test]
fn a_template_runs_on_a_bounded_amount_of_work() {
    let m = vec![json!({"role": "user", "content": "x"})];
    let t = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
    let started = std::time::Instant::now();
    let err = render(t, &m, &vars(false)).unwrap_err();
    assert!(matches!(err, LloyalError::ChatTemplate(_)) && err.to_string().contains("fuel"), "{err}");
    assert!(started.elapsed().as_secs() < 60);
}

#[test]
fn generation_blocks_render_as_plain_blocks() {
    let t = "{% for m in messages %}{% if m.role == 'assistant' %}{%- generation -%} [{{ m.content }}] \
             {%- endgeneration %}{% else %}<{{ m.content }}>{% endif %}{% endfor %}";
    assert_eq!(
        plain_generation_blocks(t),
        "{% for m in messages %}{% if m.role == 'assistant' %}{%- if true -%} [{{ m.content }}] \
         {%- endif %}{% else %}<{{ m.content }}>{% endif %}{% endfor %}"
    );
    let m = json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]);
    let Json::Array(m) = m else { panic!("not a list") };
    assert_eq!(render(t, &m, &vars(false)).unwrap(), "<a>[b]");
    // A variable or string merely named "generation" is left alone.
    let plain = "{% set generation = 1 %}{{ generation }}{{ 'endgeneration' }}";
    assert_eq!(plain_generation_blocks(plain), plain);
}

#[test]
fn extra_template_variables_are_visible_and_reserved_names_refused() {
    let t = "{{ date_string }}|{{ enable_thinking }}|{{ documents[0].title }}|{{ bos_token }}";
    let extra =
        json!({"date_string": "26 Jul 2024", "enable_thinking": false, "documents": [{"title": "T"}]});
    let Json::Object(extra) = extra else { panic!("not an object") };
    let v = RenderVars { extra: Some(&extra), ..vars(true) };
    assert_eq!(render(t, &[], &v).unwrap(), "26 Jul 2024|False|T|<bos>");
    assert!(parse_extra_vars(Some(r#"{"x": 1}"#)).unwrap().is_some());
    let err = parse_extra_vars(Some(r#"{"bos_token": "<s>"}"#)).unwrap_err().to_string();
    assert!(err.contains("'bos_token' is set by format_chat itself"), "{err}");
}

#[test]
fn turn_delta_is_the_new_turn_of_a_jinja_template() {
    // Gemma's own GGUF template trims content (the built-in one does not).
    let gemma =
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m.role == 'assistant' else m.role %}\
                 <start_of_turn>{{ role }}\n{{ m.content | trim }}<end_of_turn>\n{% endfor %}\
                 {% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";
    let msg = json!({"role": "user", "content": "  And of Italy? "});
    let delta = turn_delta(gemma, &msg, &vars(true), "<end_of_turn>\n").unwrap();
    assert_eq!(delta, "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n");
    // A template that rewrites earlier turns when a new one comes has no clean delta.
    let rewrites =
        "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}<end_of_turn>\n{% endfor %}";
    assert_eq!(turn_delta(rewrites, &msg, &vars(true), "<end_of_turn>\n"), None);
    // Nor does one that closes turns with another separator, or refuses the message.
    assert_eq!(turn_delta(gemma, &msg, &vars(true), "<|im_end|>\n"), None);
    let strict =
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\
                  {{ m.content }}<end_of_turn>\n{% endfor %}";
    assert_eq!(
        turn_delta(strict, &json!({"role": "tool", "content": "x"}), &vars(true), "<end_of_turn>\n"),
        None
    );
}
