//! `lloyal.Context`: one llama.cpp context; tokenizer, flat decode path, sampling, raw KV ops.

use std::path::PathBuf;
use std::sync::Arc;

use lloyal_core::{write_atomic, Base, Context, ContextOptions, ModelOptions, Pooling};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyType};

use crate::convert::{clamp_i32, narrow, readonly_f32};
use crate::detach::{detached, detached_io, run, without_gil};
use crate::embeddings::{extract_texts, to_array};
use crate::engine::PyEngineStats;
use crate::error::IntoPyResult;
use crate::grammar::PyGrammar;
use crate::metrics::PyPerplexityTracker;
use crate::model::PyModel;
use crate::sampling::extract_params;
use crate::text::PyTextStream;

/// A llama.cpp context: KV cache, sequences and the flat decode path.
///
/// Always created with a unified KV cache and a full-size SWA cache, so forks share
/// prefix cells. A context manager; ``close()`` is idempotent.
///
/// Batch invariance (``batch_invariant=True``): a token's logits do not depend on which other
/// rows share its decode (``n_batch``, batched vs single commits, packed prefill) nor on where
/// its cells sit in the cache, so greedy output is identical whatever the batching. It takes
/// llama.cpp's per-row kernels, about a quarter slower on prompts: weights not repacked (a
/// ``Context`` built from a path loads them so), flash attention on its one-row path (the K
/// cache defaults to ``q8_0`` for that), and ggml's tiled K-quant matmul off. By default
/// (``None``) a context runs llama.cpp's fastest kernels (repacked weights, f16 K cache), unless
/// its ``Model`` was loaded with ``repack=False``: then ``None`` turns invariance on when the
/// cache types allow it. Float (F32/F16/BF16) weights never allow it: llama.cpp multiplies them
/// with one kernel for a single row and another for several.
///
/// ``pooling`` (for ``embeddings=True``): ``None`` pools the way the model's GGUF declares
/// (``<arch>.pooling_type``, e.g. the last token for Qwen3-Embedding), else by mean.
///
/// Example:
///     >>> with Context(default_model_path(), n_ctx=512) as ctx:
///     ...     ctx.decode(ctx.tokenize("Hello"), 0)
///     ...     token = ctx.sample(temperature=0)
#[pyclass(name = "Context", module = "lloyal._lloyal", frozen)]
pub struct PyContext {
    pub(crate) inner: Arc<Context>,
    model: Py<PyModel>,
}

impl PyContext {
    fn ctx(&self) -> &Context {
        &self.inner
    }

    fn check_open(&self) -> PyResult<()> {
        self.inner.check_open().py()
    }
}

