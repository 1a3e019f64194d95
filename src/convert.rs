//! Argument conversions: numpy arrays, ints narrowed with the argument named, token ids.

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

/// A Python int argument narrowed to ``T``; out of range is a ``ValueError`` naming the argument
/// (pyo3's own narrowing raises ``OverflowError`` with no name).
pub fn narrow<T: TryFrom<i64>>(name: &str, value: i64, expected: &str) -> PyResult<T> {
    T::try_from(value).map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!("{name} must be {expected}, got {value}"))
    })
}

/// A Python int argument as ``T``: ``narrow`` for an int of any size (one past 64 bits, which
/// pyo3 raises as a bare ``OverflowError``, is a ``ValueError`` naming the argument too).
pub fn int_arg<T: TryFrom<i64>>(name: &str, value: &Bound<'_, PyAny>, expected: &str) -> PyResult<T> {
    match value.extract::<i64>() {
        Ok(v) => narrow(name, v, expected),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(value.py()) => {
            Err(pyo3::exceptions::PyValueError::new_err(format!("{name} must be {expected}, got {value}")))
        }
        Err(e) => Err(e),
    }
}

/// A seq id or position past 32 bits, clamped so the core's range check (which names the valid
/// range, e.g. ``n_seq_max``) rejects it instead of pyo3 raising a bare ``OverflowError``.
pub fn clamp_i32(value: i64) -> i32 {
    value.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32
}

/// A token id argument: any Python int. One past 64 bits becomes the nearest 64-bit value,
/// outside every vocabulary, so the core's check raises ``InvalidTokenError`` for it as for
/// any other id out of range (pyo3's own extraction raised a bare ``OverflowError``).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TokenId(pub i64);

impl<'a, 'py> FromPyObject<'a, 'py> for TokenId {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<i64>() {
            Ok(v) => Ok(TokenId(v)),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => {
                Ok(TokenId(if obj.lt(0)? { i64::MIN } else { i64::MAX }))
            }
            Err(e) => Err(e),
        }
    }
}

impl std::ops::Deref for TokenId {
    type Target = i64;

    fn deref(&self) -> &i64 {
        &self.0
    }
}

/// A list of token ids (each as [`TokenId`]), read as the ``Vec<i64>`` it derefs to.
#[derive(Clone, Debug, Default)]
pub struct Tokens(pub Vec<i64>);

impl<'a, 'py> FromPyObject<'a, 'py> for Tokens {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<Vec<i64>>() {
            Ok(ids) => Ok(Tokens(ids)),
            // an id past 64 bits: read again id by id, saturating (the rare path)
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => {
                let ids: Vec<TokenId> = obj.extract()?;
                Ok(Tokens(ids.into_iter().map(|t| t.0).collect()))
            }
            Err(e) => Err(e),
        }
    }
}

impl std::ops::Deref for Tokens {
    type Target = Vec<i64>;

    fn deref(&self) -> &Vec<i64> {
        &self.0
    }
}
