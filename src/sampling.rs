//! Reads Python sampling parameters (the `lloyal.SamplingParams` dataclass, a dict, or
//! keyword overrides) into the core's `SamplingParams`.

use lloyal_core::{Dry, Mirostat, SamplingParams, Xtc};
use pyo3::exceptions::{PyTypeError, PyValueError};
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

const MIROSTAT_FIELDS: &[&str] = &["version", "tau", "eta"];
const DRY_FIELDS: &[&str] = &["multiplier", "base", "allowed_length", "penalty_last_n", "sequence_breakers"];
const XTC_FIELDS: &[&str] = &["probability", "threshold", "min_keep"];

/// `repeatPenalty` -> `repeat_penalty`.
fn snake_case(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 4);
    for c in key.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The `ValueError` for an unknown key `key` of a `what` dict whose valid keys are `valid`.
fn unknown_key(what: &str, key: &str, valid: &[&str]) -> PyErr {
    let hint = match key {
        "penalties" => " (the original project's nested shape; lloyal takes flat keys: \
                        repeat_penalty, frequency_penalty, presence_penalty, penalty_last_n)"
            .to_string(),
        "advanced" => " (the original project's nested shape; lloyal takes flat keys: typical_p, \
                       mirostat, dry, xtc)"
            .to_string(),
        _ => {
            let snake = snake_case(key);
            if snake != key && valid.contains(&snake.as_str()) {
                format!("; did you mean '{snake}'? (lloyal spells sampling keys in snake_case)")
            } else {
                String::new()
            }
        }
    };
    PyValueError::new_err(format!("unknown {what} key '{key}'{hint}; valid keys: {}", valid.join(", ")))
}

/// Refuse a dict carrying a key outside `valid` (a typo or another library's spelling would
/// otherwise be silently ignored). Non-dict objects are read by attribute and not checked.
fn check_keys(obj: &Bound<'_, PyAny>, what: &str, valid: &[&str]) -> PyResult<()> {
    if let Ok(d) = obj.cast::<PyDict>() {
        for k in d.keys() {
            let key: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err(format!("{what} keys must be strings, got {k:?}")))?;
            if !valid.contains(&key.as_str()) {
                return Err(unknown_key(what, &key, valid));
            }
        }
    }
    Ok(())
}

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
    check_keys(v, "mirostat", MIROSTAT_FIELDS)?;
    let d = Mirostat::default();
    Ok(Mirostat {
        version: get(v, "version", d.version)?,
        tau: get(v, "tau", d.tau)?,
        eta: get(v, "eta", d.eta)?,
    })
}

fn dry(v: &Bound<'_, PyAny>) -> PyResult<Dry> {
    check_keys(v, "dry", DRY_FIELDS)?;
    let d = Dry::default();
    Ok(Dry {
        multiplier: get(v, "multiplier", d.multiplier)?,
        base: get(v, "base", d.base)?,
        allowed_length: get(v, "allowed_length", d.allowed_length)?,
        penalty_last_n: get(v, "penalty_last_n", d.penalty_last_n)?,
        sequence_breakers: get(v, "sequence_breakers", d.sequence_breakers)?,
    })
}

fn xtc(v: &Bound<'_, PyAny>) -> PyResult<Xtc> {
    check_keys(v, "xtc", XTC_FIELDS)?;
    let d = Xtc::default();
    Ok(Xtc {
        probability: get(v, "probability", d.probability)?,
        threshold: get(v, "threshold", d.threshold)?,
        min_keep: get(v, "min_keep", d.min_keep)?,
    })
}

fn extract_as<'py, T: FromPyObjectOwned<'py>>(key: &str, value: &Bound<'py, PyAny>) -> PyResult<T> {
    value.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(value.py()) {
            // the right type, out of the field's range (a seed past 32 bits, a negative top_k)
            return pyo3::exceptions::PyValueError::new_err(format!(
                "sampling parameter {key} = {value} is out of range ({e})"
            ));
        }
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
        "mirostat" => {
            p.mirostat = if none { None } else { Some(mirostat(check_part(value, "mirostat", "Mirostat")?)?) }
        }
        "dry" => p.dry = if none { None } else { Some(dry(check_part(value, "dry", "Dry")?)?) },
        "xtc" => p.xtc = if none { None } else { Some(xtc(check_part(value, "xtc", "Xtc")?)?) },
        other => {
            let snake = snake_case(other);
            let hint = if snake != other && FIELDS.contains(&snake.as_str()) {
                format!("; did you mean '{snake}'?")
            } else {
                String::new()
            };
            return Err(PyTypeError::new_err(format!(
                "unknown sampling parameter '{other}'{hint}; valid names: {}",
                FIELDS.join(", ")
            )));
        }
    }
    Ok(())
}

/// Refuse a `mirostat`/`dry`/`xtc` value that is neither a `lloyal.<class>` nor a dict of its
/// fields: a number or a flag (llama-cpp-python's `mirostat_mode=0` meaning "off") would
/// otherwise be read as the sampler with its defaults, turned on.
fn check_part<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    what: &str,
    class: &str,
) -> PyResult<&'a Bound<'py, PyAny>> {
    if obj.cast::<PyDict>().is_ok()
        || obj.is_instance(&obj.py().import("lloyal.sampling")?.getattr(class)?)?
    {
        return Ok(obj);
    }
    Err(PyTypeError::new_err(format!(
        "{what} must be a lloyal.{class}, a dict of its fields, or None (off); got {} {}",
        obj.get_type().name()?,
        obj.repr()?
    )))
}

/// Refuse sampling parameters that are neither a `lloyal.SamplingParams` (or a subclass's
/// instance) nor a dict of its fields: any other object (a number, a string, the class itself,
/// a namespace with a misspelt field) would be read as the defaults.
fn check_params_type(obj: &Bound<'_, PyAny>) -> PyResult<()> {
    if obj.cast::<PyDict>().is_ok() {
        return Ok(());
    }
    let class = obj.py().import("lloyal.sampling")?.getattr("SamplingParams")?;
    if obj.is_instance(&class)? {
        return Ok(());
    }
    let kind = if obj.is_instance_of::<pyo3::types::PyType>() {
        format!("the class {} (call it: SamplingParams(...))", obj.str()?)
    } else {
        obj.get_type().name()?.to_string()
    };
    Err(PyTypeError::new_err(format!(
        "sampling parameters must be a lloyal.SamplingParams or a dict of its fields, got {kind}"
    )))
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
        check_params_type(obj)?;
        check_keys(obj, "sampling parameter", FIELDS)?;
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
