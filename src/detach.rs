//! The one place that releases the GIL: lock a context and run core work on it.
//!
//! A panic inside core work (a bug, never expected from user input: clippy denies
//! unwrap/expect in the core) is caught here and raised as a `LloyalError` rather than
//! pyo3's `PanicException` (a `BaseException` that `except Exception` would not catch).

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use lloyal_core::{Context, ContextState, InterruptCheck, LloyalError, Result};
use pyo3::prelude::*;

use crate::error::to_py;

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("internal error in lloyal (please report it): {what}")
}

fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(LloyalError::Backend(panic_message(p))))
}

thread_local! {
    /// Whether this OS thread is Python's main thread (the only one that runs signal handlers).
    static ON_MAIN_THREAD: Cell<Option<bool>> = const { Cell::new(None) };
}

pub(crate) fn on_main_thread(py: Python<'_>) -> bool {
    ON_MAIN_THREAD.with(|known| {
        if let Some(v) = known.get() {
            return v;
        }
        let v = (|| -> PyResult<bool> {
            let threading = py.import("threading")?;
            let main = threading.call_method0("main_thread")?;
            Ok(main.is(&threading.call_method0("current_thread")?))
        })()
        .unwrap_or(false);
        known.set(Some(v));
        v
    })
}

/// Release the GIL, run `f` on `ctx` ([`Context::apply`]: at once, or by the engine between
/// two ticks), map the error. Every context call that is not engine work goes through here.
///
/// On Python's main thread, a call that needs several `llama_decode`s (a prefill longer than
/// n_batch), or that waits for the engine's tick, runs Python's signal handlers meanwhile:
/// Ctrl-C stops it (a started call after its current chunk, rolled back by the core), and the
/// handler's exception (`KeyboardInterrupt`) is raised here.
pub fn run<T, F>(py: Python<'_>, ctx: &Context, f: F) -> PyResult<T>
where
    T: Send + 'static,
    F: FnOnce(&mut ContextState) -> Result<T> + Send + 'static,
{
    run_with(py, |check| ctx.apply(check, f))
}

/// [`run`] for a call that decodes (the flat path's `decode`, embeddings, a reseed): it runs
/// on the context's engine thread ([`Context::apply_decoding`]).
pub fn run_decoding<T, F>(py: Python<'_>, ctx: &Arc<Context>, f: F) -> PyResult<T>
where
    T: Send + 'static,
    F: FnOnce(&mut ContextState) -> Result<T> + Send + 'static,
{
    run_with(py, |check| ctx.apply_decoding(check, f))
}

/// Release the GIL and run `apply` with Python's signal check on the main thread (none
/// elsewhere); map the error.
fn run_with<T: Send>(
    py: Python<'_>,
    apply: impl FnOnce(Option<InterruptCheck>) -> Result<T> + Send,
) -> PyResult<T> {
    if !on_main_thread(py) {
        return py.detach(|| guarded(|| apply(None))).map_err(to_py);
    }
    let raised: Arc<Mutex<Option<PyErr>>> = Arc::default();
    let slot = Arc::clone(&raised);
    let check = Box::new(move || {
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(e) => {
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                true
            }
        })
    });
    match py.detach(|| guarded(|| apply(Some(check)))) {
        Err(LloyalError::Interrupted) => {
            let pending = raised.lock().unwrap_or_else(|p| p.into_inner()).take();
            Err(pending.unwrap_or_else(|| to_py(LloyalError::Interrupted)))
        }
        other => other.map_err(to_py),
    }
}

/// Like [`run`] but without the context lock (pure CPU work such as tokenizing long text).
pub fn detached<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> Result<T> + Send,
{
    py.detach(|| guarded(f)).map_err(to_py)
}

/// Release the GIL for `f`, which returns no core `Result` (closing a context, waiting for
/// the engine, parsing model output).
pub fn without_gil<T, F>(py: Python<'_>, f: F) -> T
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    py.detach(f)
}

/// Like [`detached`] for I/O on the file at `path`: an `std::io::Error` becomes the matching
/// `OSError` subclass naming the file, as Python's own ``open()`` does
/// (``FileNotFoundError: [Errno 2] No such file or directory: 'x.bin'``).
pub fn detached_io_at<T, F>(py: Python<'_>, path: &std::path::Path, f: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> std::io::Result<T> + Send,
{
    let result = py.detach(|| {
        catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(std::io::Error::other(panic_message(p))))
    });
    result.map_err(|e| {
        let Some(errno) = e.raw_os_error() else { return PyErr::from(e) };
        let strerror = std::io::Error::from_raw_os_error(errno).to_string();
        let strerror = strerror.split(" (os error").next().unwrap_or_default().to_string();
        // OSError(errno, strerror, filename) is the subclass for the errno (FileNotFoundError, ...)
        match py.get_type::<pyo3::exceptions::PyOSError>().call1((errno, strerror, path.to_string_lossy())) {
            Ok(exc) => PyErr::from_value(exc),
            Err(other) => other,
        }
    })
}
