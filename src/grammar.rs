//! `Grammar` handles and `json_schema_to_grammar`.

use std::sync::{Arc, Mutex, MutexGuard};

use lloyal_core::{Grammar, Model};
use numpy::PyReadwriteArray1;
use pyo3::prelude::*;

use crate::detach::detached;
use crate::error::IntoPyResult;

/// A GBNF grammar's parse state: mask logits with ``apply``, advance with ``accept``.
///
/// Example:
///     >>> g = ctx.create_grammar('root ::= "yes" | "no"')
///     >>> logits = ctx.get_logits().copy()
///     >>> g.apply(logits)  # forbidden tokens become -inf
///     >>> g.allows(ctx.tokenize("yes", add_special=False)[0])
///     True
#[pyclass(name = "Grammar", module = "lloyal._lloyal", frozen)]
pub struct PyGrammar {
    inner: Mutex<Grammar>,
}

impl PyGrammar {
    pub(crate) fn parse(py: Python<'_>, model: Arc<Model>, gbnf: String, root: String) -> PyResult<Grammar> {
        detached(py, move || Grammar::new(model, &gbnf, &root))
    }

    pub(crate) fn from_core(grammar: Grammar) -> Self {
        PyGrammar { inner: Mutex::new(grammar) }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Grammar> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyGrammar {
    /// An independent copy with the same parse state.
    fn clone(&self) -> PyResult<PyGrammar> {
        Ok(PyGrammar::from_core(self.lock().try_clone().py()?))
    }

    /// Set every forbidden token to ``-inf`` in ``logits`` (float32, length n_vocab), in place.
    fn apply(&self, py: Python<'_>, mut logits: PyReadwriteArray1<'_, f32>) -> PyResult<()> {
        let slice = logits.as_slice_mut()?;
        py.detach(|| self.lock().mask(slice)).py()
    }

    /// Advance past ``token``; a forbidden token raises ``GrammarError`` (state unchanged).
    fn accept(&self, token: i64) -> PyResult<()> {
        let t = i32::try_from(token).unwrap_or(-1);
        self.lock().accept(t).py()
    }

    /// Whether ``token`` may come next.
    fn allows(&self, token: i64) -> bool {
        i32::try_from(token).map(|t| self.lock().allows(t)).unwrap_or(false)
    }

    /// Back to the start rule.
    fn reset(&self) {
        self.lock().reset()
    }

    /// The GBNF rules.
    #[getter]
    fn gbnf(&self) -> String {
        self.lock().source().gbnf.clone()
    }

    /// The start rule's name.
    #[getter]
    fn root(&self) -> String {
        self.lock().source().root.clone()
    }

    fn __repr__(&self) -> String {
        format!("Grammar(root={:?})", self.lock().source().root)
    }
}

/// GBNF (start rule ``root``) for a JSON schema given as JSON text.
#[pyfunction]
pub fn json_schema_to_grammar(py: Python<'_>, schema: String) -> PyResult<String> {
    detached(py, move || lloyal_core::json_schema_to_grammar(&schema))
}
