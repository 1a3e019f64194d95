//! The one error map: core `LloyalError` variants to the exception classes of `lloyal.errors`.

use lloyal_core::LloyalError;
use pyo3::exceptions::{PyKeyboardInterrupt, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

static ERRORS_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    let module = ERRORS_MODULE.get_or_try_init(py, || py.import("lloyal.errors").map(Bound::unbind))?;
    Ok(module.bind(py).getattr(name)?.cast_into::<PyType>()?)
}

/// The `lloyal.errors` class name for a core error (None: a builtin exception).
fn class_name(err: &LloyalError) -> Option<&'static str> {
    Some(match err {
        LloyalError::ModelLoad { .. } => "ModelLoadError",
        LloyalError::ContextClosed => "ContextClosedError",
        LloyalError::Decode { .. } => "DecodeError",
        LloyalError::KvCacheFull { .. } => "KvCacheFullError",
        LloyalError::BranchDisposed { .. } => "BranchDisposedError",
        LloyalError::LeaseExhausted { .. } | LloyalError::LeasesHoldFlatCells { .. } => "LeaseExhaustedError",
        LloyalError::Topology(_) => "TopologyError",
        LloyalError::SeqLeased { .. } => "SeqLeasedError",
        LloyalError::InvalidToken { .. } => "InvalidTokenError",
        LloyalError::Grammar(_) => "GrammarError",
        LloyalError::State(_) => "StateError",
        LloyalError::ChatTemplate(_) => "ChatTemplateError",
        LloyalError::NoLogits | LloyalError::Backend(_) => "LloyalError",
        LloyalError::InvalidArgument(_) | LloyalError::Interrupted => return None,
    })
}

/// Convert a core error into the matching Python exception.
pub fn to_py(err: LloyalError) -> PyErr {
    let message = err.to_string();
    match (&err, class_name(&err)) {
        (LloyalError::Interrupted, _) => PyKeyboardInterrupt::new_err(message),
        (_, None) => PyValueError::new_err(message),
        (_, Some(name)) => Python::attach(|py| match class(py, name) {
            Ok(cls) => PyErr::from_type(cls, message),
            Err(import_err) => import_err,
        }),
    }
}

/// `Result` extension: `.py()?` converts a core result into a `PyResult`.
pub trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, LloyalError> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
