//! `Context`'s flat path: decode, sample and logits without branches, and embeddings.

use crate::convert::{clamp_i32, readonly_f32};
use crate::detach::{run, run_decoding};
use crate::embeddings::{extract_texts, to_array};
use crate::error::IntoPyResult;
use crate::grammar::PyGrammar;
use crate::metrics::PyPerplexityTracker;
use crate::sampling::extract_params;
use lloyal_core::{Base, Pooling};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{to_i32, PyContext};
use crate::convert::{TokenId, Tokens};

#[pymethods]
impl PyContext {
    // ----- flat decode path -----

    /// Decode ``tokens`` on ``seq_id`` starting at ``pos`` (chunked by n_batch; all-or-nothing).
    #[pyo3(signature = (tokens, pos, seq_id=0))]
    fn decode(&self, py: Python<'_>, tokens: Tokens, pos: i64, seq_id: i64) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        let pos = clamp_i32(pos);
        let tokens = to_i32(self.inner.model(), &tokens)?;
        run_decoding(py, &self.inner, move |s| s.decode(&tokens, pos, seq_id))
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
    fn clear_and_reseed(&self, py: Python<'_>, sinks: Tokens, tail: Tokens) -> PyResult<i32> {
        let sinks = to_i32(self.inner.model(), &sinks)?;
        let tail = to_i32(self.inner.model(), &tail)?;
        run_decoding(py, &self.inner, move |s| s.clear_and_reseed(&sinks, &tail))
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
    fn model_surprisal(&self, py: Python<'_>, token: TokenId, base: &str) -> PyResult<f64> {
        let base = Base::parse(base).py()?;
        let t = self.inner.model().check_token(*token).py()?;
        run(py, self.ctx(), move |s| s.model_surprisal(t, base))
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
    fn encode(&self, py: Python<'_>, tokens: Tokens, seq_id: i64) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        let tokens = to_i32(self.inner.model(), &tokens)?;
        run_decoding(py, &self.inner, move |s| s.encode(&tokens, seq_id))
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
        let encoded = run_decoding(py, &self.inner, move |s| s.embed(&texts, normalize))?;
        to_array(py, encoded, single)
    }
}
