//! Render chat messages with a Jinja chat template (minijinja): template choice, message
//! checks, HF-compatible environment (`tojson`, Python string methods), `Model::format_chat`.
//!
//! Tokenizing a rendered prompt: the prompt already contains the BOS text when the template
//! writes `{{ bos_token }}` (the model's own templates and the Gemma/Llama 3 built-ins do), and
//! it contains turn markers as text. Tokenize it with `add_special=false, parse_special=true`.

use std::borrow::Cow;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, Value};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::Value as Json;

use super::templates::builtin_template;
use crate::error::{LloyalError, Result};
use crate::{ChatFamily, Model};

/// A rendered chat prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormattedChat {
    /// The prompt text (tokenize with `add_special=false, parse_special=true`).
    pub prompt: String,
    /// Tokens that end the assistant's turn: the family's end-of-turn token(s) and EOG/EOS.
    pub stop_tokens: Vec<i32>,
    /// Where the template came from: `override`, `model` or `builtin:<family>`.
    pub template_source: String,
}

/// Options of [`Model::format_chat`].
#[derive(Debug, Clone, Default)]
pub struct ChatOptions {
    /// Append the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// A Jinja template that replaces the model's.
    pub template: Option<String>,
    /// Tool (function) definitions as JSON text, passed to the template as `tools`.
    pub tools: Option<String>,
}

/// Stable name of a family in `template_source` (`builtin:gemma`...).
pub fn family_name(family: ChatFamily) -> &'static str {
    match family {
        ChatFamily::Gemma => "gemma",
        ChatFamily::ChatMl => "chatml",
        ChatFamily::Llama3 => "llama3",
        ChatFamily::Phi3 => "phi3",
        ChatFamily::Mistral => "mistral",
    }
}

/// Control-token texts that close an assistant turn in `family`.
pub fn end_of_turn_markers(family: ChatFamily) -> &'static [&'static str] {
    match family {
        ChatFamily::Gemma => &["<end_of_turn>"],
        ChatFamily::ChatMl => &["<|im_end|>"],
        ChatFamily::Llama3 => &["<|eot_id|>", "<|eom_id|>"],
        ChatFamily::Phi3 => &["<|end|>"],
        ChatFamily::Mistral => &["</s>"],
    }
}

/// Pick the template: `override` > the model's own > the built-in for `family` > error.
/// Returns `(template_source, template_text)`.
pub fn choose_template<'a>(
    override_template: Option<&'a str>,
    model_template: Option<&'a str>,
    family: Option<ChatFamily>,
) -> Result<(String, Cow<'a, str>)> {
    if let Some(t) = override_template {
        return Ok(("override".into(), Cow::Borrowed(t)));
    }
    if let Some(t) = model_template.filter(|t| !t.trim().is_empty()) {
        return Ok(("model".into(), Cow::Borrowed(t)));
    }
    match family {
        Some(f) => Ok((format!("builtin:{}", family_name(f)), Cow::Owned(builtin_template(f)))),
        None => Err(LloyalError::ChatTemplate(
            "this model has no chat template and no built-in one matches its architecture; \
             pass template= (a Jinja chat template string)"
                .into(),
        )),
    }
}

/// Parse and check a JSON list of messages: each an object with a string `role` and a
/// `content` that is a string, null, or a list (multi-part content).
pub fn parse_messages(json: &str) -> Result<Vec<Json>> {
    let value: Json = serde_json::from_str(json)
        .map_err(|e| LloyalError::invalid(format!("messages are not valid JSON: {e}")))?;
    let Json::Array(messages) = value else {
        return Err(LloyalError::invalid("messages must be a list of dicts"));
    };
    for (i, m) in messages.iter().enumerate() {
        check_message(m).map_err(|e| LloyalError::invalid(format!("messages[{i}]: {e}")))?;
    }
    Ok(messages)
}

/// Check one message's shape (see [`parse_messages`]).
pub fn check_message(m: &Json) -> std::result::Result<(), String> {
    let Json::Object(map) = m else {
        return Err("must be a dict with 'role' and 'content'".into());
    };
    match map.get("role") {
        Some(Json::String(r)) if !r.is_empty() => {}
        Some(_) => return Err("'role' must be a non-empty string".into()),
        None => return Err("missing 'role' (e.g. 'user', 'assistant', 'system')".into()),
    }
    match map.get("content") {
        None | Some(Json::String(_) | Json::Null | Json::Array(_)) => {}
        Some(_) => return Err("'content' must be a string, None, or a list of parts".into()),
    }
    match map.get("tool_calls") {
        None | Some(Json::Array(_) | Json::Null) => Ok(()),
        Some(_) => Err("'tool_calls' must be a list".into()),
    }
}

/// Variables a template sees besides `messages`.
#[derive(Debug, Clone, Default)]
pub struct RenderVars<'a> {
    /// Append the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Tool definitions, or None.
    pub tools: Option<&'a Json>,
    /// BOS token text (`<bos>`).
    pub bos_token: &'a str,
    /// EOS token text (`<eos>`).
    pub eos_token: &'a str,
    /// Render only turns that follow a finished turn (no BOS, no preamble; built-ins only).
    pub continuation: bool,
}

