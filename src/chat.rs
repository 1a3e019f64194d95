//! Chat glue: Python messages/tools to JSON, core results to the `lloyal.chat` dataclasses.

use lloyal_core::chat::{parse_chat_output, FormattedChat};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::detach::without_gil;

/// `json.dumps(value)` (NaN/inf refused), with `what` named in the error.
fn dumps(py: Python<'_>, value: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("allow_nan", false)?;
    match py.import("json")?.call_method("dumps", (value,), Some(&kwargs)) {
        Ok(s) => s.extract(),
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            Err(PyTypeError::new_err(format!("{what} must be JSON-serialisable: {}", e.value(py))))
        }
        Err(e) => Err(PyValueError::new_err(format!("{what}: {}", e.value(py)))),
    }
}

/// A list (or tuple) of dicts as a JSON array; TypeError for any other shape.
fn list_of_dicts_json(py: Python<'_>, value: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = value.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = value.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list of dicts, got {}",
            value.get_type().name()?
        )));
    };
    for (i, item) in items.iter().enumerate() {
        if !item.is_instance_of::<PyDict>() {
            return Err(PyTypeError::new_err(format!(
                "{what}[{i}] must be a dict, got {}",
                item.get_type().name()?
            )));
        }
    }
    dumps(py, value, what)
}

/// `messages` (list of dicts with role/content) as JSON.
pub fn messages_json(py: Python<'_>, messages: &Bound<'_, PyAny>) -> PyResult<String> {
    list_of_dicts_json(py, messages, "messages")
}

/// One message dict as JSON.
pub fn message_json(py: Python<'_>, message: &Bound<'_, PyAny>) -> PyResult<String> {
    if !message.is_instance_of::<PyDict>() {
        return Err(PyTypeError::new_err(format!(
            "message must be a dict with 'role' and 'content', got {}",
            message.get_type().name()?
        )));
    }
    dumps(py, message, "message")
}

/// `tools` (None or a list of dicts) as JSON.
pub fn tools_json(py: Python<'_>, tools: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    match tools.filter(|t| !t.is_none()) {
        Some(tools) => list_of_dicts_json(py, tools, "tools").map(Some),
        None => Ok(None),
    }
}

/// `format_chat`'s extra keyword arguments as one JSON object (None when there are none).
pub fn template_vars_json(py: Python<'_>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Option<String>> {
    match kwargs.filter(|k| !k.is_empty()) {
        Some(k) => dumps(py, k.as_any(), "template variables").map(Some),
        None => Ok(None),
    }
}

/// A core [`FormattedChat`] as a `lloyal.chat.FormattedChat`.
pub fn formatted_to_py(py: Python<'_>, f: FormattedChat) -> PyResult<Py<PyAny>> {
    let cls = py.import("lloyal.chat")?.getattr("FormattedChat")?;
    let stop = PyTuple::new(py, f.stop_tokens)?;
    Ok(cls.call1((f.prompt, stop, f.template_source))?.unbind())
}

/// Native part of `lloyal.parse_chat_output`: `(content, reasoning_content, [(name, arguments_json)])`.
#[pyfunction(name = "_parse_chat_output")]
pub fn parse_chat_output_native(
    py: Python<'_>,
    text: &str,
) -> (String, Option<String>, Vec<(String, String)>) {
    let text = text.to_owned();
    let out = without_gil(py, move || parse_chat_output(&text));
    let calls = out.tool_calls.into_iter().map(|c| (c.name, c.arguments.to_string())).collect();
    (out.content, out.reasoning_content, calls)
}

/// The markers `parse_chat_output` acts on: `(end-of-turn markers it removes, markers from which
/// text may be reasoning or a tool call)`.
#[pyfunction(name = "_chat_markers")]
pub fn chat_markers() -> (Vec<&'static str>, Vec<&'static str>) {
    (lloyal_core::chat::END_MARKERS.to_vec(), lloyal_core::chat::STRUCTURE_MARKERS.to_vec())
}
