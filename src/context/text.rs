//! `Context`'s tokenizer, detokenizer and chat templates.

use crate::detach::detached;
use crate::error::IntoPyResult;
use crate::text::PyTextStream;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::{to_i32, PyContext};
use crate::convert::{TokenId, Tokens};

#[pymethods]
impl PyContext {
    // ----- tokens and text -----

    /// Text to token ids; ``parse_special`` turns control-token text into control tokens.
    #[pyo3(signature = (text, add_special=true, parse_special=false))]
    fn tokenize(
        &self,
        py: Python<'_>,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> PyResult<Vec<i32>> {
        self.check_open()?;
        let model = self.inner.model().clone();
        let text = text.to_owned();
        detached(py, move || Ok(model.tokenize(&text, add_special, parse_special)))
    }

    /// Token ids to text; ``special`` renders control tokens.
    #[pyo3(signature = (tokens, special=false))]
    fn detokenize(&self, py: Python<'_>, tokens: Tokens, special: bool) -> PyResult<String> {
        self.check_open()?;
        let model = self.inner.model().clone();
        let tokens = to_i32(&model, &tokens)?;
        detached(py, move || model.detokenize(&tokens, special))
    }

    /// One token's text (a partial UTF-8 character becomes U+FFFD; use ``text_stream()``).
    #[pyo3(signature = (token, special=false))]
    fn token_to_text(&self, token: TokenId, special: bool) -> PyResult<String> {
        self.check_open()?;
        let model = self.inner.model();
        let t = model.check_token(*token).py()?;
        Ok(String::from_utf8_lossy(&model.token_bytes(t, special).py()?).into_owned())
    }

