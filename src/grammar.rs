//! `Grammar` handles (GBNF, JSON schema, Lark, regex) and `json_schema_to_grammar`.

use std::sync::{Arc, Mutex, MutexGuard};

use lloyal_core::{GbnfEngineChoice, Grammar, GrammarKind, GrammarSource, Model};
use numpy::PyReadwriteArray1;
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::context::PyContext;
use crate::convert::TokenId;
use crate::detach::detached;
use crate::error::IntoPyResult;
use crate::model::PyModel;

/// A grammar's parse state: mask logits with ``apply``, advance with ``accept``.
///
/// Every kind runs on llguidance (the mask is applied before every sample): GBNF is translated
/// with its meaning kept, and runs on llama.cpp's grammar engine only when asked
/// (``from_gbnf(..., engine="llama.cpp")``) or when it uses a construct llguidance cannot express
/// (a ``GrammarEngineWarning`` names it; ``engine`` and ``fallback`` say so afterwards).
///
/// Example:
///     >>> g = Grammar.from_json_schema(ctx, {"type": "boolean"})
///     >>> logits = ctx.get_logits().copy()
///     >>> g.apply(logits)  # forbidden tokens become -inf
///     >>> g.allows(ctx.tokenize("true", add_special=False)[0])
///     True
///     >>> g.kind
///     'json_schema'
#[pyclass(name = "Grammar", module = "lloyal._lloyal", frozen)]
pub struct PyGrammar {
    inner: Mutex<Grammar>,
}

impl PyGrammar {
    /// GBNF on the engine `engine` picks; a fallback to llama.cpp's engine is warned about
    /// (`lloyal.GrammarEngineWarning`, naming the construct llguidance cannot express).
    pub(crate) fn parse(
        py: Python<'_>,
        model: Arc<Model>,
        gbnf: String,
        root: String,
        engine: GbnfEngineChoice,
    ) -> PyResult<Grammar> {
        let source = GrammarSource { kind: GrammarKind::Gbnf, text: gbnf, root, engine };
        let grammar = detached(py, move || Grammar::compile(model, source))?;
        if let Some(reason) = grammar.fallback() {
            let category = py.import("lloyal.errors")?.getattr("GrammarEngineWarning")?;
            let message = format!(
                "this GBNF grammar runs on llama.cpp's grammar engine (slower, checks each sampled \
                 token) because llguidance cannot express it: {reason}"
            );
            PyErr::warn(py, &category, &std::ffi::CString::new(message).unwrap_or_default(), 2)?;
        }
        Ok(grammar)
    }

    pub(crate) fn from_core(grammar: Grammar) -> Self {
        PyGrammar { inner: Mutex::new(grammar) }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Grammar> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn compile(py: Python<'_>, target: &Bound<'_, PyAny>, kind: GrammarKind, text: String) -> PyResult<Self> {
        let model = model_of(target)?;
        let source = GrammarSource { kind, text, root: String::new(), engine: Default::default() };
        Ok(PyGrammar::from_core(detached(py, move || Grammar::compile(model, source))?))
    }
}

/// The model behind a `Context` or `Model` argument.
fn model_of(target: &Bound<'_, PyAny>) -> PyResult<Arc<Model>> {
    if let Ok(ctx) = target.cast::<PyContext>() {
        let core = &ctx.get().inner;
        core.check_open().py()?;
        return Ok(core.model().clone());
    }
    if let Ok(model) = target.cast::<PyModel>() {
        return Ok(model.get().inner.clone());
    }
    Err(pyo3::exceptions::PyTypeError::new_err("expected a Context or a Model"))
}

#[pymethods]
impl PyGrammar {
    /// A grammar for the JSON documents ``schema`` (a dict or JSON text) describes, compiled by
    /// llguidance for the model of ``ctx_or_model``: ``$ref``/``$defs``, ``anyOf``/``oneOf``,
    /// ``pattern``, ``format``, numeric bounds, ``minItems``/``maxItems``,
    /// ``additionalProperties``. Read as llama.cpp's converter reads a schema: an object that
    /// lists ``properties`` and says nothing of other keys takes no others, ``oneOf`` is
    /// ``anyOf``, keywords and formats llguidance does not implement are ignored; output is
    /// compact (no whitespace outside strings). The schema's ``x-guidance`` entry overrides
    /// these options. An invalid schema, or one beyond llguidance's size limits, raises
    /// ``GrammarError`` with llguidance's reason.
    #[staticmethod]
    fn from_json_schema(
        py: Python<'_>,
        ctx_or_model: &Bound<'_, PyAny>,
        schema: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let text = if let Ok(s) = schema.cast::<PyString>() {
            s.to_str()?.to_string()
        } else {
            let dumped = py.import("json")?.call_method1("dumps", (schema,)).map_err(|e| {
                crate::error::to_py(lloyal_core::LloyalError::Grammar(format!(
                    "the JSON schema is not JSON-serialisable: {e}"
                )))
            })?;
            dumped.extract::<String>()?
        };
        PyGrammar::compile(py, ctx_or_model, GrammarKind::JsonSchema, text)
    }

    /// A grammar from a Lark grammar in llguidance's dialect (start rule ``start``; lexer
    /// regexes in ``/.../``, ``%json {...}`` for embedded schemas), for the model of
    /// ``ctx_or_model``. Invalid grammars raise ``GrammarError`` with llguidance's reason.
    #[staticmethod]
    fn from_lark(py: Python<'_>, ctx_or_model: &Bound<'_, PyAny>, lark: String) -> PyResult<Self> {
        PyGrammar::compile(py, ctx_or_model, GrammarKind::Lark, lark)
    }

