//! The one place that releases the GIL: lock a context and run core work on it.

use lloyal_core::{Context, ContextState, Result};
use pyo3::prelude::*;

use crate::errors::to_py;

/// Release the GIL, lock `ctx`, run `f`, map the error. Every model call goes through here.
pub fn run<T, F>(py: Python<'_>, ctx: &Context, f: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce(&mut ContextState) -> Result<T> + Send,
{
    py.detach(|| ctx.with(f)).map_err(to_py)
}

/// Like [`run`] but without the context lock (pure CPU work such as tokenizing long text).
pub fn detached<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> Result<T> + Send,
{
    py.detach(f).map_err(to_py)
}

/// Like [`detached`] for file I/O: an `std::io::Error` becomes the matching `OSError` subclass.
pub fn detached_io<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> std::io::Result<T> + Send,
{
    py.detach(f).map_err(PyErr::from)
}
