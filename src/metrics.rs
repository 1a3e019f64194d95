//! `lloyal.PerplexityTracker`: a running perplexity over surprisals (nats).

use std::sync::Mutex;

use lloyal_core::PerplexityTracker;
use pyo3::prelude::*;

/// Running perplexity ``exp(mean surprisal)``; ``inf`` before any observation.
#[pyclass(name = "PerplexityTracker", module = "lloyal._lloyal", frozen)]
pub struct PyPerplexityTracker {
    inner: Mutex<PerplexityTracker>,
}

impl PyPerplexityTracker {
    fn get(&self) -> std::sync::MutexGuard<'_, PerplexityTracker> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn from_core(t: PerplexityTracker) -> Self {
        PyPerplexityTracker { inner: Mutex::new(t) }
    }
}

#[pymethods]
impl PyPerplexityTracker {
    #[new]
    fn new() -> Self {
        Self::from_core(PerplexityTracker::new())
    }

    /// Record one token's surprisal in nats (see ``model_surprisal``): ``>= 0`` (``inf`` for an
    /// impossible token); NaN or a negative value raises ``ValueError``.
    fn add_surprisal(&self, surprisal: f64) -> PyResult<()> {
        if surprisal.is_nan() || surprisal < 0.0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "a surprisal is -log p >= 0 (inf for an impossible token), got {surprisal}"
            )));
        }
        self.get().add(surprisal);
        Ok(())
    }

    /// ``exp(mean surprisal)``, ``inf`` when empty.
    #[getter]
    fn perplexity(&self) -> f64 {
        self.get().perplexity()
    }

    /// Number of surprisals recorded.
    #[getter]
    fn count(&self) -> u64 {
        self.get().count()
    }

    /// An independent copy.
    fn clone(&self) -> Self {
        Self::from_core(self.get().clone())
    }

    /// Forget every observation.
    fn reset(&self) {
        self.get().reset();
    }

    fn __repr__(&self) -> String {
        let t = self.get();
        format!("PerplexityTracker(perplexity={}, count={})", t.perplexity(), t.count())
    }
}
