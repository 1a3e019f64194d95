//! The one error map: core `LloyalError` variants to the exception classes of `lloyal.errors`.

use lloyal_core::LloyalError;
use pyo3::exceptions::{PyKeyboardInterrupt, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The exception classes of `lloyal.errors`, resolved once (at the first error) into typed
/// fields, so raising one is a field read, not a lookup by name.
struct Classes {
    base: Py<PyType>,
    model_load: Py<PyType>,
    context_closed: Py<PyType>,
    decode: Py<PyType>,
    kv_cache_full: Py<PyType>,
    branch_disposed: Py<PyType>,
    lease_exhausted: Py<PyType>,
    topology: Py<PyType>,
    seq_leased: Py<PyType>,
    invalid_token: Py<PyType>,
    grammar: Py<PyType>,
    state: Py<PyType>,
    chat_template: Py<PyType>,
    out_of_memory: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

fn classes(py: Python<'_>) -> PyResult<&Classes> {
    CLASSES.get_or_try_init(py, || {
        let module = py.import("lloyal.errors")?;
        let get = |name: &str| -> PyResult<Py<PyType>> {
            Ok(module.getattr(name)?.cast_into::<PyType>()?.unbind())
        };
        Ok(Classes {
            base: get("LloyalError")?,
            model_load: get("ModelLoadError")?,
            context_closed: get("ContextClosedError")?,
            decode: get("DecodeError")?,
            kv_cache_full: get("KvCacheFullError")?,
            branch_disposed: get("BranchDisposedError")?,
            lease_exhausted: get("LeaseExhaustedError")?,
            topology: get("TopologyError")?,
            seq_leased: get("SeqLeasedError")?,
            invalid_token: get("InvalidTokenError")?,
            grammar: get("GrammarError")?,
            state: get("StateError")?,
            chat_template: get("ChatTemplateError")?,
            out_of_memory: get("OutOfMemoryError")?,
        })
    })
}

/// The `lloyal.errors` class for a core error (None: a builtin exception).
fn class_of<'c>(c: &'c Classes, err: &LloyalError) -> Option<&'c Py<PyType>> {
    Some(match err {
        LloyalError::ModelLoad { .. } | LloyalError::LoraLoad { .. } => &c.model_load,
        LloyalError::ContextClosed => &c.context_closed,
        LloyalError::Decode { .. } => &c.decode,
        LloyalError::KvCacheFull { .. } => &c.kv_cache_full,
        LloyalError::BranchDisposed { .. } => &c.branch_disposed,
        LloyalError::LeaseExhausted { .. }
        | LloyalError::LeasesHoldFlatCells { .. }
        | LloyalError::LeaseWaitTimedOut { .. } => &c.lease_exhausted,
        LloyalError::Topology(_) => &c.topology,
        LloyalError::SeqLeased { .. } => &c.seq_leased,
        LloyalError::InvalidToken { .. } => &c.invalid_token,
        LloyalError::Grammar(_) => &c.grammar,
        LloyalError::State(_) => &c.state,
        LloyalError::ChatTemplate(_) => &c.chat_template,
        LloyalError::OutOfMemory(_) => &c.out_of_memory,
        LloyalError::NoLogits | LloyalError::SamplingPerplexityOff | LloyalError::Backend(_) => &c.base,
        LloyalError::InvalidArgument(_) | LloyalError::Interrupted => return None,
    })
}

/// Convert a core error into the matching Python exception.
pub fn to_py(err: LloyalError) -> PyErr {
    let message = err.to_string();
    match err {
        LloyalError::Interrupted => PyKeyboardInterrupt::new_err(message),
        LloyalError::InvalidArgument(_) => PyValueError::new_err(message),
        _ => Python::attach(|py| match classes(py) {
            Ok(c) => match class_of(c, &err) {
                Some(cls) => PyErr::from_type(cls.bind(py).clone(), message),
                None => PyValueError::new_err(message),
            },
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
