//! `lloyal.Branch`: a handle to one branch of a context (KV sequence + sampler + metrics).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lloyal_core::engine::gen::{Finish, GenItem, GenSpec, GenStream, Next};
use lloyal_core::{Base, Context, ContextState, Handle, Ticket, Work};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple, PyType};

use crate::aio;
use crate::context::{to_i32, PyContext};
use crate::convert::{clamp_i32, narrow};
use crate::detach::{on_main_thread, run};
use crate::engine;
use crate::error::IntoPyResult;
use crate::grammar::PyGrammar;
use crate::lease;
use crate::sampling::{extract_params, extract_params_onto};
use crate::waker::wake_for;

/// A sampled-but-not-written token.
#[pyclass(name = "Produced", module = "lloyal._lloyal", frozen, get_all, eq)]
#[derive(Clone, PartialEq)]
pub struct PyProduced {
    /// Token id.
    pub token: i32,
    /// The token's text (may be a partial UTF-8 character).
    pub text: String,
    /// Whether the token ends generation.
    pub is_stop: bool,
}

#[pymethods]
impl PyProduced {
    fn __repr__(&self) -> String {
        format!("Produced(token={}, text={:?}, is_stop={})", self.token, self.text, self.is_stop)
    }
}

/// A generated (committed) token with its UTF-8-safe text.
#[pyclass(name = "Token", module = "lloyal._lloyal", frozen, get_all, eq)]
#[derive(Clone, PartialEq)]
pub struct PyToken {
    /// Token id.
    pub token: i32,
    /// The text it completes (UTF-8 safe: may be empty mid-character or while it may begin
    /// a stop string; a matched stop string is never included).
    pub text: String,
    /// ``log_softmax(logits)[token]`` of the logits it was sampled from (``Branch.logits``),
    /// when ``generate(logprobs=True)``; else None.
    pub logprob: Option<f64>,
    /// The ``top_logprobs`` most likely ``(token, logprob)`` pairs, best first, when asked;
    /// else None.
    pub top_logprobs: Option<Vec<(i32, f64)>>,
}

#[pymethods]
impl PyToken {
    fn __repr__(&self) -> String {
        match self.logprob {
            Some(lp) => format!("Token(token={}, text={:?}, logprob={lp:.4})", self.token, self.text),
            None => format!("Token(token={}, text={:?})", self.token, self.text),
        }
    }
}

/// A leased KV sequence with its own sampler, logits snapshot, metrics and tree links.
///
/// Example:
///     >>> with Context(default_model_path(), n_seq_max=4) as ctx:
///     ...     root = Branch.create(ctx, 0, SamplingParams(temperature=0))
///     ...     root.prefill(ctx.tokenize("Hello"))
///     ...     child = root.fork()
///     ...     child.commit(child.produce().token)
#[pyclass(name = "Branch", module = "lloyal._lloyal", frozen)]
pub struct PyBranch {
    pub(crate) ctx: Py<PyContext>,
    pub(crate) handle: Handle,
}

impl PyBranch {
    pub(crate) fn core(&self) -> &Arc<Context> {
        &self.ctx.get().inner
    }

    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut ContextState, Handle) -> lloyal_core::Result<T> + Send,
    ) -> PyResult<T> {
        let h = self.handle;
        run(py, self.core(), move |s| f(s, h))
    }

    fn wrap(&self, py: Python<'_>, handle: Handle) -> PyBranch {
        PyBranch { ctx: self.ctx.clone_ref(py), handle }
    }

    pub(crate) fn produced(ctx: &Context, token: i32) -> PyProduced {
        let model = ctx.model();
        let bytes = model.token_bytes(token, false).unwrap_or_default();
        PyProduced { token, text: String::from_utf8_lossy(&bytes).into_owned(), is_stop: model.is_eog(token) }
    }
}

/// A grammar from GBNF text (start rule ``root``) or a copy of a `Grammar` handle's state.
fn grammar_arg(
    py: Python<'_>,
    model: Arc<lloyal_core::Model>,
    grammar: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<lloyal_core::Grammar>> {
    let Some(g) = grammar.filter(|g| !g.is_none()) else { return Ok(None) };
    if let Ok(handle) = g.cast::<PyGrammar>() {
        return Ok(Some(handle.get().lock().try_clone().py()?));
    }
    let gbnf: String = g.extract().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err("grammar must be GBNF text (str), a Grammar, or None")
    })?;
    Ok(Some(PyGrammar::parse(py, model, gbnf, "root".into(), Default::default())?))
}

