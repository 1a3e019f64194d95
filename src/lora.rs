//! `lloyal.LoraAdapter`: a LoRA adapter loaded for a model (`Model.load_lora`), and the
//! `lora=` argument of `Context`.

use std::path::PathBuf;
use std::sync::Arc;

use lloyal_core::lora::{LoraAdapter, LoraUse};
use lloyal_core::Model;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyMapping, PyTuple};

use crate::detach::detached;

/// A LoRA adapter loaded for one :class:`Model` (``model.load_lora(path)``); a context applies
/// it to every token it decodes when created with ``Context(model, lora=[adapter])``.
///
/// A path loaded twice for the same model gives the same adapter (a new one when the file changed
/// in between). It holds its model's weights alive, and the file's metadata (``meta``) can be
/// read back. ``Context(model, lora=[(adapter, 0.5)])`` applies it at half its strength.
#[pyclass(name = "LoraAdapter", module = "lloyal._lloyal", frozen)]
pub struct PyLoraAdapter {
    pub(crate) inner: Arc<LoraAdapter>,
}

impl PyLoraAdapter {
    /// Load `path` for `model` with the GIL released (one adapter per model and file).
    pub(crate) fn load(py: Python<'_>, model: &Arc<Model>, path: PathBuf) -> PyResult<Self> {
        let model = Arc::clone(model);
        let inner = detached(py, move || LoraAdapter::load(&model, &path))?;
        Ok(PyLoraAdapter { inner })
    }
}

#[pymethods]
impl PyLoraAdapter {
    /// The adapter file (absolute).
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_path_buf()
    }

    /// ``adapter.lora.alpha`` from the file (0.0 when absent). llama.cpp multiplies the
    /// adapter's delta by ``scale * alpha / rank``, or by ``scale`` alone when alpha is 0.
    #[getter]
    fn alpha(&self) -> f32 {
        self.inner.alpha()
    }

    /// A GGUF metadata value of the adapter file as a string, or None.
    fn meta(&self, key: &str) -> Option<String> {
        self.inner.meta(key)
    }

    /// The same adapter: loaded for the same model from the same file.
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyLoraAdapter>().is_ok_and(|o| Arc::ptr_eq(&o.get().inner, &self.inner))
    }

    fn __hash__(&self) -> u64 {
        Arc::as_ptr(&self.inner) as usize as u64
    }

    fn __repr__(&self) -> String {
        format!(
            "LoraAdapter(path={:?}, alpha={})",
            self.inner.path().display().to_string(),
            self.inner.alpha()
        )
    }
}

/// Read `Context(lora=...)`: a sequence whose items are an adapter, a path (loaded for
/// `model`), or an ``(adapter or path, scale)`` pair; scale 1.0 when not given.
pub(crate) fn lora_uses(
    py: Python<'_>,
    model: &Arc<Model>,
    lora: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<LoraUse>> {
    let Some(lora) = lora else { return Ok(Vec::new()) };
    if lora.is_instance_of::<pyo3::types::PyString>()
        || lora.cast::<PyLoraAdapter>().is_ok()
        || lora.cast::<PyMapping>().is_ok()
    {
        return Err(PyTypeError::new_err(
            "lora must be a list of adapters, paths or (adapter, scale) pairs, e.g. lora=[adapter] or \
             lora=[('adapter.gguf', 0.5)]",
        ));
    }
    let mut out = Vec::new();
    for (i, item) in lora.try_iter()?.enumerate() {
        let item = item?;
        let (what, scale) = match item.cast::<PyTuple>() {
            Ok(pair) if pair.len() == 2 => (pair.get_item(0)?, scale_of(i, &pair.get_item(1)?)?),
            Ok(_) => {
                return Err(PyTypeError::new_err(format!(
                    "lora[{i}]: a pair is (adapter or path, scale), got a tuple of {} items",
                    item.len()?
                )))
            }
            Err(_) => (item, 1.0),
        };
        let adapter = match what.cast::<PyLoraAdapter>() {
            Ok(a) => Arc::clone(&a.get().inner),
            Err(_) => {
                let path: PathBuf = what.extract().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "lora[{i}]: expected a LoraAdapter or a path, got {}",
                        what.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                    ))
                })?;
                PyLoraAdapter::load(py, model, path)?.inner
            }
        };
        out.push(LoraUse { adapter, scale });
    }
    Ok(out) // checked against the model by Context::new (lloyal_core::lora::check)
}

/// The scale of `lora[i]` as the context holds it (f32); a value beyond f32's range is refused
/// with the value given (it would read as infinite).
fn scale_of(i: usize, scale: &Bound<'_, PyAny>) -> PyResult<f32> {
    let value: f64 = scale
        .extract()
        .map_err(|_| PyTypeError::new_err(format!("lora[{i}]: the scale must be a number")))?;
    if value.is_finite() && value.abs() > f64::from(f32::MAX) {
        return Err(PyValueError::new_err(format!(
            "lora[{i}]: the scale {value:e} is beyond the range of a float32 (about ±3.4e38), which \
             llama.cpp scales adapters with"
        )));
    }
    Ok(value as f32) // NaN and infinities are refused with the adapter's path (lora::check)
}
