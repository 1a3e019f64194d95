//! Reads Python sampling parameters (the `lloyal.SamplingParams` dataclass, a dict, or
//! keyword overrides) into the core's `SamplingParams`.

use lloyal_core::{Dry, Mirostat, SamplingParams, Xtc};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::narrow;
use crate::error::IntoPyResult;

const FIELDS: &[&str] = &[
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "penalty_last_n",
    "seed",
    "mirostat",
    "dry",
    "xtc",
];

/// `obj.name` for objects, `obj[name]` for dicts; `None` when absent.
fn field<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    if let Ok(d) = obj.cast::<PyDict>() {
        return d.get_item(name);
    }
    if obj.hasattr(name)? {
        return Ok(Some(obj.getattr(name)?));
    }
    Ok(None)
}

fn get<'py, T: FromPyObjectOwned<'py>>(obj: &Bound<'py, PyAny>, name: &str, default: T) -> PyResult<T> {
    match field(obj, name)? {
        Some(v) => extract_as(name, &v),
        None => Ok(default),
    }
}

fn mirostat(v: &Bound<'_, PyAny>) -> PyResult<Mirostat> {
    Ok(Mirostat {
        version: get(v, "version", 2u8)?,
        tau: get(v, "tau", 5.0f32)?,
        eta: get(v, "eta", 0.1f32)?,
    })
}

fn dry(v: &Bound<'_, PyAny>) -> PyResult<Dry> {
    let default_breakers: Vec<String> = ["\n", ":", "\"", "*"].iter().map(|s| s.to_string()).collect();
    Ok(Dry {
        multiplier: get(v, "multiplier", 0.8f32)?,
        base: get(v, "base", 1.75f32)?,
        allowed_length: get(v, "allowed_length", 2i32)?,
        penalty_last_n: get(v, "penalty_last_n", -1i32)?,
        sequence_breakers: get(v, "sequence_breakers", default_breakers)?,
    })
}

fn xtc(v: &Bound<'_, PyAny>) -> PyResult<Xtc> {
    Ok(Xtc {
        probability: get(v, "probability", 0.5f32)?,
        threshold: get(v, "threshold", 0.1f32)?,
        min_keep: get(v, "min_keep", 1usize)?,
    })
}

fn extract_as<'py, T: FromPyObjectOwned<'py>>(key: &str, value: &Bound<'py, PyAny>) -> PyResult<T> {
    value.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        PyTypeError::new_err(format!("sampling parameter {key}: {e}"))
    })
}

fn set_field(p: &mut SamplingParams, key: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
    let none = value.is_none();
    match key {
        "temperature" => p.temperature = extract_as(key, value)?,
        "top_k" => p.top_k = extract_as(key, value)?,
        "top_p" => p.top_p = extract_as(key, value)?,
        "min_p" => p.min_p = extract_as(key, value)?,
        "typical_p" => p.typical_p = extract_as(key, value)?,
        "repeat_penalty" => p.repeat_penalty = extract_as(key, value)?,
        "frequency_penalty" => p.frequency_penalty = extract_as(key, value)?,
        "presence_penalty" => p.presence_penalty = extract_as(key, value)?,
        "penalty_last_n" => p.penalty_last_n = extract_as(key, value)?,
        "seed" => {
            let seed: Option<i64> = extract_as(key, value)?;
            p.seed = seed.map(|s| narrow("seed", s, "in 0..=4294967295 (or None)")).transpose()?;
        }
        "mirostat" => p.mirostat = if none { None } else { Some(mirostat(value)?) },
        "dry" => p.dry = if none { None } else { Some(dry(value)?) },
        "xtc" => p.xtc = if none { None } else { Some(xtc(value)?) },
        other => {
            return Err(PyTypeError::new_err(format!(
                "unknown sampling parameter {other:?}; valid names: {}",
                FIELDS.join(", ")
            )))
        }
    }
    Ok(())
}

/// Build validated core parameters from an optional params object plus keyword overrides.
pub fn extract_params(
    params: Option<&Bound<'_, PyAny>>,
    overrides: Option<&Bound<'_, PyDict>>,
) -> PyResult<SamplingParams> {
    extract_params_onto(SamplingParams::default(), params, overrides)
}

/// Like [`extract_params`], starting from `base` (the fields `params`/`overrides` leave alone).
pub fn extract_params_onto(
    base: SamplingParams,
    params: Option<&Bound<'_, PyAny>>,
    overrides: Option<&Bound<'_, PyDict>>,
) -> PyResult<SamplingParams> {
    let mut p = base;
    if let Some(obj) = params.filter(|o| !o.is_none()) {
        for name in FIELDS {
            if let Some(v) = field(obj, name)? {
                set_field(&mut p, name, &v)?;
            }
        }
    }
    if let Some(kw) = overrides {
        for (k, v) in kw.iter() {
            let key: String = k.extract()?;
            set_field(&mut p, &key, &v)?;
        }
    }
    p.validate().py()?;
    Ok(p)
}

/// Raise ``ValueError``/``TypeError`` if ``params`` is not a valid set of sampling parameters.
#[pyfunction]
pub fn validate_sampling_params(params: &Bound<'_, PyAny>) -> PyResult<()> {
    extract_params(Some(params), None).map(|_| ())
}