/// Token ids (range-checked) and biases from a `{token: bias}` dict.
fn bias_list(model: &lloyal_core::Model, bias: &Bound<'_, PyDict>) -> PyResult<Vec<(i32, f32)>> {
    let map: HashMap<i64, f32> = bias.extract()?;
    let mut v: Vec<(i32, f32)> = map
        .into_iter()
        .map(|(t, b)| Ok((model.check_token(t)?, b)))
        .collect::<lloyal_core::Result<_>>()
        .py()?;
    v.sort_by_key(|x| x.0);
    Ok(v)
}

#[pymethods]
impl PyBranch {
    /// Create a root branch on ``ctx`` at ``position`` (takes a lease; its sequence starts empty).
    ///
    /// ``grammar`` (GBNF text with a ``root`` rule, or a :class:`Grammar` whose state is
    /// copied) constrains every sampled token; forks inherit a copy of its state. Sequence ids
    /// holding flat-path cells (``Context.decode``) are skipped, never wiped.
    ///
    /// ``timeout`` (seconds) waits for a lease when none is free: 0 (the default) does not
    /// wait, None waits as long as it takes. Waiting calls are served first come, first
    /// served by the context's engine, with the GIL released (Ctrl-C gives up).
    ///
    /// Raises:
    ///     LeaseExhaustedError: every sequence id of the context is leased or holds flat-path
    ///         cells (and stayed so for ``timeout`` seconds).
    ///     ValueError: a negative ``timeout``.
    #[classmethod]
    #[pyo3(
        signature = (ctx, position=0, params=None, *, grammar=None, timeout=Some(0.0)),
        text_signature = "($cls, ctx, position=0, params=None, *, grammar=None, timeout=0.0)"
    )]
    fn create(
        _cls: &Bound<'_, PyType>,
        py: Python<'_>,
        ctx: Py<PyContext>,
        position: i64,
        params: Option<&Bound<'_, PyAny>>,
        grammar: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<PyBranch> {
        let timeout = lease::check_timeout(timeout)?;
        let params = extract_params(params, None)?;
        let core = ctx.get().inner.clone();
        core.check_open().py()?;
        let grammar = grammar_arg(py, core.model().clone(), grammar)?;
        let position = clamp_i32(position);
        let make = move |s: &mut ContextState| {
            let h = s.branch_create(position, params)?;
            if grammar.is_some() {
                s.branch_set_grammar(h, grammar)?;
            }
            Ok(h)
        };
        let handle = if timeout == Some(0.0) {
            run(py, &core, make)?
        } else {
            lease::wait(py, &core, None, timeout, Box::new(make))?
        };
        Ok(PyBranch { ctx, handle })
    }

    /// The branch as bytes: KV cells, position, sampler (parameters, history, RNG), grammar,
    /// metrics, biases and logits; ``Branch.load_state`` resumes it in any process.
    fn save_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.call(py, |s, h| s.branch_save(h))?;
        Ok(PyBytes::new(py, &data))
    }

    /// A new root branch on ``ctx`` from ``Branch.save_state()`` bytes (takes a lease).
    /// Corrupt, truncated or foreign data raises ``StateError`` and changes nothing.
    #[staticmethod]
    fn load_state(py: Python<'_>, ctx: Py<PyContext>, data: Vec<u8>) -> PyResult<PyBranch> {
        let core = ctx.get().inner.clone();
        let handle = run(py, &core, move |s| s.branch_load(&data))?;
        Ok(PyBranch { ctx, handle })
    }

    /// Constrain sampling with a grammar (GBNF text or a :class:`Grammar`, whose state is
    /// copied), or remove it with ``None``. Forks inherit a copy.
    #[pyo3(signature = (grammar))]
    fn set_grammar(&self, py: Python<'_>, grammar: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        self.core().check_open().py()?;
        let grammar = grammar_arg(py, self.core().model().clone(), grammar)?;
        self.call(py, move |s, h| s.branch_set_grammar(h, grammar))
    }

    /// Sampled tokens a GBNF grammar rejected so far (each cost a full vocabulary mask); always 0
    /// under llguidance grammars, which mask before sampling.
    #[getter]
    fn grammar_resamples(&self, py: Python<'_>) -> PyResult<u64> {
        self.call(py, |s, h| s.branch_grammar_resamples(h))
    }

    /// A child sharing this branch's KV prefix (no tensor copy); sampler, metrics, logit bias
    /// and (if ``clone_logits``) logits are cloned. Takes a lease.
    ///
    /// ``at`` (``1 <= at <= position``) shares only the first ``at`` positions: the child
    /// starts at position ``at`` with no logits (prefill before sampling), no grammar and fresh
    /// metrics; its sampler, penalty history and logit bias are cloned. A prefix cache uses it
    /// to reuse the common part of a cached sequence.
    ///
    /// ``timeout`` (seconds) waits for a lease when none is free: 0 (the default) does not
    /// wait, None waits as long as it takes; waiting forks and creates are served first come,
    /// first served (a fork also waits for this branch's prefill in flight).
    ///
    /// Raises:
    ///     LeaseExhaustedError: no lease is free (within ``timeout``).
    #[pyo3(
        signature = (clone_logits=true, *, at=None, timeout=Some(0.0)),
        text_signature = "($self, clone_logits=True, *, at=None, timeout=0.0)"
    )]
    fn fork(
        &self,
        py: Python<'_>,
        clone_logits: bool,
        at: Option<i32>,
        timeout: Option<f64>,
    ) -> PyResult<PyBranch> {
        let timeout = lease::check_timeout(timeout)?;
        let child = if timeout == Some(0.0) {
            self.call(py, move |s, h| s.branch_fork_at(h, clone_logits, at))?
        } else {
            self.core().check_open().py()?;
            let h = self.handle;
            let make = Box::new(move |s: &mut ContextState| s.branch_fork_at(h, clone_logits, at));
            lease::wait(py, self.core(), Some(h), timeout, make)?
        };
        Ok(self.wrap(py, child))
    }

    /// Await ``fork(clone_logits, timeout=timeout)`` without blocking the event loop; a
    /// waiting fork is an engine request (cancelling the task withdraws it).
    #[pyo3(
        signature = (clone_logits=true, *, timeout=Some(0.0)),
        text_signature = "($self, clone_logits=True, *, timeout=0.0)"
    )]
    fn afork<'py>(
        slf: &Bound<'py, Self>,
        clone_logits: bool,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let timeout = lease::check_timeout(timeout)?;
        if timeout == Some(0.0) {
            let arg = clone_logits.into_pyobject(py)?.to_owned().into_any();
            return aio::in_thread(py, slf.getattr("fork")?, vec![arg]);
        }
        let args = vec![
            clone_logits.into_pyobject(py)?.to_owned().into_any(),
            timeout.into_pyobject(py)?.into_any(),
        ];
        aio::lease_call(py, slf.getattr("_submit_fork_lease")?, args)
    }

    fn _submit_fork_lease<'py>(
        &self,
        py: Python<'py>,
        lp: Bound<'py, PyAny>,
        fut: Bound<'py, PyAny>,
        clone_logits: bool,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        self.core().check_open().py()?;
        let h = self.handle;
        let make = Box::new(move |s: &mut ContextState| s.branch_fork_at(h, clone_logits, None));
        lease::submit_async(py, &self.ctx, Some(h), timeout, make, lp, fut)
    }

    /// Await ``prune()`` off the event loop.
    fn aprune<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        aio::in_thread(slf.py(), slf.getattr("prune")?, vec![])
    }

    /// Await ``prune_subtree()`` off the event loop.
    fn aprune_subtree<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        aio::in_thread(slf.py(), slf.getattr("prune_subtree")?, vec![])
    }

    /// Dispose this branch (RESTRICT: ``TopologyError`` while children live). Idempotent.
    fn prune(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |s, h| s.branch_prune(h))
    }

    /// Dispose this branch and every descendant (CASCADE). Idempotent.
    fn prune_subtree(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |s, h| s.branch_prune_subtree(h))
    }

    /// Sample the next token without writing anything (idempotent until state changes).
    fn produce(&self, py: Python<'_>) -> PyResult<PyProduced> {
        let token = self.call(py, |s, h| s.branch_produce(h))?;
        Ok(Self::produced(self.core(), token))
    }

    /// The token ``produce()`` would return.
    fn sample(&self, py: Python<'_>) -> PyResult<i32> {
        self.call(py, |s, h| s.branch_produce(h))
    }

    /// Record ``token`` in the sampler history, grammar and metrics without decoding it.
    fn accept(&self, py: Python<'_>, token: i64) -> PyResult<()> {
        let token = self.core().model().check_token(token).py()?;
        self.call(py, move |s, h| s.branch_accept(h, token))
    }

    /// Accept ``token``, decode it, and capture the new logits; on failure nothing changes.
    ///
    /// Runs on the context's engine: commits and prefills that other threads or tasks
    /// submit meanwhile share its ``llama_decode``.
    fn commit(&self, py: Python<'_>, token: i64) -> PyResult<()> {
        let token = self.core().model().check_token(token).py()?;
        engine::wait(py, self.core(), Work::Commit(vec![(self.handle, token)]))
    }

    /// Speculative check of ``draft_tokens`` in one decode; returns how many were accepted.
    ///
    /// Keeps the longest prefix of the drafts that this branch's sampler agrees with, removes
    /// the rejected drafts' cells, and commits the sampler's own next token (the bonus, see
    /// ``last_token``). Greedy output equals plain greedy decoding.
    fn verify(&self, py: Python<'_>, draft_tokens: Vec<i64>) -> PyResult<usize> {
        let drafts = to_i32(self.core().model(), &draft_tokens)?;
        Ok(self.call(py, move |s, h| s.branch_verify(h, &drafts))?.accepted)
    }

    /// The most recently accepted token (``None`` before any).
    #[getter]
    fn last_token(&self, py: Python<'_>) -> PyResult<Option<i32>> {
        self.call(py, |s, h| s.branch_last_token(h))
    }

    /// Write ``tokens`` to this branch's KV (not accepted into penalties/perplexity).
    ///
    /// Runs on the context's engine in chunks of at most ``n_batch`` tokens per tick, each
    /// sharing its ``llama_decode`` with other callers' commits.
    fn prefill(&self, py: Python<'_>, tokens: Vec<i64>) -> PyResult<()> {
        let tokens = to_i32(self.core().model(), &tokens)?;
        engine::wait(py, self.core(), Work::Prefill(vec![(self.handle, tokens)]))
    }

    /// Await ``prefill(tokens)``: queued on the context's engine, the event loop keeps running.
    fn aprefill<'py>(slf: &Bound<'py, Self>, tokens: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        aio::engine_call(slf.py(), slf.getattr("_submit_prefill")?, vec![tokens])
    }

    /// Await ``commit(token)``: queued on the context's engine, the event loop keeps running.
    fn acommit<'py>(slf: &Bound<'py, Self>, token: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        aio::engine_call(slf.py(), slf.getattr("_submit_commit")?, vec![token])
    }

    fn _submit_commit<'py>(
        &self,
        py: Python<'py>,
        lp: Bound<'py, PyAny>,
        fut: Bound<'py, PyAny>,
        token: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let token = self.core().model().check_token(token).py()?;
        engine::submit_async(py, self.core(), Work::Commit(vec![(self.handle, token)]), lp, fut)
    }

    fn _submit_prefill<'py>(
        &self,
        py: Python<'py>,
        lp: Bound<'py, PyAny>,
        fut: Bound<'py, PyAny>,
        tokens: Vec<i64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tokens = to_i32(self.core().model(), &tokens)?;
        engine::submit_async(py, self.core(), Work::Prefill(vec![(self.handle, tokens)]), lp, fut)
    }

    /// BlinkKV: replace this branch's sequence with ``sinks + tail``; returns the new position.
    ///
    /// The tokens go to positions ``0..len(sinks) + len(tail)``; sampler history and metrics are
    /// kept. Needs ``len(sinks) + len(tail)`` free cells once this branch's own cells are freed
    /// (``KvCacheFullError`` up front otherwise, nothing changed), so it works on a full
    /// cache. When a lease and enough cells are free to keep the old cells until the new
    /// ones are written, a failed decode restores the branch; otherwise it leaves the
    /// branch empty at position 0.
    ///
    /// Example:
    ///     >>> branch.reseed(tokens[:4], tokens[-8:])  # sinks + recent tail
    ///     12
    fn reseed(&self, py: Python<'_>, sinks: Vec<i64>, tail: Vec<i64>) -> PyResult<i32> {
        let model = self.core().model();
        let (sinks, tail) = (to_i32(model, &sinks)?, to_i32(model, &tail)?);
        self.call(py, move |s, h| s.branch_reseed(h, &sinks, &tail))
    }

    /// Restart the sampler's RNG with ``seed`` (history kept).
    fn reseed_sampler(&self, py: Python<'_>, seed: i64) -> PyResult<()> {
        let seed: u32 = narrow("seed", seed, "in 0..=4294967295")?;
        self.call(py, move |s, h| s.branch_reseed_sampler(h, seed))
    }

    /// Replace the sampling parameters (penalty history and RNG kept).
    ///
    /// A ``SamplingParams`` replaces all of them (keyword overrides then apply on top);
    /// keyword overrides alone change only those fields of the current parameters. Nothing
    /// is rebuilt when the parameters are unchanged.
    ///
    /// Example:
    ///     >>> branch.set_sampler_params(temperature=0.2)  # top_k, top_p... unchanged
    #[pyo3(signature = (params=None, **overrides))]
    fn set_sampler_params(
        &self,
        py: Python<'_>,
        params: Option<&Bound<'_, PyAny>>,
        overrides: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let params = match params.filter(|p| !p.is_none()) {
            Some(p) => extract_params(Some(p), overrides)?,
            None => extract_params_onto(self.call(py, |s, h| s.branch_params(h))?, None, overrides)?,
        };
        self.call(py, move |s, h| s.branch_set_params(h, params))
    }

    /// Replace the whole sampling setup in one call (one wait for the context while the
    /// engine is busy, instead of one per setter): the parameters, the logit bias (None: no
    /// bias) and the grammar (GBNF text or a :class:`Grammar`; None: none); ``seed`` restarts
    /// the RNG (None: kept). Everything is checked first: on an error nothing changes.
    ///
    /// Example:
    ///     >>> branch.set_sampling(SamplingParams(temperature=0.0), seed=7, logit_bias={})
    #[pyo3(signature = (params, *, seed=None, logit_bias=None, grammar=None))]
    fn set_sampling(
        &self,
        py: Python<'_>,
        params: &Bound<'_, PyAny>,
        seed: Option<i64>,
        logit_bias: Option<&Bound<'_, PyDict>>,
        grammar: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.core().check_open().py()?;
        let params = extract_params(Some(params), None)?;
        let seed: Option<u32> = seed.map(|s| narrow("seed", s, "in 0..=4294967295")).transpose()?;
        let bias = match logit_bias {
            Some(b) => bias_list(self.core().model(), b)?,
            None => Vec::new(),
        };
        let grammar = grammar_arg(py, self.core().model().clone(), grammar)?;
        self.call(py, move |s, h| {
            // Every argument is checked above: these fail only on a disposed branch, at the first.
            s.branch_set_grammar(h, grammar)?;
            s.branch_set_params(h, params)?;
            if let Some(seed) = seed {
                s.branch_reseed_sampler(h, seed)?;
            }
            s.branch_set_logit_bias(h, bias)
        })
    }

    /// Set ``{token: bias}`` added to the logits before sampling; inherited by forks; ``-inf`` bans.
    fn set_logit_bias(&self, py: Python<'_>, bias: &Bound<'_, PyDict>) -> PyResult<()> {
        let bias = bias_list(self.core().model(), bias)?;
        self.call(py, move |s, h| s.branch_set_logit_bias(h, bias))
    }

    /// Set per-branch steering ``{token: bias}`` (not inherited by forks).
    fn steer(&self, py: Python<'_>, bias: &Bound<'_, PyDict>) -> PyResult<()> {
        let bias = bias_list(self.core().model(), bias)?;
        self.call(py, move |s, h| s.branch_steer(h, bias))
    }

    /// Remove steering.
    fn clear_steer(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |s, h| s.branch_steer(h, Vec::new()))
    }

    /// A float32 copy of the current logits, shape ``(n_vocab,)``.
    #[getter]
    fn logits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let v = self.call(py, |s, h| Ok(s.branch(h)?.logits()?.to_vec()))?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// Replace the logits snapshot (shape ``(n_vocab,)``).
    fn set_logits(&self, py: Python<'_>, logits: PyReadonlyArray1<'_, f32>) -> PyResult<()> {
        let v = logits.as_array().to_vec();
        self.call(py, move |s, h| s.branch_set_logits(h, v))
    }

    /// Entropy of the next-token distribution in ``"nats"`` or ``"bits"``.
    #[pyo3(signature = (base="nats"))]
    fn model_entropy(&self, py: Python<'_>, base: &str) -> PyResult<f64> {
        let base = Base::parse(base).py()?;
        self.call(py, move |s, h| s.branch_entropy(h, base))
    }

    /// Surprisal of ``token`` under the current logits.
    #[pyo3(signature = (token, base="nats"))]
    fn model_surprisal(&self, py: Python<'_>, token: i64, base: &str) -> PyResult<f64> {
        let base = Base::parse(base).py()?;
        let token = self.core().model().check_token(token).py()?;
        self.call(py, move |s, h| s.branch_surprisal(h, token, base))
    }

    /// Generate until a stop (not yielded) or ``max_tokens``, committing each token before
    /// yielding it. The engine samples and commits in Rust, batched with every other
    /// generation and commit on the context; one token per ``next()`` (``lookahead=k``: up to
    /// ``k`` tokens ahead of the reader).
    ///
    /// Args:
    ///     max_tokens: Most tokens to yield (None: until a stop).
    ///     prompt: Tokens the engine prefills first, as part of the request (chunked with
    ///         the other requests' steps); None: the branch's prompt is already written.
    ///     stop: Strings that end generation; matched on the detokenized text across token
    ///         boundaries and never yielded (text that may begin one is held back).
    ///     stop_tokens: Token ids that end generation (not committed), besides the model's
    ///         end-of-generation tokens.
    ///     logprobs: Give each Token its ``logprob``.
    ///     top_logprobs: Give each Token its ``top_logprobs`` most likely tokens (0 to 20).
    ///     timeout: Seconds the request may wait (FIFO) for room in the KV cache for its
    ///         ``max_tokens`` before failing; None waits as long as it takes.
    ///     lookahead: Tokens the engine may generate before they are read (1: each one when
    ///         asked for). With ``k > 1`` the next token decodes while the reader handles this
    ///         one, and a reader that stops early leaves the branch up to ``k - 1`` tokens past
    ///         the last it read.
    ///     reserve: Hold ``max_tokens`` KV cells for the request from its start (it waits for
    ///         them). False: it starts when one cell is free and takes one per token, and a
    ///         token that finds the cache full raises ``KvCacheFullError`` at its ``next()``
    ///         (the tokens before it were yielded).
    ///
    /// Raises:
    ///     InvalidTokenError: A stop or prompt token is out of the vocabulary.
    ///     KvCacheFullError: At the first ``next()``: ``max_tokens`` can never fit next to the
    ///         branch's cells, or no room came within ``timeout``; later, with
    ///         ``reserve=False``, when the cache filled up.
    ///     ValueError: An empty stop string, ``top_logprobs`` out of range or another iterator
    ///         of this branch still generating (at the first ``next()``), a negative
    ///         ``timeout`` or a ``lookahead`` below 1.
    #[pyo3(signature = (max_tokens=None, *, prompt=None, stop=None, stop_tokens=None, logprobs=false, top_logprobs=0, timeout=None, lookahead=1, reserve=true))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        max_tokens: Option<usize>,
        prompt: Option<Vec<i64>>,
        stop: Option<Vec<String>>,
        stop_tokens: Option<Vec<i64>>,
        logprobs: bool,
        top_logprobs: usize,
        timeout: Option<f64>,
        lookahead: usize,
        reserve: bool,
    ) -> PyResult<PyTokenIter> {
        if lookahead == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "lookahead must be at least 1 (1: generate each token when it is asked for)",
            ));
        }
        let model = self.core().model();
        let prompt = to_i32(model, &prompt.unwrap_or_default())?;
        let stop_tokens = stop_tokens.unwrap_or_default();
        let stop_tokens: Vec<i32> =
            stop_tokens.iter().map(|&t| model.check_token(t)).collect::<lloyal_core::Result<_>>().py()?;
        let timeout = match timeout {
            Some(t) if !(t >= 0.0 && t.is_finite()) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout must be a finite number of seconds >= 0 or None, got {t}"
                )))
            }
            t => t.map(Duration::from_secs_f64),
        };
        let args = GenArgs {
            max_tokens,
            prompt,
            stop: stop.unwrap_or_default(),
            stop_tokens,
            logprobs,
            top_logprobs,
            timeout,
            lookahead,
            reserve,
        };
        Ok(PyTokenIter::new(self.wrap(py, self.handle), args))
    }

    fn __iter__(&self, py: Python<'_>) -> PyTokenIter {
        PyTokenIter::new(self.wrap(py, self.handle), GenArgs::default())
    }

    fn __aiter__(&self, py: Python<'_>) -> PyTokenIter {
        PyTokenIter::new(self.wrap(py, self.handle), GenArgs::default())
    }

    /// Next position to write.
    #[getter]
    fn position(&self, py: Python<'_>) -> PyResult<i32> {
        self.call(py, |s, h| Ok(s.branch(h)?.position))
    }

    /// Position where this branch diverged from its parent.
    #[getter]
    fn fork_head(&self, py: Python<'_>) -> PyResult<i32> {
        self.call(py, |s, h| Ok(s.branch(h)?.fork_head))
    }

    /// Model perplexity ``exp(mean surprisal)`` of accepted tokens; ``inf`` before any.
    #[getter]
    fn perplexity(&self, py: Python<'_>) -> PyResult<f64> {
        self.call(py, |s, h| Ok(s.branch(h)?.perplexity()))
    }

    /// Perplexity under the sampling distribution (penalties, biases, temperature).
    #[getter]
    fn sampling_perplexity(&self, py: Python<'_>) -> PyResult<f64> {
        self.call(py, |s, h| Ok(s.branch(h)?.sampling_perplexity()))
    }

    /// The parent branch, or None for a root.
    #[getter]
    fn parent(&self, py: Python<'_>) -> PyResult<Option<PyBranch>> {
        let p = self.call(py, |s, h| Ok(s.branch_info(h)?.parent))?;
        Ok(p.map(|p| self.wrap(py, p)))
    }

    /// Live children in fork order.
    #[getter]
    fn children(&self, py: Python<'_>) -> PyResult<Vec<PyBranch>> {
        let c = self.call(py, |s, h| Ok(s.branch_info(h)?.children))?;
        Ok(c.into_iter().map(|c| self.wrap(py, c)).collect())
    }

    /// Whether the branch has no live children.
    #[getter]
    fn is_leaf(&self, py: Python<'_>) -> PyResult<bool> {
        self.call(py, |s, h| Ok(s.branch_info(h)?.children.is_empty()))
    }

    /// Whether the branch is live (holds a lease).
    #[getter]
    fn is_active(&self, py: Python<'_>) -> bool {
        self.call(py, |s, h| Ok(s.is_live(h))).unwrap_or(false)
    }

    /// Whether the branch was pruned, retained away, or its context closed.
    #[getter]
    fn disposed(&self, py: Python<'_>) -> bool {
        !self.is_active(py)
    }

    /// Stable identity; never reused for another branch.
    #[getter]
    fn handle(&self) -> Handle {
        self.handle
    }

    /// The leased sequence id (read-only; for interop with the flat path).
    #[getter]
    fn seq_id(&self, py: Python<'_>) -> PyResult<i32> {
        self.call(py, |s, h| Ok(s.branch(h)?.seq_id))
    }

    /// The context this branch lives in.
    #[getter]
    fn context(&self, py: Python<'_>) -> Py<PyContext> {
        self.ctx.clone_ref(py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        if self.core().is_closed() {
            return Ok(false);
        }
        self.prune_subtree(py)?;
        Ok(false)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyBranch>().is_ok_and(|o| {
            let o = o.get();
            o.handle == self.handle && Arc::ptr_eq(o.core(), self.core())
        })
    }

    fn __hash__(&self) -> u64 {
        self.handle ^ (Arc::as_ptr(self.core()) as u64).rotate_left(17)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match self.call(py, |s, h| s.branch_info(h)) {
            Ok(i) => format!(
                "Branch(handle={}, seq_id={}, position={}, perplexity={:.3})",
                self.handle, i.seq_id, i.position, i.perplexity
            ),
            Err(_) => format!("Branch(handle={}, disposed)", self.handle),
        }
    }
}

