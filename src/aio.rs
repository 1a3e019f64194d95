//! Bridges to `lloyal.aio`: native calls awaited off the event loop.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;

static AIO: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn aio(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    Ok(AIO.get_or_try_init(py, || py.import("lloyal.aio").map(Bound::unbind))?.bind(py))
}

/// `lloyal.aio.<name>(first, *args)`: the coroutine it returns.
fn call<'py>(
    py: Python<'py>,
    name: &str,
    first: Bound<'py, PyAny>,
    args: Vec<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mut all = vec![first];
    all.extend(args);
    aio(py)?.getattr(name)?.call1(PyTuple::new(py, all)?)
}

/// A coroutine that runs `callable(*args)` in a worker thread.
pub fn in_thread<'py>(
    py: Python<'py>,
    callable: Bound<'py, PyAny>,
    args: Vec<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    call(py, "run_in_thread", callable, args)
}

/// A coroutine awaiting the next token of a generation stream (`TokenIterator._poll`).
pub fn stream_next<'py>(py: Python<'py>, iterator: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    call(py, "stream_next", iterator, Vec::new())
}

/// A coroutine awaiting an engine operation: `submit(loop, future, *args)` queues it.
pub fn engine_call<'py>(
    py: Python<'py>,
    submit: Bound<'py, PyAny>,
    args: Vec<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    call(py, "engine_call", submit, args)
}

/// A coroutine awaiting a lease request: `submit(loop, future, *args)` queues it and returns
/// `(cancel, take)`; the coroutine returns `take()`.
pub fn lease_call<'py>(
    py: Python<'py>,
    submit: Bound<'py, PyAny>,
    args: Vec<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    call(py, "lease_call", submit, args)
}

/// `lloyal.aio._settle(future, error)`: set a future's result or exception unless done.
pub fn settle(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    aio(py)?.getattr("_settle")
}
