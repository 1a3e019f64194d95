//! `lloyal.TextStream`: UTF-8-safe streaming of token text.

use std::sync::{Arc, Mutex};

use lloyal_core::{Model, Utf8Stream};
use pyo3::prelude::*;

use crate::convert::TokenId;
use crate::error::IntoPyResult;

/// Turns tokens into text one at a time; a character split across tokens is released
/// whole once its last byte arrives.
#[pyclass(name = "TextStream", module = "lloyal._lloyal", frozen)]
pub struct PyTextStream {
    model: Arc<Model>,
    stream: Mutex<Utf8Stream>,
}

impl PyTextStream {
    pub(crate) fn new(model: Arc<Model>) -> Self {
        PyTextStream { model, stream: Mutex::new(Utf8Stream::new()) }
    }
}

#[pymethods]
impl PyTextStream {
    /// Add a token; return the text it completes (possibly empty).
    fn push(&self, token: TokenId) -> PyResult<String> {
        let t = self.model.check_token(*token).py()?;
        let bytes = self.model.token_bytes(t, false).py()?;
        Ok(self.stream.lock().unwrap_or_else(|p| p.into_inner()).push(&bytes))
    }

    /// Release any incomplete tail (as U+FFFD).
    fn flush(&self) -> String {
        self.stream.lock().unwrap_or_else(|p| p.into_inner()).flush()
    }
}