    /// One token's bytes as the model's vocabulary holds them (a byte-fallback token's one byte
    /// of a UTF-8 character, which :meth:`token_to_text` shows as U+FFFD).
    #[pyo3(signature = (token, special=false))]
    fn token_to_bytes<'py>(
        &self,
        py: Python<'py>,
        token: TokenId,
        special: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.check_open()?;
        let model = self.inner.model();
        let t = model.check_token(*token).py()?;
        Ok(PyBytes::new(py, &model.token_bytes(t, special).py()?))
    }

    /// A UTF-8-safe streaming detokenizer.
    fn text_stream(&self) -> PyResult<PyTextStream> {
        self.check_open()?;
        Ok(PyTextStream::new(self.inner.model().clone()))
    }

    /// Whether ``token`` ends generation (EOS/EOT).
    fn is_stop_token(&self, token: TokenId) -> PyResult<bool> {
        self.check_open()?;
        let model = self.inner.model();
        let t = model.check_token(*token).py()?;
        Ok(model.is_eog(t))
    }

    /// The end-of-generation token id.
    #[getter]
    fn eog_token(&self) -> i32 {
        self.inner.model().eog()
    }

    /// Every token :meth:`is_stop_token` holds (the model's end-of-generation tokens), in id
    /// order: what ``generate(min_tokens=...)`` bans until then.
    #[getter]
    fn eog_tokens(&self) -> Vec<i32> {
        self.inner.model().eog_tokens().to_vec()
    }

    /// Tokens that close a turn and lead to the next (``<end_of_turn>\n`` on Gemma).
    #[getter]
    fn turn_separator(&self) -> PyResult<Vec<i32>> {
        self.check_open()?;
        Ok(self.inner.model().turn_separator())
    }

    /// The beginning-of-sequence token id.
    #[getter]
    fn bos_token(&self) -> i32 {
        self.inner.model().bos()
    }

    // ----- chat -----

    /// Render a conversation as a prompt with a Jinja chat template.
    ///
    /// Template: ``template`` (a Jinja string) > the model's own GGUF template > the built-in
    /// one of the model's family (Gemma, ChatML, Llama 3, Phi-3, Mistral). Templates see ``messages``,
    /// ``add_generation_prompt``, ``tools``, ``bos_token``, ``eos_token``, and may use
    /// ``raise_exception(msg)``, ``strftime_now(fmt)``, ``tojson`` and Python string/dict
    /// methods (``.strip()``, ``.items()``...). The built-in Gemma template folds a leading
    /// system message into the first user turn and renders content verbatim.
    ///
    /// Tokenize the prompt with ``add_special=False, parse_special=True`` (it holds the BOS
    /// text and the turn markers).
    ///
    /// Args:
    ///     messages: Dicts with ``role`` and ``content`` (str, None or a list of
    ///         ``{"type": "text", "text": ...}`` parts); optional ``tool_calls``.
    ///     add_generation_prompt: Append the opening of an assistant turn.
    ///     template: A Jinja chat template that overrides the model's.
    ///     tools: JSON-serialisable tool (function) definitions, passed as ``tools``.
    ///     **template_kwargs: More JSON-serialisable template variables (``enable_thinking``,
    ///         ``documents``, ``date_string``, any custom one), as in Hugging Face's
    ///         ``apply_chat_template``.
    ///
    /// Returns:
    ///     The prompt, the stop tokens and where the template came from.
    ///
    /// Raises:
    ///     TypeError: ``messages``/``tools`` are not lists of JSON-serialisable dicts, or a
    ///         template variable is not JSON-serialisable.
    ///     ValueError: A message lacks a string ``role`` or has a bad ``content``, or a
    ///         template variable reuses a name format_chat sets (``bos_token``...).
    ///     ChatTemplateError: The template failed (syntax, ``raise_exception``), or the
    ///         model has no template and no built-in fits (pass ``template=``).
    #[pyo3(signature = (messages, *, add_generation_prompt=true, template=None, tools=None, **template_kwargs))]
    fn format_chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        template: Option<String>,
        tools: Option<&Bound<'_, PyAny>>,
        template_kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        self.check_open()?;
        let messages = crate::chat::messages_json(py, messages)?;
        let tools = crate::chat::tools_json(py, tools)?;
        let extra_vars = crate::chat::template_vars_json(py, template_kwargs)?;
        let options = lloyal_core::ChatOptions { add_generation_prompt, template, tools, extra_vars };
        let model = self.inner.model().clone();
        let formatted = detached(py, move || model.format_chat(&messages, &options))?;
        crate::chat::formatted_to_py(py, formatted)
    }

    /// Render one new turn exactly as it follows a finished assistant turn.
    ///
    /// For warm multi-turn chat on a live branch: after generating the assistant reply
    /// (stopped at a stop token, which is not in the KV), prefill ``turn_separator`` and then
    /// ``tokenize(turn.prompt, add_special=False, parse_special=True)``. The result equals,
    /// token for token, a cold prefill of ``format_chat`` over the whole conversation with
    /// the same template: ``template`` > the model's own > its family's built-in. A Jinja
    /// template that does not render a new turn as a plain continuation (it rewrites earlier
    /// turns, or refuses the role order) falls back to the built-in one.
    ///
    /// Args:
    ///     message: The new message (usually ``{"role": "user", "content": ...}``).
    ///     add_generation_prompt: Append the opening of the next assistant turn.
    ///     template: The Jinja chat template the conversation was started with, if not the
    ///         model's.
    ///
    /// Returns:
    ///     The turn's text (no BOS, no system/tools preamble) and the stop tokens.
    ///
    /// Raises:
    ///     TypeError: ``message`` is not a dict.
    ///     ValueError: It lacks a string ``role`` or has a bad ``content``.
    ///     ChatTemplateError: The model belongs to no built-in chat family, or ``template``
    ///         does not render a turn as a plain continuation.
    #[pyo3(signature = (message, *, add_generation_prompt=true, template=None))]
    fn format_chat_turn(
        &self,
        py: Python<'_>,
        message: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        template: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        self.check_open()?;
        let message = crate::chat::message_json(py, message)?;
        let model = self.inner.model().clone();
        let formatted = detached(py, move || {
            model.format_chat_turn(&message, add_generation_prompt, template.as_deref())
        })?;
        crate::chat::formatted_to_py(py, formatted)
    }
}
