//! `lloyal.Context`: one llama.cpp context, its options and its engine's knobs; the
//! tokenizer and chat templates in `text.rs`, the flat decode path, sampling and embeddings
//! in `flat.rs`, raw KV operations and files in `kv.rs`.

mod flat;
mod kv;
mod text;

use std::path::PathBuf;
use std::sync::Arc;

use lloyal_core::{Context, ContextOptions, ModelOptions, Pooling};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

use crate::convert::narrow;
use crate::detach::{detached, run, without_gil};
use crate::engine::PyEngineStats;
use crate::error::IntoPyResult;
use crate::model::PyModel;

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
/// ``sampling_perplexity=False``: branches do not keep ``Branch.sampling_perplexity`` (reading
/// it raises). That sum over the vocabulary at ``1 / temperature`` is a second exponential a
/// value in every decoded row's summary, so a context that never reads it, like the OpenAI
/// server's, turns it off. Tokens and ``perplexity`` are the same either way.
///
/// ``pooling`` (for ``embeddings=True``): ``None`` pools the way the model's GGUF declares
/// (``<arch>.pooling_type``, e.g. the last token for Qwen3-Embedding), else by mean.
///
/// ``lora``: LoRA adapters applied to every token the context decodes, fixed for its life
/// (every KV cell is computed under the same weights): a list of :class:`LoraAdapter`
/// (``model.load_lora(path)``), paths (loaded for the model), or ``(adapter or path, scale)``
/// pairs; the scale is 1.0 when not given. Other contexts of the same model are unaffected.
/// Adapters are float matrices, so a context with them is not batch-invariant.
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

    pub(crate) fn check_open(&self) -> PyResult<()> {
        self.inner.check_open().py()
    }
}

#[pymethods]
impl PyContext {
    #[new]
    #[pyo3(signature = (model, *, n_ctx=2048, n_batch=512, n_seq_max=1, n_threads=None,
                        embeddings=false, pooling=None, type_k=None, type_v="f16", flash_attn=true,
                        batch_invariant=None, sampling_perplexity=true, lora=None))]
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
        sampling_perplexity: bool,
        lora: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut options = ContextOptions {
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
            sampling_perplexity,
            lora: Vec::new(),
        };
        options.validate().py()?;
        let model: Py<PyModel> = match model.cast::<PyModel>() {
            Ok(m) => m.clone().unbind(),
            Err(_) => {
                let path: PathBuf = model.extract()?;
                let inner = PyModel::load(py, path, ModelOptions::for_context(batch_invariant).py()?)?;
                Py::new(py, PyModel { inner })?
            }
        };
        let core_model = model.get().inner.clone();
        options.lora = crate::lora::lora_uses(py, &core_model, lora)?;
        let inner = detached(py, move || Context::new(core_model, options))?;
        Ok(PyContext { inner, model })
    }

    /// The :class:`Model` this context runs.
    #[getter]
    fn model(&self, py: Python<'_>) -> Py<PyModel> {
        self.model.clone_ref(py)
    }

    /// The LoRA adapters applied to every decode, as ``(adapter, scale)`` pairs (fixed at
    /// creation; empty without ``lora=``).
    #[getter]
    fn lora(&self) -> Vec<(crate::lora::PyLoraAdapter, f32)> {
        let wrap = |l: &lloyal_core::lora::LoraUse| crate::lora::PyLoraAdapter { inner: l.adapter.clone() };
        self.inner.options().lora.iter().map(|l| (wrap(l), l.scale)).collect()
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

    /// Whether branches keep their sampling perplexity (see ``Context``).
    #[getter]
    fn sampling_perplexity(&self) -> bool {
        self.inner.options().sampling_perplexity
    }

    /// Bytes of llama.cpp's logits buffer (its rows for every sequence, read in place by each
    /// decode's summary) on 2 MiB pages (Linux, a model on the CPU): put there as the context is
    /// made, and again after a decode that moves the buffer (more output rows than sequences: its
    /// first ``n_seq_max`` rows). 0 where THP is ``never``, on kernels before 6.1, or with the
    /// model's output layer on a GPU.
    #[getter]
    fn huge_page_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        run(py, self.ctx(), |s| Ok(s.huge_logit_bytes()))
    }

    /// Whether decodes summarise each logits row (maximum, log-sum-exps, span maxima) on the
    /// device that holds the model's output layer instead of on the host: only with
    /// ``LLOYAL_DEVICE_ROWS=1`` (not yet shown faster on a GPU, docs/performance.md), never for a
    /// batch-invariant or embeddings context. Same tokens for a seed either way; perplexities agree
    /// to about 1e-6 relative.
    #[getter]
    fn device_rows(&self, py: Python<'_>) -> PyResult<bool> {
        run(py, self.ctx(), |s| Ok(s.device_rows()))
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
        PyEngineStats(self.inner.engine_stats())
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

    /// Tests only: ``False`` stops room checks counting the cells of sequences no branch
    /// holds, so a decode can meet llama.cpp's own refusal of a full cache.
    #[setter(_count_flat_cells)]
    fn set_count_flat_cells(&self, on: bool) {
        self.inner.count_flat_cells(on);
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
