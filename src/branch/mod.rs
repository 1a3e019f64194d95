//! `lloyal.Branch`: a handle to one branch of a context (KV sequence + sampler + metrics):
//! creation, forks, pruning, the tree and generation here; its sampling settings and logits
//! in `sampling.rs`; sampling, committing and prefilling tokens in `decode.rs`.

mod decode;
mod sampling;

use std::sync::Arc;

use lloyal_core::{Context, ContextState, Handle};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple, PyType};

use crate::context::PyContext;
use crate::convert::Tokens;
use crate::convert::{clamp_i32, narrow};
use crate::detach::run;
use crate::engine;
use crate::error::IntoPyResult;
use crate::generate::{GenArgs, PyTokenIter};
use crate::lease;
use crate::sampling::extract_params;
use sampling::grammar_arg;

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

    /// `create`'s arguments checked (the grammar compiled), as the call that makes the branch.
    fn create_branch(
        py: Python<'_>,
        ctx: &Py<PyContext>,
        position: i64,
        params: Option<&Bound<'_, PyAny>>,
        grammar: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<impl FnOnce(&mut ContextState) -> lloyal_core::Result<Handle> + Send + 'static> {
        let params = extract_params(params, None)?;
        let core = &ctx.get().inner;
        core.check_open().py()?;
        let grammar = grammar_arg(py, core.model().clone(), grammar)?;
        let position = clamp_i32(position);
        Ok(move |s: &mut ContextState| {
            let h = s.branch_create(position, params)?;
            if grammar.is_some() {
                s.branch_set_grammar(h, grammar)?;
            }
            Ok(h)
        })
    }

    fn call<T: Send + 'static>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut ContextState, Handle) -> lloyal_core::Result<T> + Send + 'static,
    ) -> PyResult<T> {
        let h = self.handle;
        run(py, self.core(), move |s| f(s, h))
    }

    /// This branch's handle, once checked to be of `ctx` (`owner` names who asks, for the error).
    pub(crate) fn handle_in(&self, ctx: &Arc<Context>, owner: &str) -> PyResult<Handle> {
        if !Arc::ptr_eq(self.core(), ctx) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "branch belongs to a different context than {owner}; use one of its own context"
            )));
        }
        Ok(self.handle)
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
        let make = Self::create_branch(py, &ctx, position, params, grammar)?;
        let core = ctx.get().inner.clone();
        let handle = if timeout == Some(0.0) {
            run(py, &core, make)?
        } else {
            lease::wait(py, &core, None, timeout, Box::new(make))?
        };
        Ok(PyBranch { ctx, handle })
    }

    /// Await ``create(ctx, position, params, grammar=grammar, timeout=timeout)`` without
    /// blocking the event loop (as :meth:`afork`).
    #[classmethod]
    #[pyo3(
        signature = (ctx, position=0, params=None, *, grammar=None, timeout=Some(0.0)),
        text_signature = "($cls, ctx, position=0, params=None, *, grammar=None, timeout=0.0)"
    )]
    fn acreate<'py>(
        cls: &Bound<'py, PyType>,
        ctx: Py<PyContext>,
        position: i64,
        params: Option<&Bound<'py, PyAny>>,
        grammar: Option<&Bound<'py, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (py, timeout) = (cls.py(), lease::check_timeout(timeout)?);
        let make = Self::create_branch(py, &ctx, position, params, grammar)?;
        lease::awaitable_branch(py, &ctx, None, timeout, Box::new(make))
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

    /// Await ``fork(clone_logits, at=at, timeout=timeout)`` without blocking the event loop:
    /// made at once when the engine is between ticks, else by the engine before its next tick;
    /// a fork waiting for a lease is an engine request. Cancelling the task withdraws it (a
    /// branch made meanwhile is pruned).
    #[pyo3(
        signature = (clone_logits=true, *, at=None, timeout=Some(0.0)),
        text_signature = "($self, clone_logits=True, *, at=None, timeout=0.0)"
    )]
    fn afork<'py>(
        &self,
        py: Python<'py>,
        clone_logits: bool,
        at: Option<i32>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let timeout = lease::check_timeout(timeout)?;
        self.core().check_open().py()?;
        let h = self.handle;
        let make = Box::new(move |s: &mut ContextState| s.branch_fork_at(h, clone_logits, at));
        lease::awaitable_branch(py, &self.ctx, Some(h), timeout, make)
    }

    /// Await ``prune()`` without blocking the event loop: it runs at once when the engine is
    /// between ticks, else the engine runs it before its next tick.
    fn aprune<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let h = self.handle;
        engine::awaitable(py, self.core(), move |s| s.branch_prune(h))
    }

    /// Await ``prune_subtree()`` without blocking the event loop (as :meth:`aprune`).
    fn aprune_subtree<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let h = self.handle;
        engine::awaitable(py, self.core(), move |s| s.branch_prune_subtree(h))
    }

    /// Dispose this branch (RESTRICT: ``TopologyError`` while children live). Idempotent.
    fn prune(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |s, h| s.branch_prune(h))
    }

    /// Dispose this branch and every descendant (CASCADE). Idempotent.
    fn prune_subtree(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |s, h| s.branch_prune_subtree(h))
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
    ///         boundaries and not yielded (text that may begin one is held back).
    ///     stop_tokens: Token ids that end generation (not committed), besides the model's
    ///         end-of-generation tokens.
    ///     min_tokens: Tokens to generate before the model's end-of-generation tokens and
    ///         ``stop_tokens`` may end it (they are banned until then, and the sampling
    ///         perplexity counts the ban) and before ``stop`` strings are looked for (vLLM's
    ///         ``min_tokens``: a stop string that ends before then does not count, one that
    ///         begins before and ends after does; text that may begin one is held back).
    ///     include_stop_str: Yield a matched ``stop`` string, the text's end (vLLM's
    ///         ``include_stop_str_in_output``).
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
    ///     waited: Seconds the request already waited before this call (in a server's queue).
    ///         The engine paces a prompt next to running streams (a few rows a step) unless it is
    ///         older than they are; ``waited`` makes it that much older, so a request that waited
    ///         while others started prefills at full batch.
    ///     commit_last: Commit the token that reaches ``max_tokens`` before yielding it. False:
    ///         it is yielded as soon as it is sampled and never decoded, one decode less for a
    ///         request whose branch is only kept as a prefix (a server's); the branch then ends
    ///         one token short of what was yielded, and its perplexity leaves that token out.
    ///         It also yields the first token after ``prompt`` as the prompt is written, a step
    ///         before its decode (a shorter time to first token); :attr:`TokenIterator.committed`
    ///         says how many of the yielded tokens the branch holds at the end.
    ///
    /// Raises:
    ///     InvalidTokenError: A stop or prompt token is out of the vocabulary.
    ///     KvCacheFullError: At the first ``next()``: ``max_tokens`` can never fit next to the
    ///         branch's cells, or no room came within ``timeout``; later, with
    ///         ``reserve=False``, when the cache filled up.
    ///     ValueError: An empty stop string, ``top_logprobs`` out of range or another iterator
    ///         of this branch still generating (at the first ``next()``), a negative
    ///         ``timeout`` or ``waited``, or a ``lookahead`` below 1.
    #[pyo3(signature = (max_tokens=None, *, prompt=None, stop=None, stop_tokens=None, min_tokens=0, include_stop_str=false, logprobs=false, top_logprobs=0, timeout=None, lookahead=1, reserve=true, waited=0.0, commit_last=true))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        max_tokens: Option<i64>,
        prompt: Option<Tokens>,
        stop: Option<Vec<String>>,
        stop_tokens: Option<Tokens>,
        min_tokens: i64,
        include_stop_str: bool,
        logprobs: bool,
        top_logprobs: i64,
        timeout: Option<f64>,
        lookahead: i64,
        reserve: bool,
        waited: f64,
        commit_last: bool,
    ) -> PyResult<PyTokenIter> {
        let count = |name: &str, v: i64| narrow::<usize>(name, v, ">= 0");
        let max_tokens = max_tokens.map(|n| count("max_tokens", n)).transpose()?;
        let (min_tokens, top_logprobs) =
            (count("min_tokens", min_tokens)?, count("top_logprobs", top_logprobs)?);
        let lookahead = narrow::<usize>("lookahead", lookahead, ">= 1")?;
        let args = GenArgs::parse(
            self.core().model(),
            max_tokens,
            prompt,
            stop,
            stop_tokens,
            (min_tokens, include_stop_str),
            logprobs,
            top_logprobs,
            timeout,
            lookahead,
            reserve,
            waited,
            commit_last,
        )?;
        Ok(PyTokenIter::new(self.core(), self.handle, args))
    }

    fn __iter__(&self) -> PyTokenIter {
        PyTokenIter::new(self.core(), self.handle, GenArgs::default())
    }

    fn __aiter__(&self) -> PyTokenIter {
        PyTokenIter::new(self.core(), self.handle, GenArgs::default())
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

    /// Perplexity under the sampling distribution (penalties, biases, temperature); ``inf``
    /// before any accepted token. Raises ``LloyalError`` on a context created with
    /// ``sampling_perplexity=False``.
    #[getter]
    fn sampling_perplexity(&self, py: Python<'_>) -> PyResult<f64> {
        self.call(py, |s, h| s.branch(h)?.sampling_perplexity())
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
