//! Embeddings glue: text arguments in, float32 numpy arrays out (logic in lloyal-core).

use lloyal_core::embeddings::Encoded;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyString;

/// `str` -> one text (and a 1-D result); any other iterable of `str` -> many.
pub fn extract_texts(texts: &Bound<'_, PyAny>) -> PyResult<(Vec<String>, bool)> {
    if let Ok(s) = texts.cast::<PyString>() {
        return Ok((vec![s.to_str()?.to_owned()], true));
    }
    Ok((texts.extract()?, false))
}

/// `rows` x `dim` floats as a float32 array: `(dim,)` when `flat`, else `(rows, dim)`.
pub fn to_array(py: Python<'_>, encoded: Encoded, flat: bool) -> PyResult<Bound<'_, PyAny>> {
    let Encoded { rows, dim, values } = encoded;
    let arr = PyArray1::from_vec(py, values);
    if flat {
        return Ok(arr.into_any());
    }
    Ok(arr.reshape([rows, dim])?.into_any())
}
