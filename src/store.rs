//! `lloyal.BranchStore`: batched commit, packed prefill and lease management for one context.

use std::sync::Arc;

use lloyal_core::{Context, Handle, KvPressure, Work};
use pyo3::prelude::*;

use crate::aio;
use crate::branch::{PyBranch, PyProduced};
use crate::context::{to_i32, PyContext};
use crate::convert::{TokenId, Tokens};
use crate::detach::run;
use crate::engine;
use crate::error::IntoPyResult;

crate::wrap::wrapper_class! {
    /// KV occupancy by branches.
    "KvPressure" PyKvPressure(KvPressure) {
        /// Total cells.
        n_ctx: u32,
        /// Cells held by branches.
        cells_used: usize,
        /// Cells left.
        remaining: usize,
        /// Cells of pruned branches parked until the cache fills (batch-invariant contexts only).
        cells_parked: usize,
    }
}

/// Multi-branch operations on one context: one ``llama_decode`` for N branches.
#[pyclass(name = "BranchStore", module = "lloyal._lloyal", frozen)]
pub struct PyBranchStore {
    ctx: Py<PyContext>,
}

impl PyBranchStore {
    fn core(&self) -> &Arc<Context> {
        &self.ctx.get().inner
    }

    fn handle_of(&self, b: &Bound<'_, PyBranch>) -> PyResult<Handle> {
        b.get().handle_in(self.core(), "this BranchStore")
    }

    fn commit_work(&self, pairs: &[(Bound<'_, PyBranch>, TokenId)]) -> PyResult<Work> {
        let model = self.core().model();
        let pairs: Vec<(Handle, i32)> = pairs
            .iter()
            .map(|(b, t)| Ok((self.handle_of(b)?, model.check_token(**t).py()?)))
            .collect::<PyResult<_>>()?;
        Ok(Work::Commit(pairs))
    }

    fn prefill_work(&self, items: Vec<(Bound<'_, PyBranch>, Tokens)>) -> PyResult<Work> {
        let model = self.core().model();
        let items: Vec<(Handle, Vec<i32>)> = items
            .into_iter()
            .map(|(b, t)| Ok((self.handle_of(&b)?, to_i32(model, &t)?)))
            .collect::<PyResult<_>>()?;
        Ok(Work::Prefill(items))
    }
}

#[pymethods]
impl PyBranchStore {
    #[new]
    fn new(ctx: Py<PyContext>) -> PyResult<Self> {
        ctx.get().inner.check_open().py()?;
        Ok(PyBranchStore { ctx })
    }

    /// Accept and decode one token per branch in ONE ``llama_decode``; all-or-nothing.
    fn commit(&self, py: Python<'_>, pairs: Vec<(Bound<'_, PyBranch>, TokenId)>) -> PyResult<()> {
        let work = self.commit_work(&pairs)?;
        engine::wait(py, self.core(), work)
    }

    /// Write each branch's tokens, bin-packed into ``ceil(total / n_batch)`` decodes; all-or-nothing.
    fn prefill(&self, py: Python<'_>, items: Vec<(Bound<'_, PyBranch>, Tokens)>) -> PyResult<()> {
        let work = self.prefill_work(items)?;
        engine::wait(py, self.core(), work)
    }

    /// Keep ``winner``'s sequence only; every other branch is disposed; the winner becomes a root.
    fn retain_only(&self, py: Python<'_>, winner: &Bound<'_, PyBranch>) -> PyResult<()> {
        let h = self.handle_of(winner)?;
        run(py, self.core(), move |s| s.retain_only(h))
    }

    /// Sample every branch in one native call (GIL released).
    fn produce_all(&self, py: Python<'_>, branches: Vec<Bound<'_, PyBranch>>) -> PyResult<Vec<PyProduced>> {
        let handles: Vec<Handle> = branches.iter().map(|b| self.handle_of(b)).collect::<PyResult<_>>()?;
        let tokens = run(py, self.core(), move |s| s.produce_all(&handles))?;
        Ok(tokens.into_iter().map(|t| PyBranch::produced(self.core(), t)).collect())
    }

    /// Await ``commit(pairs)``: queued on the context's engine, the event loop keeps running.
    fn acommit<'py>(slf: &Bound<'py, Self>, pairs: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        aio::Coroutine::EngineCall.call(slf.py(), slf.getattr("_submit_commit")?, vec![pairs])
    }

    /// Await ``retain_only(winner)`` without blocking the event loop: it runs at once when the
    /// engine is between ticks, else the engine runs it before its next tick.
    fn aretain_only<'py>(
        &self,
        py: Python<'py>,
        winner: &Bound<'py, PyBranch>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let h = self.handle_of(winner)?;
        engine::awaitable(py, self.core(), move |s| s.retain_only(h))
    }

    /// Await ``prefill(items)``: queued on the context's engine, the event loop keeps running.
    fn aprefill<'py>(slf: &Bound<'py, Self>, items: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        aio::Coroutine::EngineCall.call(slf.py(), slf.getattr("_submit_prefill")?, vec![items])
    }

    /// Queue ``commit(pairs)`` on the engine now; the engine thread settles ``fut`` on
    /// ``lp``. Returns a canceller (``lloyal.aio.engine_start`` wraps it).
    fn _submit_commit<'py>(
        &self,
        py: Python<'py>,
        lp: Bound<'py, PyAny>,
        fut: Bound<'py, PyAny>,
        pairs: Vec<(Bound<'py, PyBranch>, TokenId)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let work = self.commit_work(&pairs)?;
        engine::submit_async(py, self.core(), work, lp, fut)
    }

    fn _submit_prefill<'py>(
        &self,
        py: Python<'py>,
        lp: Bound<'py, PyAny>,
        fut: Bound<'py, PyAny>,
        items: Vec<(Bound<'py, PyBranch>, Tokens)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let work = self.prefill_work(items)?;
        engine::submit_async(py, self.core(), work, lp, fut)
    }

    /// Free leases (as of the last call that finished: read without waiting for a tick).
    #[getter]
    fn available(&self) -> PyResult<u32> {
        Ok(self.core().occupancy().py()?.0)
    }

    /// KV cells used by branches (as of the last call that finished, like ``available``).
    #[getter]
    fn kv_pressure(&self) -> PyResult<PyKvPressure> {
        Ok(PyKvPressure(self.core().occupancy().py()?.1))
    }

    /// The context.
    #[getter]
    fn context(&self, py: Python<'_>) -> Py<PyContext> {
        self.ctx.clone_ref(py)
    }
}
