//! `lloyal._lloyal`: the thin PyO3 layer over lloyal-core. Logic lives in the core; each
//! class here converts arguments, runs core work through `detach::run`, converts results.

mod admission;
mod aio;
mod backend;
mod branch;
mod cache;
mod chat;
mod context;
mod convert;
mod cpu;
mod detach;
mod embeddings;
mod engine;
mod error;
mod exit;
mod generate;
mod grammar;
mod lease;
mod lora;
mod metrics;
mod model;
mod sampling;
mod store;
mod text;
mod waker;
mod wrap;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _lloyal(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Portable builds pick their CPU backend at run time (feature `portable`, the wheels).
    m.add("PORTABLE", cfg!(feature = "portable"))?;
    m.add("BUILD_CPU", cpu::build_cpu())?;
    // The backend folder the package set for this process, read before it removes the variable.
    lloyal_core::backend::backends_dir();
    m.add_class::<model::PyModel>()?;
    m.add_class::<lora::PyLoraAdapter>()?;
    m.add_class::<context::PyContext>()?;
    m.add_class::<metrics::PyPerplexityTracker>()?;
    m.add_class::<text::PyTextStream>()?;
    m.add_class::<branch::PyBranch>()?;
    m.add_class::<branch::PyProduced>()?;
    m.add_class::<generate::PyToken>()?;
    m.add_class::<generate::PyTokenIter>()?;
    #[cfg(unix)]
    m.add_class::<waker::PyLoopWaker>()?;
    m.add_class::<store::PyBranchStore>()?;
    m.add_class::<store::PyKvPressure>()?;
    m.add_class::<engine::PyEngineStats>()?;
    m.add_class::<grammar::PyGrammar>()?;
    cache::register(m)?;
    admission::register(m)?;
    m.add_function(wrap_pyfunction!(backend::system_info, m)?)?;
    m.add_function(wrap_pyfunction!(exit::quiesce_callbacks, m)?)?;
    m.add_function(wrap_pyfunction!(sampling::validate_sampling_params, m)?)?;
    m.add_function(wrap_pyfunction!(grammar::json_schema_to_grammar, m)?)?;
    m.add_function(wrap_pyfunction!(chat::parse_chat_output_native, m)?)?;
    m.add_function(wrap_pyfunction!(chat::chat_markers, m)?)?;
    m.add_function(wrap_pyfunction!(model::check_model_file, m)?)?;
    Ok(())
}
