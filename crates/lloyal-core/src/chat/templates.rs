//! Built-in Jinja chat templates (Gemma, ChatML, Llama 3, Phi-3, Mistral), used when a model file
//! has none and by `format_chat_turn`.
//!
//! Written for lloyal, following each family's published turn markers. All of them:
//! - render `content` verbatim (no trimming), so the KV of a warm multi-turn chat equals a
//!   re-render of the whole conversation token for token;
//! - accept `content` as a string, `None`, or a list of `{"type": "text", "text": ...}` parts;
//! - render assistant `tool_calls` (OpenAI `{"function": {"name", "arguments"}}` or flat
//!   `{"name", "arguments"}`) and `tool` messages in the family's tool-call convention;
//! - honour `continuation` (set by `format_chat_turn`): no BOS, no system/tools preamble, so
//!   the output is exactly what follows the previous turn's end-of-turn separator.
//!
//! Whitespace: every tag trims (`{%-`/`-%}`); newlines are written as `{{ "\n" }}`.

/// Shared macros: message text and one tool call as `{"name": ..., "arguments": {...}}`.
const MACROS: &str = r#"
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable -%}{%- for part in content -%}
{%- if part is string -%}{{ part }}{%- elif part.type == "text" -%}{{ part.text }}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro call_json(tc, args_key) -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{"name": {{ f.name|tojson }}, "{{ args_key }}": {% if f.arguments is string %}{{ f.arguments }}{% elif f.arguments is defined and f.arguments is not none %}{{ f.arguments|tojson }}{% else %}{}{% endif %}}
{%- endmacro -%}
"#;

/// The start of the Gemma and Mistral bodies: after one BOS, a leading system message and
/// the tool list become `ns.prefix`, folded into the first user turn (neither has a system
/// role); `ns.start` skips the system message.
macro_rules! fold_system_and_tools {
    () => {
        r#"
{%- set ns = namespace(prefix="", start=0) -%}
{%- if not continuation -%}
{{ bos_token }}
{%- if messages and messages[0].role == "system" -%}
{%- set ns.prefix = text(messages[0].content) ~ "\n\n" -%}
{%- set ns.start = 1 -%}
{%- endif -%}
{%- if tools -%}
{%- set ns.prefix = ns.prefix ~ "You can call these tools. To call one, reply with <tool_call>{\"name\": <tool name>, \"arguments\": <arguments object>}</tool_call> and nothing else.\n<tools>\n" -%}
{%- for t in tools -%}{%- set ns.prefix = ns.prefix ~ (t|tojson) ~ "\n" -%}{%- endfor -%}
{%- set ns.prefix = ns.prefix ~ "</tools>\n\n" -%}
{%- endif -%}
{%- endif -%}
{%- for m in messages[ns.start:] -%}
"#
    };
}

/// Gemma 1-3: roles `user`/`model`; a leading system message (and the tool list) is
/// folded into the first user turn, since Gemma has no system role.
const GEMMA_BODY: &str = concat!(
    fold_system_and_tools!(),
    r#"{%- if m.role == "assistant" or m.role == "model" -%}
<start_of_turn>model{{ "\n" }}{{ text(m.content) }}
{%- for tc in m.tool_calls or [] -%}<tool_call>{{ call_json(tc, "arguments") }}</tool_call>{%- endfor -%}
<end_of_turn>{{ "\n" }}
{%- elif m.role == "user" -%}
<start_of_turn>user{{ "\n" }}{{ ns.prefix }}{{ text(m.content) }}<end_of_turn>{{ "\n" }}
{%- set ns.prefix = "" -%}
{%- elif m.role == "tool" -%}
<start_of_turn>user{{ "\n" }}{{ ns.prefix }}<tool_response>{{ "\n" }}{{ text(m.content) }}{{ "\n" }}</tool_response><end_of_turn>{{ "\n" }}
{%- set ns.prefix = "" -%}
{%- else -%}
{{ raise_exception("Gemma has no '" ~ m.role ~ "' role: use user/assistant/tool; only a leading system message is supported (it is folded into the first user turn)") }}
{%- endif -%}
{%- endfor -%}
{%- if ns.prefix -%}
<start_of_turn>user{{ "\n" }}{{ ns.prefix }}<end_of_turn>{{ "\n" }}
{%- endif -%}
{%- if add_generation_prompt -%}<start_of_turn>model{{ "\n" }}{%- endif -%}
"#
);

