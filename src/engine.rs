//! Glue to the core engine (`lloyal_core::engine`): submit decode-bearing work and wait for
//! it (sync: GIL released, Ctrl-C cancels) or await it (an asyncio future the engine thread
//! resolves through `loop.call_soon_threadsafe`; no worker thread per call), and await the
//! other context calls the same way.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lloyal_core::{CallDone, Context, ContextState, EngineStats, LloyalError, Waiter, Work};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyCFunction;

use crate::aio;
use crate::detach::{on_main_thread, without_gil};
use crate::error::to_py;

crate::wrap::wrapper_class! {
    /// Counters of a context's engine (``Context.engine_stats()``).
    "EngineStats" PyEngineStats(EngineStats) {
        /// Ticks run (each one pass over the queue that decoded something).
        ticks: u64,
        /// ``llama_decode`` calls made by the engine.
        decode_calls: u64,
        /// Rows (tokens) decoded.
        rows: u64,
        /// Operations submitted.
        ops_submitted: u64,
        /// Operations answered with success.
        ops_completed: u64,
        /// Operations answered with an error (validation, decode, cancellation, close).
        ops_failed: u64,
        /// Operations whose rows shared a tick with another operation's.
        ops_coalesced: u64,
        /// The most operations one tick decoded together.
        max_ops_per_tick: u64,
        /// Operations waiting for the next tick.
        queue_depth: usize,
        /// Prefills in flight across ticks.
        in_flight: usize,
        /// Generation requests running (``Branch.generate`` iterators).
        generating: usize,
        /// Generation requests waiting (FIFO) for room in the cache.
        waiting: usize,
        /// Seconds spent in ticks that decoded something (validation, packing, decode, sampling,
        /// publishing and waking callers).
        tick_seconds: f64,
        /// Seconds of those spent in ``llama_decode``.
        decode_seconds: f64,
        /// Seconds of those spent sampling: generation requests' tokens, and the next tokens of
        /// branches whose commit carried what ``produce`` drew (drawn ahead in the tick).
        sample_seconds: f64,
        /// ``Branch.create`` / ``fork`` calls waiting (first come, first served) for a lease.
        lease_waiting: usize,
        /// The prefill cap of the last tick (0: the whole batch; with the paced default, what
        /// the engine allowed next to the running streams).
        prefill_cap: usize,
        /// Whether the engine is paused (``Context.pause_engine``).
        paused: bool,
        /// Seconds a tick waits for as many commits as the previous tick decoded.
        gather: f64,
        /// Times an idle engine given a prompt waited for the rest of a burst (concurrent
        /// requests a few milliseconds behind); after a wait no other prompt joined, the next
        /// prompt starts at once (docs/engine.md).
        burst_waits: u64,
        /// Seconds spent in those waits.
        burst_wait_seconds: f64,
        /// Times the engine, run dry, moved the KV cache's cells back to its front (cells left
        /// high by a busy stretch slow every later decode).
        kv_compactions: u64,
    }
}

/// Submit `work` to `ctx`'s engine and block (GIL released) until its tick answers.
///
/// On Python's main thread the wait wakes every 50 ms to run signal handlers: Ctrl-C cancels
/// the operation (removed from the queue, or an in-flight prefill rolled back at the next
/// tick), waits for the engine to confirm, and raises the handler's `KeyboardInterrupt`.
pub fn wait(py: Python<'_>, ctx: &Arc<Context>, work: Work) -> PyResult<()> {
    let (waiter, done) = Waiter::new();
    let ticket = ctx.submit(work, done).map_err(to_py)?;
    // One GIL release a wait: the spin (none without a spare core) then the sleep.
    let mut spin = ctx.engine_spin();
    if !on_main_thread(py) {
        return without_gil(py, || {
            waiter.spin(spin);
            waiter.wait()
        })
        .map_err(to_py);
    }
    loop {
        let budget = std::mem::take(&mut spin); // the first wait only
        let answered = without_gil(py, || {
            waiter.spin(budget);
            waiter.wait_timeout(Duration::from_millis(50))
        });
        if let Some(r) = answered {
            return r.map_err(to_py);
        }
        if let Err(e) = py.check_signals() {
            ticket.cancel();
            // The operation is removed, rolled back or finished before the error surfaces.
            let _ = without_gil(py, || waiter.wait());
            return Err(e);
        }
    }
}