/// Iterator behind ``for tok in branch``, ``branch.generate()`` and ``async for``: a
/// generation request the engine runs in Rust (sampling, stops, logprobs), one token each
/// time the iterator is asked for one.
#[pyclass(name = "TokenIterator", module = "lloyal._lloyal", frozen)]
pub struct PyTokenIter {
    branch: PyBranch,
    args: GenArgs,
    state: Mutex<IterState>,
}

/// What `generate()` was called with.
#[derive(Clone)]
struct GenArgs {
    max_tokens: Option<usize>,
    prompt: Vec<i32>,
    stop: Vec<String>,
    stop_tokens: Vec<i32>,
    logprobs: bool,
    top_logprobs: usize,
    timeout: Option<Duration>,
    lookahead: usize,
    reserve: bool,
}

impl Default for GenArgs {
    fn default() -> Self {
        GenArgs {
            max_tokens: None,
            prompt: Vec::new(),
            stop: Vec::new(),
            stop_tokens: Vec::new(),
            logprobs: false,
            top_logprobs: 0,
            timeout: None,
            lookahead: 1,
            reserve: true,
        }
    }
}

#[derive(Default)]
struct IterState {
    stream: Option<Arc<GenStream>>,
    ticket: Option<Ticket>,
    finish: Option<&'static str>,
    done: bool,
}

