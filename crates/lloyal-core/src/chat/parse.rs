//! Parse generated text into visible content, `<think>` reasoning and tool calls.

use serde_json::Value as Json;

/// One tool call parsed from model output.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// Function name.
    pub name: String,
    /// Arguments (a JSON object).
    pub arguments: Json,
}

/// Model output split into visible content, reasoning and tool calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatOutput {
    /// The answer text, with reasoning, valid tool calls and end-of-turn markers removed.
    pub content: String,
    /// The text inside `<think>...</think>`, if any.
    pub reasoning_content: Option<String>,
    /// Tool calls in the order they appear.
    pub tool_calls: Vec<ToolCall>,
}

/// End-of-turn markers [`parse_chat_output`] removes wherever they are in the text.
pub const END_MARKERS: &[&str] = &[
    "<end_of_turn>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<eos>",
    "</s>",
];

/// Markers from which [`parse_chat_output`] may read the text as something other than content:
/// reasoning (`<think>`, `</think>`) or a tool call (`<tool_call>`, `<|python_tag|>`; a Llama 3
/// call may also be a bare `{` at the start). A streaming server holds text from the first one on.
pub const STRUCTURE_MARKERS: &[&str] = &[CALL_OPEN, THINK_OPEN, THINK_CLOSE, PYTHON_TAG];

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// Split generated text into content, `<think>` reasoning and tool calls (Hermes/Qwen
/// `<tool_call>{...}</tool_call>` blocks, the last one possibly left open; Llama 3 JSON calls
/// with optional `<|python_tag|>`, several apart by `;`; Mistral's JSON list of calls).
/// Malformed tool calls stay in `content`; this never fails.
pub fn parse_chat_output(text: &str) -> ChatOutput {
    let mut text = text.to_string();
    for m in END_MARKERS {
        text = text.replace(m, "");
    }
    let (reasoning, rest) = split_reasoning(&text);
    let (mut content, mut tool_calls) = extract_hermes(&rest);
    if tool_calls.is_empty() {
        if let Some(calls) = llama3_calls(&content) {
            tool_calls = calls;
            content.clear();
        }
    }
    ChatOutput { content: content.trim().to_string(), reasoning_content: reasoning, tool_calls }
}

fn split_reasoning(text: &str) -> (Option<String>, String) {
    match (text.find(THINK_OPEN), text.find(THINK_CLOSE)) {
        (Some(o), Some(c)) if o < c => {
            let reasoning = text[o + THINK_OPEN.len()..c].trim().to_string();
            (Some(reasoning), format!("{}{}", &text[..o], &text[c + THINK_CLOSE.len()..]))
        }
        // The template opened <think> in the prompt: everything before </think> is reasoning.
        (None, Some(c)) => (Some(text[..c].trim().to_string()), text[c + THINK_CLOSE.len()..].to_string()),
        // Unfinished reasoning (generation stopped inside it).
        (Some(o), None) => (Some(text[o + THINK_OPEN.len()..].trim().to_string()), text[..o].to_string()),
        _ => (None, text.to_string()),
    }
}

fn extract_hermes(text: &str) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(o) = rest.find(CALL_OPEN) {
        let after = &rest[o + CALL_OPEN.len()..];
        let Some(c) = after.find(CALL_CLOSE) else {
            // the last call left open (the end of generation, or a stop at `</tool_call>`), as
            // vLLM's Hermes parser reads it: a call when what follows is one
            if let Some(call) = tool_call_from_json(after.trim(), "arguments") {
                content.push_str(&rest[..o]);
                calls.push(call);
                rest = "";
            }
            break;
        };
        match tool_call_from_json(after[..c].trim(), "arguments") {
            Some(call) => {
                content.push_str(&rest[..o]);
                calls.push(call);
            }
            None => content.push_str(&rest[..o + CALL_OPEN.len() + c + CALL_CLOSE.len()]),
        }
        rest = &after[c + CALL_CLOSE.len()..];
    }
    content.push_str(rest);
    (content, calls)
}

fn llama3_calls(content: &str) -> Option<Vec<ToolCall>> {
    let t = content.trim();
    let t = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim();
    if t.starts_with('[') {
        // Mistral's `[TOOL_CALLS] [{...}, ...]` (the marker is a control token, no text)
        let Json::Array(items) = serde_json::from_str::<Json>(t).ok()? else { return None };
        let calls: Option<Vec<ToolCall>> =
            items.into_iter().map(|v| call_from_value(v, "arguments", true)).collect();
        return calls.filter(|c| !c.is_empty());
    }
    if !t.starts_with('{') {
        return None;
    }
    // one call, or several apart by whitespace or `;` (as vLLM's llama3_json parser splits them)
    let mut calls = Vec::new();
    let mut rest = t;
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Json>();
        let value = stream.next()?.ok()?;
        calls.push(call_from_value(value, "parameters", true)?);
        let after = rest[stream.byte_offset()..].trim_start();
        rest = after.strip_prefix(';').unwrap_or(after).trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

fn tool_call_from_json(text: &str, args_key: &str) -> Option<ToolCall> {
    call_from_value(serde_json::from_str(text).ok()?, args_key, false)
}

/// `{"name": str, args_key|"arguments"|"parameters": object or JSON-object string}`;
/// without `require_args` a missing argument object means `{}`.
fn call_from_value(value: Json, args_key: &str, require_args: bool) -> Option<ToolCall> {
    let Json::Object(mut map) = value else { return None };
    let Some(Json::String(name)) = map.remove("name") else { return None };
    let args = map.remove(args_key).or_else(|| map.remove("arguments")).or_else(|| map.remove("parameters"));
    let args = match args {
        Some(a) => a,
        None if require_args => return None,
        None => Json::Object(Default::default()),
    };
    let arguments = match args {
        Json::String(s) => serde_json::from_str::<Json>(&s).ok()?,
        other => other,
    };
    arguments.is_object().then_some(ToolCall { name, arguments })
}