/// A callback that settles `fut` (a future of `lp`) from any thread: `None` sets its result,
/// an error its exception.
fn settler(lp: Py<PyAny>, fut: Py<PyAny>) -> impl FnOnce(Option<LloyalError>) + Send + 'static {
    move |error| {
        crate::exit::attach(|py| {
            let error: Py<PyAny> = match error {
                None => py.None(),
                Some(e) => to_py(e).into_value(py).into_any(),
            };
            if let Ok(settle) = aio::settle(py) {
                // A closed loop cannot take the result, and then nobody awaits it.
                let _ = lp.bind(py).call_method1("call_soon_threadsafe", (settle, fut.bind(py), error));
            }
        });
    }
}

/// Submit `work` for `lloyal.aio.engine_call`: `fut` (a future of the running `lp`) is
/// settled from the engine thread. Returns a callable that cancels the operation.
pub fn submit_async<'py>(
    py: Python<'py>,
    ctx: &Arc<Context>,
    work: Work,
    lp: Bound<'py, PyAny>,
    fut: Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let settle = settler(lp.unbind(), fut.unbind());
    let done: lloyal_core::engine::Done = Box::new(move |result| settle(result.err()));
    let ticket = ctx.submit(work, done).map_err(to_py)?;
    let cancel = PyCFunction::new_closure(py, None, None, move |_args, _kwargs| -> PyResult<()> {
        ticket.cancel();
        Ok(())
    })?;
    Ok(cancel.into_any())
}

/// The value an awaited context call made, for the coroutine to take once `fut` settled.
pub type Made<T> = Arc<Mutex<Option<T>>>;

/// A context call for `lloyal.aio.engine_call` / `engine_value` ([`Context::apply_then`]): run
/// at once when no engine tick runs (the event loop waits microseconds), else queued for the
/// engine thread, which runs it before its next tick; `fut` is settled either way, the value
/// kept in the returned slot. Also returns the canceller (withdraws the call if it waits).
pub fn call_async<'py, T, F>(
    py: Python<'py>,
    ctx: &Arc<Context>,
    f: F,
    lp: Bound<'py, PyAny>,
    fut: Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyAny>, Made<T>)>
where
    T: Send + 'static,
    F: FnOnce(&mut ContextState) -> lloyal_core::Result<T> + Send + 'static,
{
    let made: Made<T> = Arc::default();
    let keep = Arc::clone(&made);
    let settle = settler(lp.unbind(), fut.unbind());
    let done: CallDone<T> = Box::new(move |result| match result {
        Ok(v) => {
            *keep.lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
            settle(None);
        }
        Err(e) => settle(Some(e)),
    });
    let queued = without_gil(py, || ctx.apply_then(f, done)).map_err(to_py)?;
    let cancel = PyCFunction::new_closure(py, None, None, move |_args, _kwargs| -> PyResult<()> {
        if let Some(q) = &queued {
            q.cancel();
        }
        Ok(())
    })?;
    Ok((cancel.into_any(), made))
}

/// An awaitable context call that returns nothing (``aprune``, ``aretain_only``): the
/// coroutine of `lloyal.aio.engine_call` over [`call_async`].
pub fn awaitable<'py, F>(py: Python<'py>, ctx: &Arc<Context>, f: F) -> PyResult<Bound<'py, PyAny>>
where
    F: FnOnce(&mut ContextState) -> lloyal_core::Result<()> + Send + 'static,
{
    let ctx = Arc::clone(ctx);
    let f = Mutex::new(Some(f));
    let submit = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> PyResult<Py<PyAny>> {
        let (lp, fut) = (args.get_item(0)?, args.get_item(1)?);
        let (cancel, _) = call_async(args.py(), &ctx, take_once(&f)?, lp, fut)?;
        Ok(cancel.unbind())
    })?;
    aio::Coroutine::EngineCall.call(py, submit.into_any(), vec![])
}

/// The call of an awaitable, taken by its coroutine's one submission.
pub fn take_once<F>(call: &Mutex<Option<F>>) -> PyResult<F> {
    let f = call.lock().unwrap_or_else(|p| p.into_inner()).take();
    f.ok_or_else(|| PyRuntimeError::new_err("this coroutine was already awaited"))
}
