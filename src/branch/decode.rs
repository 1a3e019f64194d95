//! `Branch`'s tokens: sample, accept, commit and prefill (sync and awaited), verify a
//! draft, reseed.

use std::sync::Arc;

use lloyal_core::branch::score::ScoreWork;
use lloyal_core::branch::verify::VerifyWork;
use lloyal_core::{LloyalError, Work};
use pyo3::prelude::*;
use pyo3::types::PyCFunction;

use super::{PyBranch, PyProduced};
use crate::aio;
use crate::context::to_i32;
use crate::convert::narrow;
use crate::convert::{TokenId, Tokens};
use crate::engine;
use crate::error::IntoPyResult;

#[pymethods]
impl PyBranch {
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
    fn accept(&self, py: Python<'_>, token: TokenId) -> PyResult<()> {
        let token = self.core().model().check_token(*token).py()?;
        self.call(py, move |s, h| s.branch_accept(h, token))
    }

    /// Accept ``token``, decode it, and capture the new logits; on failure nothing changes.
    ///
    /// Runs on the context's engine: commits and prefills that other threads or tasks
    /// submit meanwhile share its ``llama_decode``.
    fn commit(&self, py: Python<'_>, token: TokenId) -> PyResult<()> {
        let token = self.core().model().check_token(*token).py()?;
        engine::wait(py, self.core(), Work::Commit(vec![(self.handle, token)]))
    }

    /// Speculative check of ``draft_tokens`` in one decode (the bonus token in a second); returns
    /// how many were accepted.
    ///
    /// Keeps the longest prefix of the drafts that this branch's sampler agrees with, removes
    /// the rejected drafts' cells, and commits the sampler's own next token (the bonus, see
    /// ``last_token``); an end-of-generation token ends the walk as the bonus, even when it was
    /// drafted (no draft after it is kept). Greedy output equals plain greedy decoding (on a
    /// batch-invariant context; the default kernels may round a batch of rows differently,
    /// which can flip a near tie).
    ///
    /// Runs on the context's engine: the drafts decode in one tick and the bonus in the next,
    /// each sharing its ``llama_decode`` with other callers' rows; a failure (or Ctrl-C) leaves
    /// the branch as it was.
    fn verify(&self, py: Python<'_>, draft_tokens: Tokens) -> PyResult<usize> {
        let drafts = to_i32(self.core().model(), &draft_tokens)?;
        let work = Arc::new(VerifyWork::new(self.handle, drafts));
        engine::wait(py, self.core(), Work::Verify(Arc::clone(&work)))?;
        accepted(&work)
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
    fn prefill(&self, py: Python<'_>, tokens: Tokens) -> PyResult<()> {
        let tokens = to_i32(self.core().model(), &tokens)?;
        engine::wait(py, self.core(), Work::Prefill(vec![(self.handle, tokens)]))
    }

    /// Write ``tokens`` as :meth:`prefill` does and score each one: a
    /// :class:`~lloyal.ScoredToken` ``(logprob, top, rank)``, its ``log_softmax`` under the
    /// logits before it (for the first, the branch's logits; ``None`` on a branch without any),
    /// the ``top_logprobs`` most likely ``(token, logprob)`` pairs there, best first (0 to 20),
    /// and its rank there (1 + the tokens with a higher logit, as vLLM counts it; ``None`` with
    /// the logprob). A prompt's logprobs, as OpenAI's ``echo`` and vLLM's ``prompt_logprobs``
    /// report them.
    ///
    /// Runs on the context's engine as a prefill whose rows all keep logits, 64 rows a tick
    /// (each costs the output layer; shared among the decode's threads); a failure leaves the
    /// branch as it was.
    ///
    /// Example:
    ///     >>> scored = branch.score(ctx.tokenize(" and the cat", add_special=False), top_logprobs=2)
    ///     >>> len(scored), len(scored[0].top), scored[0].rank >= 1, branch.position
    ///     (3, 2, True, 13)
    #[pyo3(signature = (tokens, top_logprobs = 0))]
    fn score(&self, py: Python<'_>, tokens: Tokens, top_logprobs: i64) -> PyResult<Vec<Py<PyAny>>> {
        let top_logprobs = narrow::<usize>("top_logprobs", top_logprobs, "in 0..=20")?;
        let work = self.score_work(tokens, top_logprobs)?;
        engine::wait(py, self.core(), Work::Score(Arc::clone(&work)))?;
        scored_tokens(py, &work)
    }

    /// Await ``score(tokens, top_logprobs)``: queued on the context's engine, the event loop
    /// keeps running; cancelling the awaiting task withdraws it (one in flight is rolled back).
    #[pyo3(signature = (tokens, top_logprobs = 0))]
    fn ascore<'py>(
        slf: &Bound<'py, Self>,
        tokens: Bound<'py, PyAny>,
        top_logprobs: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        narrow::<usize>("top_logprobs", top_logprobs, "in 0..=20")?;
        let top = top_logprobs.into_pyobject(slf.py())?.into_any();
        aio::Coroutine::EngineValue.call(slf.py(), slf.getattr("_submit_score")?, vec![tokens, top])
    }

