//! `create` / `fork` with a `timeout`: wait for a lease in the engine (`engine::lease`).

use std::sync::{Arc, Mutex};

use lloyal_core::engine::lease::{LeaseWork, MakeBranch};
use lloyal_core::{Context, Handle, LloyalError, Work};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyTuple};

use crate::aio;
use crate::branch::PyBranch;
use crate::context::PyContext;
use crate::detach::run;
use crate::engine;
use crate::error::to_py;

/// A `timeout` keyword: `Some(0.0)` means "do not wait", `None` "wait as long as it takes".
pub fn check_timeout(timeout: Option<f64>) -> PyResult<Option<f64>> {
    match timeout {
        Some(t) if t.is_nan() || t < 0.0 => Err(PyValueError::new_err(format!(
            "timeout must be None (wait as long as it takes), 0 (do not wait) or a number of seconds > 0, got {t}"
        ))),
        t => Ok(t),
    }
}

/// Prune a branch its caller gave up on (`granted` as the caller left).
fn discard(py: Python<'_>, ctx: &Arc<Context>, granted: Option<Handle>) {
    if let Some(h) = granted {
        let _ = run(py, ctx, move |s| s.branch_prune(h));
    }
}

fn lost() -> PyErr {
    to_py(LloyalError::Backend("internal error: a granted lease went missing (please report it)".into()))
}

/// Queue `make` until a lease is free and block for it (GIL released; Ctrl-C withdraws).
pub fn wait(
    py: Python<'_>,
    ctx: &Arc<Context>,
    parent: Option<Handle>,
    timeout: Option<f64>,
    make: MakeBranch,
) -> PyResult<Handle> {
    let (work, slot) = LeaseWork::new(parent, timeout, make);
    match engine::wait(py, ctx, Work::Lease(Arc::new(work))) {
        Ok(()) => slot.take().ok_or_else(lost),
        Err(e) => {
            discard(py, ctx, slot.withdraw());
            Err(e)
        }
    }
}

/// For `lloyal.aio.engine_value`: queue `make`, settle `fut` when granted; returns
/// `(cancel, take)` callables (cancel withdraws and prunes a branch granted meanwhile; take
/// returns the granted branch as `wrap` makes it).
fn submit_async<'py>(
    py: Python<'py>,
    ctx: &Py<PyContext>,
    parent: Option<Handle>,
    timeout: Option<f64>,
    make: MakeBranch,
    wrap: impl Fn(Python<'_>, &Py<PyContext>, Handle) -> PyResult<Py<PyAny>> + Send + Sync + 'static,
    (lp, fut): (Bound<'py, PyAny>, Bound<'py, PyAny>),
) -> PyResult<Bound<'py, PyTuple>> {
    let core = ctx.get().inner.clone();
    let (work, slot) = LeaseWork::new(parent, timeout, make);
    let cancel_op = engine::submit_async(py, &core, Work::Lease(Arc::new(work)), lp, fut)?;
    let withdraw = Arc::clone(&slot);
    cancel_and_take(py, ctx, cancel_op, move || withdraw.withdraw(), move || slot.take(), wrap)
}

/// The `lloyal.aio.engine_value` coroutine of a branch made by `make`: without waiting for a
/// lease (`timeout=0`: at once when no engine tick runs, else by the engine before its next
/// tick), or after waiting for one in the engine.
pub fn awaitable_branch<'py>(
    py: Python<'py>,
    ctx: &Py<PyContext>,
    parent: Option<Handle>,
    timeout: Option<f64>,
    make: MakeBranch,
) -> PyResult<Bound<'py, PyAny>> {
    let ctx = ctx.clone_ref(py);
    let make = Mutex::new(Some(make));
    let submit = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> PyResult<Py<PyTuple>> {
        let py = args.py();
        let (lp, fut) = (args.get_item(0)?, args.get_item(1)?);
        let make = engine::take_once(&make)?;
        let wrap = |py: Python<'_>, ctx: &Py<PyContext>, handle| {
            Ok(Py::new(py, PyBranch { ctx: ctx.clone_ref(py), handle })?.into_any())
        };
        let pair = if timeout == Some(0.0) {
            submit_now_async(py, &ctx, make, wrap, (lp, fut))?
        } else {
            submit_async(py, &ctx, parent, timeout, make, wrap, (lp, fut))?
        };
        Ok(pair.unbind())
    })?;
    aio::Coroutine::EngineValue.call(py, submit.into_any(), vec![])
}

/// [`submit_async`] for a branch made without waiting for a lease (`timeout=0`): at once when
/// no engine tick runs, else by the engine before its next tick ([`engine::call_async`]).
fn submit_now_async<'py>(
    py: Python<'py>,
    ctx: &Py<PyContext>,
    make: MakeBranch,
    wrap: impl Fn(Python<'_>, &Py<PyContext>, Handle) -> PyResult<Py<PyAny>> + Send + Sync + 'static,
    (lp, fut): (Bound<'py, PyAny>, Bound<'py, PyAny>),
) -> PyResult<Bound<'py, PyTuple>> {
    let core = ctx.get().inner.clone();
    let (cancel_op, made) = engine::call_async(py, &core, make, lp, fut)?;
    let granted = Arc::clone(&made);
    let take = move || made.lock().unwrap_or_else(|p| p.into_inner()).take();
    let withdraw = move || granted.lock().unwrap_or_else(|p| p.into_inner()).take();
    cancel_and_take(py, ctx, cancel_op, withdraw, take, wrap)
}

/// The `(cancel, take)` pair of an awaited branch: cancel runs `cancel_op` and prunes a
/// branch made meanwhile (`withdraw`); take wraps the branch made (`take`).
fn cancel_and_take<'py>(
    py: Python<'py>,
    ctx: &Py<PyContext>,
    cancel_op: Bound<'py, PyAny>,
    withdraw: impl Fn() -> Option<Handle> + Send + Sync + 'static,
    take: impl Fn() -> Option<Handle> + Send + Sync + 'static,
    wrap: impl Fn(Python<'_>, &Py<PyContext>, Handle) -> PyResult<Py<PyAny>> + Send + Sync + 'static,
) -> PyResult<Bound<'py, PyTuple>> {
    let core = ctx.get().inner.clone();
    let cancel_op = cancel_op.unbind();
    let cancel = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> PyResult<()> {
        let py = args.py();
        cancel_op.bind(py).call0()?;
        discard(py, &core, withdraw());
        Ok(())
    })?;
    let ctx = ctx.clone_ref(py);
    let take = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> PyResult<Py<PyAny>> {
        let handle = take().ok_or_else(lost)?;
        wrap(args.py(), &ctx, handle)
    })?;
    PyTuple::new(py, [cancel.into_any(), take.into_any()])
}
