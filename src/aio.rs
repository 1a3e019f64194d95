//! Bridges to `lloyal.aio`: native calls awaited without blocking the event loop.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;

static AIO: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn aio(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    Ok(AIO.get_or_try_init(py, || py.import("lloyal.aio").map(Bound::unbind))?.bind(py))
}

/// The coroutines of `lloyal.aio` that the `a*` methods return.
#[derive(Clone, Copy)]
pub enum Coroutine {
    /// `stream_next(iterator)`: the next token of a generation stream (`TokenIterator._poll`).
    StreamNext,
    /// `engine_call(submit, *args)`: an engine operation; `submit(loop, future, *args)`
    /// queues it.
    EngineCall,
    /// `engine_value(submit, *args)`: an engine call that makes a value (a lease request, a
    /// score); `submit(loop, future, *args)` queues it and returns `(cancel, take)`; the
    /// coroutine returns `take()`.
    EngineValue,
}

impl Coroutine {
    fn name(self) -> &'static str {
        match self {
            Coroutine::StreamNext => "stream_next",
            Coroutine::EngineCall => "engine_call",
            Coroutine::EngineValue => "engine_value",
        }
    }

    /// `lloyal.aio.<coroutine>(first, *args)`: the coroutine it returns.
    pub fn call<'py>(
        self,
        py: Python<'py>,
        first: Bound<'py, PyAny>,
        args: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut all = vec![first];
        all.extend(args);
        aio(py)?.getattr(self.name())?.call1(PyTuple::new(py, all)?)
    }
}

/// `lloyal.aio._settle(future, error)`: set a future's result or exception unless done.
pub fn settle(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    aio(py)?.getattr("_settle")
}