    fn _submit_score<'py>(
        &self,
        py: Python<'py>,
        lp: Bound<'py, PyAny>,
        fut: Bound<'py, PyAny>,
        tokens: Tokens,
        top_logprobs: usize,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let work = self.score_work(tokens, top_logprobs)?;
        let cancel = engine::submit_async(py, self.core(), Work::Score(Arc::clone(&work)), lp, fut)?;
        let take =
            PyCFunction::new_closure(py, None, None, move |args, _kwargs| scored_tokens(args.py(), &work))?;
        Ok((cancel, take.into_any()))
    }

    /// Await ``prefill(tokens)``: queued on the context's engine, the event loop keeps running.
    fn aprefill<'py>(slf: &Bound<'py, Self>, tokens: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        aio::Coroutine::EngineCall.call(slf.py(), slf.getattr("_submit_prefill")?, vec![tokens])
    }

    /// Await ``verify(draft_tokens)``: queued on the context's engine, the event loop keeps
    /// running; the number of drafts accepted.
    fn averify<'py>(slf: &Bound<'py, Self>, draft_tokens: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        aio::Coroutine::EngineValue.call(slf.py(), slf.getattr("_submit_verify")?, vec![draft_tokens])
    }

    fn _submit_verify<'py>(
        &self,
        py: Python<'py>,
        lp: Bound<'py, PyAny>,
        fut: Bound<'py, PyAny>,
        draft_tokens: Tokens,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let drafts = to_i32(self.core().model(), &draft_tokens)?;
        let work = Arc::new(VerifyWork::new(self.handle, drafts));
        let cancel = engine::submit_async(py, self.core(), Work::Verify(Arc::clone(&work)), lp, fut)?;
        let take = PyCFunction::new_closure(py, None, None, move |_args, _kwargs| -> PyResult<usize> {
            accepted(&work)
        })?;
        Ok((cancel, take.into_any()))
    }

    /// Await ``commit(token)``: queued on the context's engine, the event loop keeps running.
    fn acommit<'py>(slf: &Bound<'py, Self>, token: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        aio::Coroutine::EngineCall.call(slf.py(), slf.getattr("_submit_commit")?, vec![token])
    }

    fn _submit_commit<'py>(
        &self,
        py: Python<'py>,
        lp: Bound<'py, PyAny>,
        fut: Bound<'py, PyAny>,
        token: TokenId,
    ) -> PyResult<Bound<'py, PyAny>> {
        let token = self.core().model().check_token(*token).py()?;
        engine::submit_async(py, self.core(), Work::Commit(vec![(self.handle, token)]), lp, fut)
    }

    fn _submit_prefill<'py>(
        &self,
        py: Python<'py>,
        lp: Bound<'py, PyAny>,
        fut: Bound<'py, PyAny>,
        tokens: Tokens,
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
    /// ones are written, a failed decode (or Ctrl-C) restores the branch; otherwise it leaves
    /// the branch empty at position 0. Runs on the context's engine, written like a prefill.
    ///
    /// Example:
    ///     >>> branch.reseed(tokens[:4], tokens[-8:])  # sinks + recent tail
    ///     12
    fn reseed(&self, py: Python<'_>, sinks: Tokens, tail: Tokens) -> PyResult<i32> {
        let model = self.core().model();
        let (sinks, tail) = (to_i32(model, &sinks)?, to_i32(model, &tail)?);
        let n = (sinks.len() + tail.len()) as i32;
        engine::wait(py, self.core(), Work::Reseed(self.handle, sinks, tail))?;
        Ok(n)
    }
}

impl PyBranch {
    /// A score of `tokens` on this branch, its arguments checked.
    fn score_work(&self, tokens: Tokens, top_logprobs: usize) -> PyResult<Arc<ScoreWork>> {
        let tokens = to_i32(self.core().model(), &tokens)?;
        Ok(Arc::new(ScoreWork::new(self.handle, tokens, top_logprobs).py()?))
    }
}

/// A finished score's tokens as `lloyal.ScoredToken` tuples.
fn scored_tokens(py: Python<'_>, work: &ScoreWork) -> PyResult<Vec<Py<PyAny>>> {
    let missing = || LloyalError::Backend("internal error: score answered without its result".into());
    let scored = work.result.take().ok_or_else(missing).py()?;
    let cls = py.import("lloyal.scored")?.getattr("ScoredToken")?;
    scored.into_iter().map(|s| Ok(cls.call1((s.logprob, s.top, s.rank))?.unbind())).collect()
}

/// How many drafts a verify that answered accepted (taken once).
fn accepted(work: &VerifyWork) -> PyResult<usize> {
    let missing = || LloyalError::Backend("internal error: verify answered without its result".into());
    work.result.take().map(|v| v.accepted).ok_or_else(missing).py()
}
