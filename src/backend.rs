//! `lloyal.system_info()`: what llama.cpp was built with and the CPU backend it runs.

use pyo3::prelude::*;

use crate::detach::without_gil;

/// The backends llama.cpp runs on and their CPU features, as llama.cpp reports them.
#[pyfunction]
pub fn system_info(py: Python<'_>) -> String {
    without_gil(py, lloyal_core::backend::system_info)
}
