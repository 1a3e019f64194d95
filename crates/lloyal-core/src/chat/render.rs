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
    /// More template variables as a JSON object text (`enable_thinking`, `documents`,
    /// `date_string`, any custom one), like the keyword arguments of Hugging Face's
    /// `apply_chat_template`.
    pub extra_vars: Option<String>,
}

/// Names the renderer sets itself; extra template variables may not reuse them.
pub const RESERVED_VARS: &[&str] =
    &["messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "continuation"];

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
    /// More variables (a JSON object; keys outside [`RESERVED_VARS`]).
    pub extra: Option<&'a serde_json::Map<String, Json>>,
}

/// Render `template` over `messages` with HF-compatible settings: `trim_blocks`,
/// `lstrip_blocks`, Python string/dict methods, `raise_exception`, `strftime_now`, `tojson`.
pub fn render(template: &str, messages: &[Json], vars: &RenderVars<'_>) -> Result<String> {
    let env = environment();
    let template = plain_generation_blocks(template);
    let tmpl = env.template_from_str(&template).map_err(template_error)?;
    let fixed: [(&str, Value); 6] = [
        ("messages", Value::from(Serde(messages))),
        ("add_generation_prompt", Value::from(vars.add_generation_prompt)),
        ("tools", vars.tools.map(|t| Value::from(Serde(t))).unwrap_or(Value::from(()))),
        ("bos_token", Value::from(vars.bos_token)),
        ("eos_token", Value::from(vars.eos_token)),
        ("continuation", Value::from(vars.continuation)),
    ];
    let extra = vars.extra.into_iter().flatten().map(|(k, v)| (k.as_str(), Value::from(Serde(v))));
    let ctx = Value::from(extra.chain(fixed).collect::<std::collections::BTreeMap<&str, Value>>());
    tmpl.render(ctx).map_err(template_error)
}

/// Hugging Face's `{% generation %}...{% endgeneration %}` (which marks the assistant's
/// tokens in training templates) as a plain block: `{% if true %}...{% endif %}`, keeping the
/// tags' whitespace control (`{%-`, `-%}`).
pub fn plain_generation_blocks(template: &str) -> Cow<'_, str> {
    if !template.contains("generation") {
        return Cow::Borrowed(template);
    }
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return Cow::Owned(out);
        };
        let inner = &tag[2..end];
        let (lead, body) = inner.strip_prefix('-').map_or(("", inner), |b| ("-", b));
        let (body, trail) = body.strip_suffix('-').map_or((body, ""), |b| (b, "-"));
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// The most instructions one render may run (a 1,000-message conversation with tools takes
/// well under a million).
const TEMPLATE_FUEL: u64 = 50_000_000;

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    if let Ok(syntax) = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build() {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // A template is a user's input: a bounded amount of work (a loop of 10^10 steps would run
    // for minutes), far above what a chat template spends on a long conversation.
    env.set_fuel(Some(TEMPLATE_FUEL));
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

/// `tojson` as transformers defines it: Python `json.dumps` with `ensure_ascii=False`, keys in
/// insertion order, no HTML escaping; `indent=N` pretty-prints, `sort_keys=True` sorts keys,
/// `ensure_ascii=True` escapes non-ASCII as `\uXXXX`, `separators=(item, key)` replaces
/// `", "`/`": "` (`","` for items when indenting).
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let separators = match separators.as_deref() {
        None => None,
        Some([item, key]) => Some((item.clone(), key.clone())),
        Some(_) => {
            return Err(JinjaError::new(ErrorKind::InvalidOperation, "tojson: separators is (item, key)"))
        }
    };
    let json = serde_json::to_value(value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let style = JsonStyle {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        separators,
    };
    let mut out = String::new();
    write_json(&mut out, &json, &style, 0);
    Ok(Value::from_safe_string(out))
}

/// How `json.dumps` is asked to write.
#[derive(Default)]
struct JsonStyle {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
    /// `(item, key)` separators (`None`: Python's defaults).
    separators: Option<(String, String)>,
}

/// `json.dumps(value, indent=indent)` as Python writes it (non-ASCII kept as is).
pub fn python_json(value: &Json, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_json(&mut out, value, &JsonStyle { indent, ..JsonStyle::default() }, 0);
    out
}

fn write_json(out: &mut String, value: &Json, style: &JsonStyle, depth: usize) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = style.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let (item_sep, key_sep) = match &style.separators {
        Some((item, key)) => (item.as_str(), key.as_str()),
        None => (if style.indent.is_some() { "," } else { ", " }, ": "),
    };
    match value {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, style, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            let mut pairs: Vec<(&String, &Json)> = map.iter().collect();
            if style.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(b.0));
            }
            for (i, (k, v)) in pairs.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_string(out, k, style.ensure_ascii);
                out.push_str(key_sep);
                write_json(out, v, style, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
        Json::String(text) => write_string(out, text, style.ensure_ascii),
        other => out.push_str(&other.to_string()),
    }
}

