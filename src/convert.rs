//! numpy conversions.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A float32 array that Python cannot write to (a snapshot; writes raise ValueError).
pub fn readonly_f32(py: Python<'_>, values: Vec<f32>) -> PyResult<Bound<'_, PyArray1<f32>>> {
    let arr = PyArray1::from_vec(py, values);
    let kwargs = PyDict::new(py);
    kwargs.set_item("write", false)?;
    arr.call_method("setflags", (), Some(&kwargs))?;
    Ok(arr)
}