    /// A grammar whose whole output matches the regular expression ``pattern`` (Rust
    /// ``regex`` syntax, anchored at both ends), compiled by llguidance.
    #[staticmethod]
    fn from_regex(py: Python<'_>, ctx_or_model: &Bound<'_, PyAny>, pattern: String) -> PyResult<Self> {
        PyGrammar::compile(py, ctx_or_model, GrammarKind::Regex, pattern)
    }

    /// A grammar from GBNF rules starting at ``root``; same as ``Context.create_grammar``.
    ///
    /// ``engine``: ``"auto"`` (llguidance, translated with GBNF's meaning kept; llama.cpp's
    /// engine, with a ``GrammarEngineWarning``, for a construct llguidance cannot express),
    /// ``"llguidance"`` (``GrammarError`` instead of falling back) or ``"llama.cpp"``.
    #[staticmethod]
    #[pyo3(signature = (ctx_or_model, gbnf, root="root", *, engine="auto"))]
    fn from_gbnf(
        py: Python<'_>,
        ctx_or_model: &Bound<'_, PyAny>,
        gbnf: String,
        root: &str,
        engine: &str,
    ) -> PyResult<Self> {
        let choice = GbnfEngineChoice::parse(engine).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "engine must be \"auto\", \"llguidance\" or \"llama.cpp\", got {engine:?}"
            ))
        })?;
        let model = model_of(ctx_or_model)?;
        Ok(PyGrammar::from_core(PyGrammar::parse(py, model, gbnf, root.to_string(), choice)?))
    }

    /// An independent copy with the same parse state.
    fn clone(&self) -> PyResult<PyGrammar> {
        Ok(PyGrammar::from_core(self.lock().try_clone().py()?))
    }

    /// Set every forbidden token to ``-inf`` in ``logits`` (float32, length n_vocab), in place.
    fn apply(&self, py: Python<'_>, mut logits: PyReadwriteArray1<'_, f32>) -> PyResult<()> {
        let slice = logits.as_slice_mut()?;
        detached(py, || self.lock().mask(slice))
    }

    /// Advance past ``token``; a forbidden token raises ``GrammarError``, one outside the
    /// vocabulary ``InvalidTokenError`` (state unchanged either way).
    fn accept(&self, token: TokenId) -> PyResult<()> {
        let mut g = self.lock();
        let t = g.model().check_token(*token).py()?;
        g.accept(t).py()
    }

    /// Whether ``token`` may come next.
    fn allows(&self, token: TokenId) -> bool {
        i32::try_from(*token).map(|t| self.lock().allows(t)).unwrap_or(false)
    }

    /// Back to the start.
    fn reset(&self) -> PyResult<()> {
        self.lock().reset().py()
    }

    /// What the grammar was built from: ``"gbnf"``, ``"json_schema"``, ``"lark"`` or ``"regex"``.
    #[getter]
    fn kind(&self) -> &'static str {
        self.lock().source().kind.name()
    }

    /// The engine that runs the grammar: ``"llguidance"`` or ``"llama.cpp"``.
    #[getter]
    fn engine(&self) -> &'static str {
        self.lock().engine_name()
    }

    /// Why a GBNF grammar runs on llama.cpp's engine although llguidance was wanted (the
    /// construct llguidance cannot express); ``None`` otherwise.
    #[getter]
    fn fallback(&self) -> Option<String> {
        self.lock().fallback().map(str::to_string)
    }

    /// The text the grammar was built from (GBNF rules, JSON schema, Lark grammar or regex).
    #[getter]
    fn source(&self) -> String {
        self.lock().source().text.clone()
    }

    /// The GBNF rules (``None`` for other kinds; see ``source``).
    #[getter]
    fn gbnf(&self) -> Option<String> {
        let g = self.lock();
        (g.source().kind == GrammarKind::Gbnf).then(|| g.source().text.clone())
    }

    /// The GBNF start rule's name (``None`` for other kinds).
    #[getter]
    fn root(&self) -> Option<String> {
        let g = self.lock();
        (g.source().kind == GrammarKind::Gbnf).then(|| g.source().root.clone())
    }

    fn __repr__(&self) -> String {
        let g = self.lock();
        match g.source().kind {
            GrammarKind::Gbnf => {
                format!("Grammar(kind='gbnf', root={:?}, engine='{}')", g.source().root, g.engine_name())
            }
            kind => format!("Grammar(kind='{}')", kind.name()),
        }
    }
}

/// GBNF (start rule ``root``) for a JSON schema given as JSON text.
#[pyfunction]
pub fn json_schema_to_grammar(py: Python<'_>, schema: String) -> PyResult<String> {
    detached(py, move || lloyal_core::json_schema_to_grammar(&schema))
}

/// `Context.create_grammar`, next to the class it makes.
#[pymethods]
impl PyContext {
    /// Parse GBNF rules into a :class:`Grammar` handle (``GrammarError`` if invalid).
    #[pyo3(signature = (gbnf, root="root"))]
    fn create_grammar(&self, py: Python<'_>, gbnf: String, root: &str) -> PyResult<PyGrammar> {
        self.check_open()?;
        let model = self.inner.model().clone();
        Ok(PyGrammar::from_core(PyGrammar::parse(py, model, gbnf, root.to_string(), Default::default())?))
    }
}