/// A JSON string; with `ascii`, every non-ASCII character as `\uXXXX` (UTF-16 pairs beyond
/// the BMP), as Python's `ensure_ascii`.
fn write_string(out: &mut String, text: &str, ascii: bool) {
    let quoted = Json::String(text.to_owned()).to_string();
    if !ascii || quoted.is_ascii() {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
}

/// The text `template` adds for `message` after a finished assistant turn closed by
/// `separator`: render a short conversation (user, assistant) without and with `message` and
/// take the difference. `None` when the template fails on it or the longer render does not
/// extend the shorter one ending in `separator` (the turn would not splice on token for token).
pub fn turn_delta(template: &str, message: &Json, vars: &RenderVars<'_>, separator: &str) -> Option<String> {
    const REPLY: &str = "lloyal-turn-probe-reply";
    let history = vec![
        serde_json::json!({"role": "user", "content": "lloyal-turn-probe"}),
        serde_json::json!({"role": "assistant", "content": REPLY}),
    ];
    let before =
        render(template, &history, &RenderVars { add_generation_prompt: false, ..vars.clone() }).ok()?;
    if !before.ends_with(&format!("{REPLY}{separator}")) {
        return None;
    }
    let mut longer = history;
    longer.push(message.clone());
    let after = render(template, &longer, vars).ok()?;
    after.strip_prefix(&before).map(str::to_owned)
}

/// The extra template variables (a JSON object), refusing the names the renderer sets.
pub(crate) fn parse_extra_vars(json: Option<&str>) -> Result<Option<serde_json::Map<String, Json>>> {
    let Some(json) = json else { return Ok(None) };
    let map = match serde_json::from_str(json) {
        Ok(Json::Object(map)) => map,
        Ok(_) => return Err(LloyalError::invalid("template variables must be a JSON object")),
        Err(e) => return Err(LloyalError::invalid(format!("template variables are not valid JSON: {e}"))),
    };
    if let Some(k) = map.keys().find(|k| RESERVED_VARS.contains(&k.as_str())) {
        return Err(LloyalError::invalid(format!(
            "template variable '{k}' is set by format_chat itself (reserved: {}); pass it through \
             its own argument or rename it",
            RESERVED_VARS.join(", ")
        )));
    }
    Ok(Some(map))
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
        let extra = parse_extra_vars(options.extra_vars.as_deref())?;
        let (bos, eos) = (self.special_text(self.bos()), self.special_text(self.eos_token()));
        let vars = RenderVars {
            add_generation_prompt: options.add_generation_prompt,
            tools: tools.as_ref().filter(|t| !t.is_null()),
            extra: extra.as_ref(),
            ..self.render_vars(&bos, &eos)
        };
        let prompt = render(&text, &messages, &vars)?;
        Ok(FormattedChat { prompt, stop_tokens: self.chat_stop_tokens(family), template_source: source })
    }

    /// Render one new turn (`message_json`, a JSON object) exactly as it follows a finished
    /// assistant turn in a full [`Model::format_chat`] render with the same template
    /// (`template` > the model's own > the family's built-in): prefill
    /// [`Model::turn_separator`] (closing the assistant turn) and then this prompt on a live
    /// branch instead of re-prefilling the whole conversation. A Jinja template is asked for
    /// the difference between a conversation with and without the new turn; when that is not
    /// a clean continuation (the template rewrites earlier turns, or refuses the role order),
    /// the family's built-in template renders the turn instead.
    pub fn format_chat_turn(
        &self,
        message_json: &str,
        add_generation_prompt: bool,
        template: Option<&str>,
    ) -> Result<FormattedChat> {
        let messages = parse_messages(&format!("[{message_json}]"))?;
        let (bos, eos) = (self.special_text(self.bos()), self.special_text(self.eos_token()));
        let own = self.chat_template();
        let jinja = template
            .map(|t| ("override", t))
            .or(own.as_deref().filter(|t| !t.trim().is_empty()).map(|t| ("model", t)));
        if let Some((source, text)) = jinja {
            let family = ChatFamily::detect(Some(text), &self.architecture());
            let vars = RenderVars { add_generation_prompt, ..self.render_vars(&bos, &eos) };
            // The caller closes the assistant turn with the model's `turn_separator`.
            let separator = self.chat_family().map(ChatFamily::turn_separator);
            if let Some(prompt) = separator.and_then(|sep| turn_delta(text, &messages[0], &vars, sep)) {
                return Ok(FormattedChat {
                    prompt,
                    stop_tokens: self.chat_stop_tokens(family),
                    template_source: source.into(),
                });
            }
            if template.is_some() {
                return Err(LloyalError::ChatTemplate(
                    "format_chat_turn: this template does not render a new turn as a plain \
                     continuation of the conversation (or belongs to no known chat family); \
                     re-render the whole conversation with format_chat(template=...)"
                        .into(),
                ));
            }
        }
        let Some(family) = self.chat_family() else {
            return Err(LloyalError::ChatTemplate(
                "format_chat_turn needs a built-in chat family (Gemma, ChatML, Llama 3, Phi-3, Mistral); this \
                 model has none: re-render the whole conversation with format_chat(template=...)"
                    .into(),
            ));
        };
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