impl PyTokenIter {
    fn new(branch: PyBranch, args: GenArgs) -> Self {
        PyTokenIter { branch, args, state: Mutex::new(IterState::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, IterState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The request's stream (queued on first use), or `None` once the iterator is done.
    fn stream(&self) -> PyResult<Option<Arc<GenStream>>> {
        let mut st = self.lock();
        if st.done {
            return Ok(None);
        }
        if let Some(s) = &st.stream {
            return Ok(Some(Arc::clone(s)));
        }
        if self.args.max_tokens == Some(0) && self.args.prompt.is_empty() {
            st.done = true;
            st.finish = Some(Finish::Length.as_str());
            return Ok(None);
        }
        let a = &self.args;
        let stream = Arc::new(GenStream::with_lookahead(a.lookahead));
        let spec = GenSpec {
            handle: self.branch.handle,
            prompt: a.prompt.clone(),
            max_tokens: a.max_tokens,
            stop_tokens: a.stop_tokens.clone(),
            stop: a.stop.clone(),
            logprobs: a.logprobs,
            top_logprobs: a.top_logprobs,
            timeout: a.timeout,
            reserve: a.reserve,
            stream: Arc::clone(&stream),
        };
        let ticket = self.branch.core().generate(spec).py();
        let ticket = match ticket {
            Ok(t) => t,
            Err(e) => {
                st.done = true;
                return Err(e);
            }
        };
        st.ticket = Some(ticket);
        st.stream = Some(Arc::clone(&stream));
        Ok(Some(stream))
    }

    /// Record the end: `None` (stop iterating) or the request's error.
    fn end(&self, end: std::result::Result<Finish, lloyal_core::LloyalError>) -> PyResult<Option<PyToken>> {
        let mut st = self.lock();
        st.done = true;
        st.ticket = None;
        match end {
            Ok(f) => {
                st.finish = Some(f.as_str());
                Ok(None)
            }
            // Closed by the caller.
            Err(lloyal_core::LloyalError::Interrupted) => Ok(None),
            Err(e) => Err(e).py(),
        }
    }

    /// The token for a read `item`, waking the engine if the read made room in a full
    /// read-ahead buffer.
    fn taken(&self, stream: &GenStream, item: GenItem) -> PyToken {
        if stream.needs_refill() {
            self.branch.core().notify_engine();
        }
        py_token(item)
    }

    fn cancel(&self) {
        let mut st = self.lock();
        st.done = true;
        if let Some(t) = st.ticket.take() {
            t.cancel();
        }
    }
}

impl Drop for PyTokenIter {
    fn drop(&mut self) {
        self.cancel();
    }
}

fn py_token(item: GenItem) -> PyToken {
    PyToken { token: item.token, text: item.text, logprob: item.logprob, top_logprobs: item.top_logprobs }
}

#[pymethods]
impl PyTokenIter {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyToken>> {
        let Some(stream) = self.stream()? else { return Ok(None) };
        let main = on_main_thread(py);
        loop {
            match stream.poll(None) {
                Next::Item(item) => return Ok(Some(self.taken(&stream, item))),
                Next::End(end) => return self.end(end),
                Next::Pending => {}
            }
            self.branch.core().notify_engine();
            if !main {
                py.detach(|| stream.wait_timeout(Duration::from_secs(3600)));
                continue;
            }
            // On the main thread, wake every 50 ms for signal handlers: Ctrl-C frees the
            // request (the branch stays at its last committed token) and raises.
            py.detach(|| stream.wait_timeout(Duration::from_millis(50)));
            if let Err(e) = py.check_signals() {
                self.cancel();
                self.branch.core().notify_engine();
                py.detach(|| {
                    while !stream.ended() {
                        stream.wait_timeout(Duration::from_secs(1));
                    }
                });
                return Err(e);
            }
        }
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        aio::stream_next(slf.py(), slf.clone().into_any())
    }

    /// The next token now, or None after arranging for ``future`` to be settled when one
    /// arrives, through ``waker`` (the running loop's ``LoopWaker``, or the loop itself:
    /// ``call_soon_threadsafe``); raises ``StopAsyncIteration`` at the end.
    fn _poll(
        &self,
        py: Python<'_>,
        waker: Bound<'_, PyAny>,
        fut: Bound<'_, PyAny>,
    ) -> PyResult<Option<PyToken>> {
        let Some(stream) = self.stream()? else {
            return Err(pyo3::exceptions::PyStopAsyncIteration::new_err(()));
        };
        let wake = wake_for(waker, fut.unbind());
        match stream.poll(Some(wake)) {
            Next::Item(item) => Ok(Some(self.taken(&stream, item))),
            Next::End(end) => match self.end(end)? {
                Some(t) => Ok(Some(t)),
                None => Err(pyo3::exceptions::PyStopAsyncIteration::new_err(())),
            },
            Next::Pending => {
                let _ = py;
                self.branch.core().notify_engine();
                Ok(None)
            }
        }
    }

    /// Stop generating: the request is freed at the engine's next tick and the branch stays
    /// at the last token yielded. Idempotent; ``break`` and dropping the iterator do the same.
    fn close(&self) {
        self.cancel();
    }

    /// Why generation ended: ``"stop"`` (a stop token or stop string), ``"length"``
    /// (``max_tokens``) or ``"eog"`` (the model's end-of-generation token); None while
    /// running or after ``close()``.
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.lock().finish
    }
}