/// ChatML (Qwen, SmolLM...): `<|im_start|>role\n...<|im_end|>\n`; Hermes-style tools.
const CHATML_BODY: &str = r#"
{%- set ns = namespace(start=0) -%}
{%- if not continuation -%}
{%- if messages and messages[0].role == "system" -%}{%- set ns.start = 1 -%}{%- endif -%}
{%- if tools -%}
<|im_start|>system{{ "\n" }}
{%- if ns.start == 1 -%}{{ text(messages[0].content) }}{{ "\n\n" }}{%- endif -%}
# Tools{{ "\n\n" }}You may call one or more functions. Their signatures are inside <tools></tools>:{{ "\n" }}<tools>{{ "\n" }}
{%- for t in tools -%}{{ t|tojson }}{{ "\n" }}{%- endfor -%}
</tools>{{ "\n\n" }}For each call, return a JSON object with the function name and arguments inside <tool_call></tool_call> tags:{{ "\n" }}<tool_call>{{ "\n" }}{"name": <function-name>, "arguments": <args-json-object>}{{ "\n" }}</tool_call><|im_end|>{{ "\n" }}
{%- elif ns.start == 1 -%}
<|im_start|>system{{ "\n" }}{{ text(messages[0].content) }}<|im_end|>{{ "\n" }}
{%- endif -%}
{%- endif -%}
{%- for m in messages[ns.start:] -%}
{%- if m.role == "assistant" -%}
<|im_start|>assistant{{ "\n" }}{{ text(m.content) }}
{%- for tc in m.tool_calls or [] -%}{{ "\n" }}<tool_call>{{ "\n" }}{{ call_json(tc, "arguments") }}{{ "\n" }}</tool_call>{%- endfor -%}
<|im_end|>{{ "\n" }}
{%- elif m.role == "tool" -%}
<|im_start|>user{{ "\n" }}<tool_response>{{ "\n" }}{{ text(m.content) }}{{ "\n" }}</tool_response><|im_end|>{{ "\n" }}
{%- else -%}
<|im_start|>{{ m.role }}{{ "\n" }}{{ text(m.content) }}<|im_end|>{{ "\n" }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant{{ "\n" }}{%- endif -%}
"#;

/// Llama 3.x: header-delimited turns closed by `<|eot_id|>`; JSON tool calls with
/// `parameters`, tool results in the `ipython` role.
const LLAMA3_BODY: &str = r#"
{%- set ns = namespace(start=0) -%}
{%- if not continuation -%}
{{ bos_token }}
{%- if messages and messages[0].role == "system" -%}{%- set ns.start = 1 -%}{%- endif -%}
{%- if ns.start == 1 or tools -%}
<|start_header_id|>system<|end_header_id|>{{ "\n\n" }}
{%- if ns.start == 1 -%}{{ text(messages[0].content) }}{%- endif -%}
{%- if tools -%}
{%- if ns.start == 1 -%}{{ "\n\n" }}{%- endif -%}
To call a function, respond with only a JSON object {"name": function name, "parameters": object of argument names and values}. Available functions:{{ "\n\n" }}
{%- for t in tools -%}{{ t|tojson(indent=4) }}{{ "\n\n" }}{%- endfor -%}
{%- endif -%}
<|eot_id|>
{%- endif -%}
{%- endif -%}
{%- for m in messages[ns.start:] -%}
{%- if m.role == "tool" or m.role == "ipython" -%}
<|start_header_id|>ipython<|end_header_id|>{{ "\n\n" }}{%- if m.content is mapping -%}{{ m.content|tojson }}{%- else -%}{{ text(m.content) }}{%- endif -%}<|eot_id|>
{%- else -%}
<|start_header_id|>{{ m.role }}<|end_header_id|>{{ "\n\n" }}{{ text(m.content) }}
{%- for tc in m.tool_calls or [] -%}{{ call_json(tc, "parameters") }}{%- endfor -%}
<|eot_id|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>{{ "\n\n" }}{%- endif -%}
"#;

/// Phi-3/3.5: `<|role|>\n...<|end|>\n`. Phi-3 publishes no tool convention; tools are listed
/// in the system turn and calls written as `<tool_call>{json}</tool_call>` (which
/// `parse_chat_output` reads), results as a user turn in `<tool_response>`.
const PHI3_BODY: &str = r#"
{%- set ns = namespace(start=0) -%}
{%- if not continuation -%}
{%- if messages and messages[0].role == "system" -%}{%- set ns.start = 1 -%}{%- endif -%}
{%- if ns.start == 1 or tools -%}
<|system|>{{ "\n" }}
{%- if ns.start == 1 -%}{{ text(messages[0].content) }}{%- endif -%}
{%- if tools -%}
{%- if ns.start == 1 -%}{{ "\n\n" }}{%- endif -%}
You can call these tools. To call one, reply with <tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>.{{ "\n" }}<tools>{{ "\n" }}
{%- for t in tools -%}{{ t|tojson }}{{ "\n" }}{%- endfor -%}
</tools>
{%- endif -%}
<|end|>{{ "\n" }}
{%- endif -%}
{%- endif -%}
{%- for m in messages[ns.start:] -%}
{%- if m.role == "assistant" -%}
<|assistant|>{{ "\n" }}{{ text(m.content) }}
{%- for tc in m.tool_calls or [] -%}<tool_call>{{ call_json(tc, "arguments") }}</tool_call>{%- endfor -%}
<|end|>{{ "\n" }}
{%- elif m.role == "tool" -%}
<|user|>{{ "\n" }}<tool_response>{{ "\n" }}{{ text(m.content) }}{{ "\n" }}</tool_response><|end|>{{ "\n" }}
{%- else -%}
<|{{ m.role }}|>{{ "\n" }}{{ text(m.content) }}<|end|>{{ "\n" }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{{ "\n" }}{%- endif -%}
"#;

/// Mistral Instruct: `[INST] user [/INST]answer</s>` after one BOS. A leading system message
/// is folded into the first user turn (so a warm chat's earlier turns never change); tools
/// are listed there too, calls written as `<tool_call>{json}</tool_call>`, results as a user
/// turn in `<tool_response>`.
const MISTRAL_BODY: &str = concat!(
    fold_system_and_tools!(),
    r#"{%- if m.role == "assistant" -%}
{{ text(m.content) }}
{%- for tc in m.tool_calls or [] -%}<tool_call>{{ call_json(tc, "arguments") }}</tool_call>{%- endfor -%}
{{ eos_token }}
{%- elif m.role == "user" -%}
[INST] {{ ns.prefix }}{{ text(m.content) }} [/INST]
{%- set ns.prefix = "" -%}
{%- elif m.role == "tool" -%}
[INST] {{ ns.prefix }}<tool_response>{{ "\n" }}{{ text(m.content) }}{{ "\n" }}</tool_response> [/INST]
{%- set ns.prefix = "" -%}
{%- else -%}
{{ raise_exception("Mistral has no '" ~ m.role ~ "' role: use user/assistant/tool; only a leading system message is supported (it is folded into the first user turn)") }}
{%- endif -%}
{%- endfor -%}
{%- if ns.prefix -%}
[INST] {{ ns.prefix }} [/INST]
{%- endif -%}
"#
);

/// The built-in template source for `family` (macros + body).
pub fn builtin_template(family: crate::ChatFamily) -> String {
    let body = match family {
        crate::ChatFamily::Gemma => GEMMA_BODY,
        crate::ChatFamily::ChatMl => CHATML_BODY,
        crate::ChatFamily::Llama3 => LLAMA3_BODY,
        crate::ChatFamily::Phi3 => PHI3_BODY,
        crate::ChatFamily::Mistral => MISTRAL_BODY,
    };
    format!("{}{}", MACROS.trim(), body.trim())
}