/// Render `template` over `messages` with HF-compatible settings: `trim_blocks`,
/// `lstrip_blocks`, Python string/dict methods, `raise_exception`, `strftime_now`, `tojson`.
pub fn render(template: &str, messages: &[Json], vars: &RenderVars<'_>) -> Result<String> {
    let env = environment();
    let tmpl = env.template_from_str(template).map_err(template_error)?;
    let ctx = minijinja::context! {
        messages => Value::from(Serde(messages)),
        add_generation_prompt => vars.add_generation_prompt,
        tools => vars.tools.map(|t| Value::from(Serde(t))),
        bos_token => vars.bos_token,
        eos_token => vars.eos_token,
        continuation => vars.continuation,
    };
    tmpl.render(ctx).map_err(template_error)
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    if let Ok(syntax) = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build() {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, JinjaError> {
        Err(JinjaError::new(ErrorKind::InvalidOperation, format!("raise_exception: {msg}")))
    });
    env.add_function("strftime_now", |fmt: String| -> std::result::Result<String, JinjaError> {
        jiff::fmt::strtime::format(fmt.as_bytes(), jiff::Timestamp::now())
            .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))
    });
    env.add_filter("tojson", tojson);
    env
}

/// `tojson` as transformers defines it: Python `json.dumps` spacing (`", "`, `": "`), keys in
/// insertion order, no HTML escaping; `indent=N` pretty-prints. Other keyword arguments
/// (`ensure_ascii`, `sort_keys`...) are accepted and ignored.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let json = serde_json::to_value(value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(python_json(&json, indent)))
}

/// `json.dumps(value, indent=indent)` as Python writes it (non-ASCII kept as is).
pub fn python_json(value: &Json, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_json(&mut out, value, indent, 0);
    out
}

fn write_json(out: &mut String, value: &Json, indent: Option<usize>, depth: usize) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match value {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                write_json(out, v, indent, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

fn template_error(e: JinjaError) -> LloyalError {
    let mut msg = match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_string(),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        msg.push_str(&format!(" (template line {line})"));
    }
    LloyalError::ChatTemplate(msg)
}

impl Model {
    fn special_text(&self, token: i32) -> String {
        if token < 0 {
            return String::new();
        }
        self.token_bytes(token, true).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    /// Stop tokens for `family`: its end-of-turn control tokens, then EOG and EOS.
    pub fn chat_stop_tokens(&self, family: Option<ChatFamily>) -> Vec<i32> {
        let mut out = Vec::new();
        let markers = family.map(end_of_turn_markers).unwrap_or(&[]);
        for marker in markers {
            if let [t] = self.tokenize(marker, false, true)[..] {
                if self.is_eog(t) || self.special_text(t) == *marker {
                    out.push(t);
                }
            }
        }
        let eos = self.llama().vocab().eos().0;
        for t in [self.eog(), eos] {
            if t >= 0 && t < self.n_vocab() && !out.contains(&t) {
                out.push(t);
            }
        }
        out
    }

    fn render_vars<'a>(&self, bos: &'a str, eos: &'a str) -> RenderVars<'a> {
        RenderVars { bos_token: bos, eos_token: eos, ..RenderVars::default() }
    }

    /// Render `messages` (a JSON list; see [`parse_messages`]) as this model's chat prompt.
    /// Template: `options.template` > the GGUF's own > the built-in for [`Model::chat_family`].
    pub fn format_chat(&self, messages_json: &str, options: &ChatOptions) -> Result<FormattedChat> {
        let messages = parse_messages(messages_json)?;
        let own = self.chat_template();
        let family = self.chat_family();
        let (source, text) = choose_template(options.template.as_deref(), own.as_deref(), family)?;
        let family = ChatFamily::detect(Some(&text), &self.architecture());
        let tools: Option<Json> = match &options.tools {
            Some(t) => Some(
                serde_json::from_str(t)
                    .map_err(|e| LloyalError::invalid(format!("tools are not valid JSON: {e}")))?,
            ),
            None => None,
        };
        let (bos, eos) = (self.special_text(self.bos()), self.special_text(self.eos_token()));
        let vars = RenderVars {
            add_generation_prompt: options.add_generation_prompt,
            tools: tools.as_ref().filter(|t| !t.is_null()),
            ..self.render_vars(&bos, &eos)
        };
        let prompt = render(&text, &messages, &vars)?;
        Ok(FormattedChat { prompt, stop_tokens: self.chat_stop_tokens(family), template_source: source })
    }

    /// Render one new turn (`message_json`, a JSON object) exactly as it follows a finished
    /// turn in a full render with the built-in template of this model's family: prefill
    /// [`Model::turn_separator`] (closing the assistant turn) and then this prompt on a live
    /// branch instead of re-prefilling the whole conversation.
    pub fn format_chat_turn(&self, message_json: &str, add_generation_prompt: bool) -> Result<FormattedChat> {
        let messages = parse_messages(&format!("[{message_json}]"))?;
        let Some(family) = self.chat_family() else {
            return Err(LloyalError::ChatTemplate(
                "format_chat_turn needs a built-in chat family (Gemma, ChatML, Llama 3, Phi-3, Mistral); this \
                 model has none: re-render the whole conversation with format_chat(template=...)"
                    .into(),
            ));
        };
        let (bos, eos) = (self.special_text(self.bos()), self.special_text(self.eos_token()));
        let vars = RenderVars { add_generation_prompt, continuation: true, ..self.render_vars(&bos, &eos) };
        let prompt = render(&builtin_template(family), &messages, &vars)?;
        Ok(FormattedChat {
            prompt,
            stop_tokens: self.chat_stop_tokens(Some(family)),
            template_source: format!("builtin:{}", family_name(family)),
        })
    }

    pub(crate) fn eos_token(&self) -> i32 {
        self.llama().vocab().eos().0
    }
}