#[pymethods]
impl PyContext {
    #[new]
    #[pyo3(signature = (model, *, n_ctx=2048, n_batch=512, n_seq_max=1, n_threads=None,
                        embeddings=false, pooling=None, type_k=None, type_v="f16", flash_attn=true,
                        batch_invariant=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: &Bound<'_, PyAny>,
        n_ctx: i64,
        n_batch: i64,
        n_seq_max: i64,
        n_threads: Option<i64>,
        embeddings: bool,
        pooling: Option<&str>,
        type_k: Option<&str>,
        type_v: &str,
        flash_attn: bool,
        batch_invariant: Option<bool>,
    ) -> PyResult<Self> {
        let options = ContextOptions {
            n_ctx: narrow("n_ctx", n_ctx, "a positive number of KV cells")?,
            n_batch: narrow("n_batch", n_batch, "a positive number of tokens per decode")?,
            n_seq_max: narrow("n_seq_max", n_seq_max, "a positive number of sequences")?,
            n_threads: n_threads.map(|t| narrow("n_threads", t, "in 1..=1024")).transpose()?,
            embeddings,
            pooling: pooling.map(Pooling::parse).transpose().py()?,
            type_k: type_k.map(str::to_string),
            type_v: type_v.to_string(),
            flash_attn,
            batch_invariant,
        };
        options.validate().py()?;
        let model: Py<PyModel> = match model.cast::<PyModel>() {
            Ok(m) => m.clone().unbind(),
            Err(_) => {
                let path: PathBuf = model.extract()?;
                let inner = PyModel::load(py, path, ModelOptions::for_context(batch_invariant))?;
                Py::new(py, PyModel { inner })?
            }
        };
        let core_model = model.get().inner.clone();
        let inner = detached(py, move || Context::new(core_model, options))?;
        Ok(PyContext { inner, model })
    }

    /// The :class:`Model` this context runs.
    #[getter]
    fn model(&self, py: Python<'_>) -> Py<PyModel> {
        self.model.clone_ref(py)
    }

    /// Total KV cells (tokens) across all sequences.
    #[getter]
    fn n_ctx(&self) -> u32 {
        self.inner.shape().n_ctx
    }

    /// Most tokens per ``llama_decode`` call.
    #[getter]
    fn n_batch(&self) -> u32 {
        self.inner.shape().n_batch
    }

    /// Number of sequence ids (branch leases).
    #[getter]
    fn n_seq_max(&self) -> u32 {
        self.inner.shape().n_seq_max
    }

    /// Vocabulary size.
    #[getter]
    fn n_vocab(&self) -> i32 {
        self.inner.shape().n_vocab
    }

    /// Vocabulary size (alias of ``n_vocab``).
    #[getter]
    fn vocab_size(&self) -> i32 {
        self.inner.shape().n_vocab
    }

    /// Threads used for decoding.
    #[getter]
    fn n_threads(&self) -> i32 {
        self.inner.shape().n_threads
    }

    /// Whether flash attention is on (default, as in llama.cpp; needed for a quantized
    /// ``type_v`` and for batch invariance).
    #[getter]
    fn flash_attn(&self) -> bool {
        self.inner.options().flash_attn
    }

    /// Whether this context runs batch-invariant kernels (see ``Context``).
    #[getter]
    fn batch_invariant(&self) -> bool {
        self.inner.options().is_batch_invariant()
    }

    /// K cache element type (``"q8_0"`` by default in a batch-invariant context, else ``"f16"``).
    #[getter]
    fn type_k(&self) -> String {
        self.inner.options().type_k.clone().unwrap_or_default()
    }

    /// V cache element type.
    #[getter]
    fn type_v(&self) -> String {
        self.inner.options().type_v.clone()
    }

    /// Whether this is an embeddings context.
    #[getter(embeddings)]
    fn embeddings_enabled(&self) -> bool {
        self.inner.shape().embeddings
    }

    /// Bytes of KV cache memory.
    #[getter]
    fn memory_size(&self, py: Python<'_>) -> PyResult<u64> {
        run(py, self.ctx(), |s| Ok(s.memory_size()))
    }

    /// Whether ``close()`` has run.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// The engine's counters: ticks, ``llama_decode`` calls, rows, operations coalesced,
    /// queue depth. Every ``commit``/``prefill`` (Branch, BranchStore, their ``a*`` forms,
    /// token iteration) runs on the engine, one scheduler thread per context.
    ///
    /// Example:
    ///     >>> ctx.engine_stats().decode_calls >= 0
    ///     True
    fn engine_stats(&self) -> PyEngineStats {
        self.inner.engine_stats().into()
    }

    /// Hold the engine: submitted operations wait in its queue until ``resume_engine()``.
    /// Useful to make coalescing deterministic (pause, submit from N callers, resume: one tick).
    fn pause_engine(&self) {
        self.inner.pause_engine();
    }

    /// Let the engine tick again after ``pause_engine()``.
    fn resume_engine(&self) {
        self.inner.resume_engine();
    }

    /// Seconds (0 to 1, default 0.002) a tick waits for as many commits as the previous tick
    /// decoded, so callers that come back at slightly different times share one decode.
    #[getter]
    fn engine_gather(&self) -> f64 {
        self.inner.engine_stats().gather
    }

    #[setter]
    fn set_engine_gather(&self, seconds: f64) -> PyResult<()> {
        self.inner.set_engine_gather(seconds).py()
    }

    /// Most prompt tokens one engine tick prefills. None (the default) paces them: with
    /// streams running, each tick carries as many prompt tokens as keep it at about 1.5x a
    /// decode-only tick, measured as the engine runs; with none running, the tick's
    /// ``n_batch``. 0 always fills the batch (the most throughput, the longest waits for
    /// running streams); a number caps every tick at that many.
    #[getter]
    fn engine_prefill_chunk(&self) -> Option<usize> {
        self.inner.engine_prefill_chunk()
    }

    #[setter]
    fn set_engine_prefill_chunk(&self, tokens: Option<i64>) -> PyResult<()> {
        let tokens = tokens
            .map(|t| {
                usize::try_from(t).map_err(|_| {
                    pyo3::exceptions::PyValueError::new_err(format!(
                        "engine_prefill_chunk must be None (paced), 0 (fill the batch) or a positive \
                         number of tokens, got {t}"
                    ))
                })
            })
            .transpose()?;
        self.inner.set_engine_prefill_chunk(tokens);
        Ok(())
    }

    /// Free the context (waits for a running call; idempotent).
    fn close(&self, py: Python<'_>) {
        let inner = self.inner.clone();
        without_gil(py, move || inner.close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

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
    fn detokenize(&self, py: Python<'_>, tokens: Vec<i64>, special: bool) -> PyResult<String> {
        self.check_open()?;
        let model = self.inner.model().clone();
        let tokens = to_i32(&model, &tokens)?;
        detached(py, move || model.detokenize(&tokens, special))
    }

    /// One token's text (a partial UTF-8 character becomes U+FFFD; use ``text_stream()``).
    #[pyo3(signature = (token, special=false))]
    fn token_to_text(&self, token: i64, special: bool) -> PyResult<String> {
        self.check_open()?;
        let model = self.inner.model();
        let t = model.check_token(token).py()?;
        Ok(String::from_utf8_lossy(&model.token_bytes(t, special).py()?).into_owned())
    }

    /// A UTF-8-safe streaming detokenizer.
    fn text_stream(&self) -> PyResult<PyTextStream> {
        self.check_open()?;
        Ok(PyTextStream::new(self.inner.model().clone()))
    }

    /// Whether ``token`` ends generation (EOS/EOT).
    fn is_stop_token(&self, token: i64) -> PyResult<bool> {
        self.check_open()?;
        let model = self.inner.model();
        let t = model.check_token(token).py()?;
        Ok(model.is_eog(t))
    }

    /// The end-of-generation token id.
    #[getter]
    fn eog_token(&self) -> i32 {
        self.inner.model().eog()
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

    // ----- flat decode path -----

    /// Decode ``tokens`` on ``seq_id`` starting at ``pos`` (chunked by n_batch; all-or-nothing).
    #[pyo3(signature = (tokens, pos, seq_id=0))]
    fn decode(&self, py: Python<'_>, tokens: Vec<i64>, pos: i64, seq_id: i64) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        let pos = clamp_i32(pos);
        let tokens = to_i32(self.inner.model(), &tokens)?;
        run(py, self.ctx(), move |s| s.decode(&tokens, pos, seq_id))
    }

    /// Sample from the last decode's logits; the token joins the penalty history.
    ///
    /// ``logits=`` samples from that float32 array (length n_vocab, e.g. a modified copy of
    /// ``get_logits()``) instead. ``grammar=`` masks every token the grammar forbids first;
    /// the grammar is not advanced: call ``grammar.accept(token)`` yourself.
    #[pyo3(signature = (params=None, *, grammar=None, logits=None, **overrides))]
    fn sample(
        &self,
        py: Python<'_>,
        params: Option<&Bound<'_, PyAny>>,
        grammar: Option<Py<PyGrammar>>,
        logits: Option<PyReadonlyArray1<'_, f32>>,
        overrides: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<i32> {
        let params = extract_params(params, overrides)?;
        let logits = logits.map(|l| l.as_array().to_vec());
        run(py, self.ctx(), move |s| match &grammar {
            Some(g) => s.sample_from(params, logits, Some(&mut *g.get().lock())),
            None => s.sample_from(params, logits, None),
        })
    }

    /// BlinkKV: clear the cache, decode ``sinks`` at 0 and ``tail`` after them on seq 0
    /// (sampler history kept); returns the next position, ``len(sinks) + len(tail)``.
    fn clear_and_reseed(&self, py: Python<'_>, sinks: Vec<i64>, tail: Vec<i64>) -> PyResult<i32> {
        let sinks = to_i32(self.inner.model(), &sinks)?;
        let tail = to_i32(self.inner.model(), &tail)?;
        run(py, self.ctx(), move |s| s.clear_and_reseed(&sinks, &tail))
    }

    /// Forget the flat sampler's penalty history and RNG state.
    fn reset_sampler(&self, py: Python<'_>) -> PyResult<()> {
        run(py, self.ctx(), |s| {
            s.reset_sampler();
            Ok(())
        })
    }

    /// The last decode's logits: a read-only float32 array of shape ``(n_vocab,)``.
    fn get_logits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let logits = run(py, self.ctx(), |s| Ok(s.logits()?.to_vec()))?;
        readonly_f32(py, logits)
    }

    /// Entropy of the next-token distribution, in ``"nats"`` or ``"bits"``.
    #[pyo3(signature = (base="nats"))]
    fn model_entropy(&self, py: Python<'_>, base: &str) -> PyResult<f64> {
        let base = Base::parse(base).py()?;
        run(py, self.ctx(), move |s| s.model_entropy(base))
    }

    /// Surprisal ``-log p(token)`` under the last logits, in ``"nats"`` or ``"bits"``.
    #[pyo3(signature = (token, base="nats"))]
    fn model_surprisal(&self, py: Python<'_>, token: i64, base: &str) -> PyResult<f64> {
        let base = Base::parse(base).py()?;
        let t = self.inner.model().check_token(token).py()?;
        run(py, self.ctx(), move |s| s.model_surprisal(t, base))
    }

    /// Parse GBNF rules into a :class:`Grammar` handle (``GrammarError`` if invalid).
    #[pyo3(signature = (gbnf, root="root"))]
    fn create_grammar(&self, py: Python<'_>, gbnf: String, root: &str) -> PyResult<PyGrammar> {
        self.check_open()?;
        let model = self.inner.model().clone();
        Ok(PyGrammar::from_core(PyGrammar::parse(py, model, gbnf, root.to_string(), Default::default())?))
    }

    /// A new, empty perplexity tracker.
    fn create_perplexity_tracker(&self) -> PyResult<PyPerplexityTracker> {
        self.check_open()?;
        Ok(PyPerplexityTracker::from_core(lloyal_core::PerplexityTracker::new()))
    }

    // ----- embeddings -----

    /// Width of one embedding vector (``n_embd``; 640 for Gemma 3 270M).
    #[getter]
    fn embedding_dimension(&self) -> PyResult<usize> {
        self.check_open()?;
        Ok(lloyal_core::embeddings::embedding_dimension(self.inner.model()))
    }

    /// Compute embeddings of ``tokens`` on ``seq_id`` (needs ``embeddings=True``).
    ///
    /// Clears ``seq_id``, decodes ``tokens`` from position 0, keeps the vectors for
    /// :meth:`get_embeddings`, then clears the sequence again (no cells are left behind).
    /// With pooling ``"mean"``/``"cls"``/``"last"`` the tokens must fit in one decode
    /// (``n_batch``); with ``"none"`` longer runs are chunked.
    ///
    /// Raises:
    ///     ValueError: not an embeddings context, empty ``tokens``, too many tokens, or a
    ///         ``seq_id`` outside ``[0, n_seq_max)``.
    ///     InvalidTokenError: a token id outside the vocabulary.
    ///     SeqLeasedError: a live branch holds ``seq_id``.
    ///     ContextClosedError: the context is closed.
    #[pyo3(signature = (tokens, seq_id=0))]
    fn encode(&self, py: Python<'_>, tokens: Vec<i64>, seq_id: i64) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        let tokens = to_i32(self.inner.model(), &tokens)?;
        run(py, self.ctx(), move |s| s.encode(&tokens, seq_id))
    }

    /// The vectors of the last :meth:`encode` on ``seq_id``, as a new float32 array.
    ///
    /// Shape ``(embedding_dimension,)`` when pooled, ``(n_tokens, embedding_dimension)``
    /// with ``pooling="none"``. ``normalize`` scales each row to unit L2 norm.
    ///
    /// Raises:
    ///     ValueError: not an embeddings context, or no ``encode`` ran on ``seq_id``.
    #[pyo3(signature = (normalize=true, seq_id=0))]
    fn get_embeddings<'py>(
        &self,
        py: Python<'py>,
        normalize: bool,
        seq_id: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let seq_id = clamp_i32(seq_id);
        let pooled = self.inner.options().pooling() != Pooling::None;
        let encoded = run(py, self.ctx(), move |s| s.embeddings(seq_id, normalize))?;
        to_array(py, encoded, pooled)
    }

    /// Pooled embeddings of ``texts`` (tokenized with BOS); needs ``embeddings=True``.
    ///
    /// One ``str`` gives shape ``(embedding_dimension,)``; a list gives
    /// ``(len(texts), embedding_dimension)`` in input order. Texts are packed across the
    /// free sequences (not leased by a branch and empty) into as few ``llama_decode`` calls
    /// as ``n_batch`` and those sequences allow (one when all fit), and the sequences are
    /// cleared after reading; other sequences are not touched.
    ///
    /// Raises:
    ///     ValueError: not an embeddings context, pooling ``"none"``, a text longer than
    ///         ``n_batch`` tokens, or no empty sequence to borrow.
    ///     SeqLeasedError: no sequence is free and a live branch holds one.
    ///     KvCacheFullError: the cache has no room for a group of texts.
    #[pyo3(signature = (texts, normalize=true))]
    fn embed<'py>(
        &self,
        py: Python<'py>,
        texts: &Bound<'py, PyAny>,
        normalize: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (texts, single) = extract_texts(texts)?;
        let encoded = run(py, self.ctx(), move |s| s.embed(&texts, normalize))?;
        to_array(py, encoded, single)
    }

    // ----- raw KV ops -----

    /// Largest position stored for ``seq_id`` (-1 when empty).
    #[pyo3(signature = (seq_id=0))]
    fn kv_cache_size(&self, py: Python<'_>, seq_id: i64) -> PyResult<i32> {
        let seq_id = clamp_i32(seq_id);
        run(py, self.ctx(), move |s| s.seq_pos_max(seq_id))
    }

    /// Largest position stored for ``seq_id`` (-1 when empty).
    fn kv_seq_pos_max(&self, py: Python<'_>, seq_id: i64) -> PyResult<i32> {
        let seq_id = clamp_i32(seq_id);
        run(py, self.ctx(), move |s| s.seq_pos_max(seq_id))
    }

    /// Empty every sequence (refused while a branch holds one).
    fn kv_cache_clear(&self, py: Python<'_>) -> PyResult<()> {
        run(py, self.ctx(), |s| s.kv_clear())
    }

    /// Remove positions ``[start, end)`` of ``seq_id``; ``end=-1`` means to the end.
    #[pyo3(signature = (seq_id, start, end=-1), text_signature = "(self, seq_id, start, end=-1)")]
    fn kv_cache_remove(&self, py: Python<'_>, seq_id: i64, start: i64, end: i64) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        let start = clamp_i32(start);
        let end = clamp_i32(end);
        run(py, self.ctx(), move |s| s.kv_remove(seq_id, start, end))
    }

    /// Share ``src``'s cells ``[p0, p1)`` with ``dst`` (metadata only, no tensor copy).
    #[pyo3(signature = (src, dst, p0=0, p1=-1), text_signature = "(self, src, dst, p0=0, p1=-1)")]
    fn kv_seq_copy(&self, py: Python<'_>, src: i64, dst: i64, p0: i64, p1: i64) -> PyResult<()> {
        let src = clamp_i32(src);
        let dst = clamp_i32(dst);
        let p0 = clamp_i32(p0);
        let p1 = clamp_i32(p1);
        run(py, self.ctx(), move |s| s.kv_copy(src, dst, p0, p1))
    }

    /// Keep only ``seq_id``; drop every other sequence's cells.
    fn kv_seq_keep(&self, py: Python<'_>, seq_id: i64) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        run(py, self.ctx(), move |s| s.kv_keep(seq_id))
    }

    // ----- KV state -----

    /// ``seq_id``'s KV cells (via ``llama_state_seq_get_data``) in a verified envelope.
    ///
    /// Format (little-endian): magic ``LLOYALKV``, u32 version (1), the model's fingerprint
    /// (i32 n_vocab, i32 n_embd, u32 n_layer, u64 n_params, 32-byte NUL-padded
    /// architecture), i32 smallest and largest position, u32 token count, u64 payload
    /// length, the tokens (i32 each), llama.cpp's payload, and a trailing u64 FNV-1a 64 of
    /// every preceding byte. No logits are saved.
    ///
    /// Raises:
    ///     ValueError: ``seq_id`` outside ``[0, n_seq_max)``.
    #[pyo3(signature = (seq_id=0))]
    fn kv_cache_save<'py>(&self, py: Python<'py>, seq_id: i64) -> PyResult<Bound<'py, PyBytes>> {
        let seq_id = clamp_i32(seq_id);
        let data = run(py, self.ctx(), move |s| s.kv_save(seq_id))?;
        Ok(PyBytes::new(py, &data))
    }

    /// Replace ``seq_id``'s cells with bytes from :meth:`kv_cache_save`.
    ///
    /// The envelope is verified (magic, version, lengths, checksum, model fingerprint)
    /// before llama.cpp sees the payload. On any failure ``seq_id`` is left empty and no
    /// other sequence changes. No logits are restored: decode the next token to get some.
    ///
    /// Raises:
    ///     StateError: truncated, corrupt or foreign bytes, or llama.cpp refused the payload
    ///         (another cache type, too few free cells).
    ///     SeqLeasedError: a live branch holds ``seq_id`` (nothing is changed).
    fn kv_cache_load(&self, py: Python<'_>, seq_id: i64, data: &[u8]) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        run(py, self.ctx(), move |s| s.kv_load(seq_id, data).map(drop))
    }

    /// Save ``seq_id``'s cells with ``tokens`` (the text they came from) to ``path``.
    ///
    /// Same format as :meth:`kv_cache_save`; written to a temporary file and renamed, so
    /// ``path`` never holds a half-written state.
    fn kv_cache_write_file(
        &self,
        py: Python<'_>,
        seq_id: i64,
        path: PathBuf,
        tokens: Vec<i64>,
    ) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        let tokens = to_i32(self.inner.model(), &tokens)?;
        let data = run(py, self.ctx(), move |s| s.kv_save_tokens(seq_id, &tokens))?;
        detached_io(py, move || write_atomic(&path, &data))
    }

    /// Load a file from :meth:`kv_cache_write_file` into ``seq_id``; returns its tokens.
    ///
    /// Raises:
    ///     OSError: the file cannot be read (nothing is changed).
    ///     StateError: as :meth:`kv_cache_load` (``seq_id`` is left empty).
    ///     SeqLeasedError: a live branch holds ``seq_id``.
    fn kv_cache_read_file(&self, py: Python<'_>, seq_id: i64, path: PathBuf) -> PyResult<Vec<i32>> {
        let seq_id = clamp_i32(seq_id);
        self.check_open()?;
        let data = detached_io(py, move || std::fs::read(&path))?;
        run(py, self.ctx(), move |s| s.kv_load(seq_id, &data))
    }

    fn __repr__(&self) -> String {
        let closed = self.closed();
        let s = self.inner.shape();
        format!(
            "Context(n_ctx={}, n_batch={}, n_seq_max={}, closed={})",
            s.n_ctx, s.n_batch, s.n_seq_max, closed
        )
    }

    /// Create a context from a model path (``Context(path, **options)``).
    #[classmethod]
    #[pyo3(signature = (path, **options))]
    fn from_path<'py>(
        cls: &Bound<'py, PyType>,
        path: PathBuf,
        options: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        cls.call((path,), options)
    }
}

/// Validate Python ints as token ids.
pub(crate) fn to_i32(model: &lloyal_core::Model, tokens: &[i64]) -> PyResult<Vec<i32>> {
    tokens.iter().map(|&t| model.check_token(t)).collect::<Result<Vec<_>, _>>().py()
}
