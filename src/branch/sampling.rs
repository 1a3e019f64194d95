//! `Branch`'s sampling settings (sampler, grammar, biases, steering) and its logits.

use std::collections::HashMap;
use std::sync::Arc;

use lloyal_core::{Base, ContextState, Handle};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::PyBranch;
use crate::convert::TokenId;
use crate::convert::{int_arg, narrow};
use crate::engine;
use crate::error::IntoPyResult;
use crate::grammar::PyGrammar;
use crate::sampling::{extract_params, extract_params_onto};

/// A grammar from GBNF text (start rule ``root``) or a copy of a `Grammar` handle's state.
pub(super) fn grammar_arg(
    py: Python<'_>,
    model: Arc<lloyal_core::Model>,
    grammar: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<lloyal_core::Grammar>> {
    let Some(g) = grammar.filter(|g| !g.is_none()) else { return Ok(None) };
    if let Ok(handle) = g.cast::<PyGrammar>() {
        return Ok(Some(handle.get().lock().try_clone().py()?));
    }
    let gbnf: String = g.extract().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err("grammar must be GBNF text (str), a Grammar, or None")
    })?;
    Ok(Some(PyGrammar::parse(py, model, gbnf, "root".into(), Default::default())?))
}

/// Token ids and biases from a `{token: bias}` dict, both checked (ids in the vocabulary,
/// values finite or `-inf`), so that a call taking one fails before it changes anything.
fn bias_list(model: &lloyal_core::Model, bias: &Bound<'_, PyDict>) -> PyResult<Vec<(i32, f32)>> {
    let map: HashMap<TokenId, f32> = bias.extract()?;
    let mut v: Vec<(i32, f32)> = map
        .into_iter()
        .map(|(t, b)| Ok((model.check_token(*t)?, b)))
        .collect::<lloyal_core::Result<_>>()
        .py()?;
    v.sort_by_key(|x| x.0);
    lloyal_core::branch::ops::check_bias(model, &v).py()?;
    Ok(v)
}

#[pymethods]
impl PyBranch {
    /// Constrain sampling with a grammar (GBNF text or a :class:`Grammar`, whose state is
    /// copied), or remove it with ``None``. Forks inherit a copy.
    #[pyo3(signature = (grammar))]
    fn set_grammar(&self, py: Python<'_>, grammar: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        self.core().check_open().py()?;
        let grammar = grammar_arg(py, self.core().model().clone(), grammar)?;
        self.call(py, move |s, h| s.branch_set_grammar(h, grammar))
    }

    /// Sampled tokens a GBNF grammar rejected so far (each cost a full vocabulary mask); always 0
    /// under llguidance grammars, which mask before sampling.
    #[getter]
    fn grammar_resamples(&self, py: Python<'_>) -> PyResult<u64> {
        self.call(py, |s, h| s.branch_grammar_resamples(h))
    }

    /// Restart the sampler's RNG with ``seed`` (history kept).
    fn reseed_sampler(&self, py: Python<'_>, seed: &Bound<'_, PyAny>) -> PyResult<()> {
        let seed: u32 = int_arg("seed", seed, "in 0..=4294967295")?;
        self.call(py, move |s, h| s.branch_reseed_sampler(h, seed))
    }

    /// Replace the sampling parameters (penalty history and RNG kept).
    ///
    /// A ``SamplingParams`` replaces all of them (keyword overrides then apply on top);
    /// keyword overrides alone change only those fields of the current parameters. Nothing
    /// is rebuilt when the parameters are unchanged.
    ///
    /// Example:
    ///     >>> branch.set_sampler_params(temperature=0.2)  # top_k, top_p... unchanged
    #[pyo3(signature = (params=None, **overrides))]
    fn set_sampler_params(
        &self,
        py: Python<'_>,
        params: Option<&Bound<'_, PyAny>>,
        overrides: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let params = match params.filter(|p| !p.is_none()) {
            Some(p) => extract_params(Some(p), overrides)?,
            None => extract_params_onto(self.call(py, |s, h| s.branch_params(h))?, None, overrides)?,
        };
        self.call(py, move |s, h| s.branch_set_params(h, params))
    }

    /// Replace the whole sampling setup in one call (one wait for the context while the
    /// engine is busy, instead of one per setter): the parameters, the logit bias (None: no
    /// bias) and the grammar (GBNF text or a :class:`Grammar`; None: none); ``seed`` restarts
    /// the RNG (None: kept). ``fresh``: also forget the penalty history and the perplexities,
    /// as a new branch after its prefill has none (for a fork of a branch that sampled
    /// before). Everything is checked first: on an error nothing changes.
    ///
    /// Example:
    ///     >>> branch.set_sampling(SamplingParams(temperature=0.0), seed=7, logit_bias={})
    #[pyo3(signature = (params, *, seed=None, logit_bias=None, grammar=None, fresh=false))]
    fn set_sampling(
        &self,
        py: Python<'_>,
        params: &Bound<'_, PyAny>,
        seed: Option<i64>,
        logit_bias: Option<&Bound<'_, PyDict>>,
        grammar: Option<&Bound<'_, PyAny>>,
        fresh: bool,
    ) -> PyResult<()> {
        let set = self.sampling_setup(py, (params, seed, logit_bias, grammar), fresh)?;
        self.call(py, set)
    }

    /// Await ``set_sampling(params, seed=seed, logit_bias=logit_bias, grammar=grammar,
    /// fresh=fresh)`` without blocking the event loop: it runs at once when the engine is
    /// between ticks, else the engine runs it before its next tick. GBNF text is compiled
    /// before that, on the calling thread (a :class:`Grammar` made ahead, off the loop, keeps
    /// it free).
    #[pyo3(signature = (params, *, seed=None, logit_bias=None, grammar=None, fresh=false))]
    fn aset_sampling<'py>(
        slf: &Bound<'py, Self>,
        params: &Bound<'py, PyAny>,
        seed: Option<i64>,
        logit_bias: Option<&Bound<'py, PyDict>>,
        grammar: Option<&Bound<'py, PyAny>>,
        fresh: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (py, branch) = (slf.py(), slf.get());
        let set = branch.sampling_setup(py, (params, seed, logit_bias, grammar), fresh)?;
        let h = branch.handle;
        engine::awaitable(py, branch.core(), move |s| set(s, h))
    }

    /// Set ``{token: bias}`` added to the logits before sampling; inherited by forks; ``-inf`` bans.
    fn set_logit_bias(&self, py: Python<'_>, bias: &Bound<'_, PyDict>) -> PyResult<()> {
        let bias = bias_list(self.core().model(), bias)?;
        self.call(py, move |s, h| s.branch_set_logit_bias(h, bias))
    }

    /// Set per-branch steering ``{token: bias}`` (not inherited by forks).
    fn steer(&self, py: Python<'_>, bias: &Bound<'_, PyDict>) -> PyResult<()> {
        let bias = bias_list(self.core().model(), bias)?;
        self.call(py, move |s, h| s.branch_steer(h, bias))
    }

    /// Remove steering.
    fn clear_steer(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |s, h| s.branch_steer(h, Vec::new()))
    }

    /// A float32 copy of the current logits, shape ``(n_vocab,)``.
    #[getter]
    fn logits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let v = self.call(py, |s, h| Ok(s.branch(h)?.logits()?.to_vec()))?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// Replace the logits snapshot (shape ``(n_vocab,)``; any real dtype, read as float32).
    fn set_logits(&self, py: Python<'_>, logits: &Bound<'_, PyAny>) -> PyResult<()> {
        // numpy's own conversion: a float64 row (np.zeros' default) is as good as a float32 one
        let converted = py.import("numpy")?.call_method1("asarray", (logits, "float32"))?;
        let logits: PyReadonlyArray1<'_, f32> = converted.extract()?;
        let v = logits.as_array().to_vec();
        self.call(py, move |s, h| s.branch_set_logits(h, v))
    }

    /// Entropy of the next-token distribution in ``"nats"`` or ``"bits"``.
    #[pyo3(signature = (base="nats"))]
    fn model_entropy(&self, py: Python<'_>, base: &str) -> PyResult<f64> {
        let base = Base::parse(base).py()?;
        self.call(py, move |s, h| s.branch_entropy(h, base))
    }

    /// Surprisal of ``token`` under the current logits.
    #[pyo3(signature = (token, base="nats"))]
    fn model_surprisal(&self, py: Python<'_>, token: TokenId, base: &str) -> PyResult<f64> {
        let base = Base::parse(base).py()?;
        let token = self.core().model().check_token(*token).py()?;
        self.call(py, move |s, h| s.branch_surprisal(h, token, base))
    }
}

/// `set_sampling`'s arguments: parameters, seed, logit bias, grammar.
type SamplingArgs<'a, 'py> =
    (&'a Bound<'py, PyAny>, Option<i64>, Option<&'a Bound<'py, PyDict>>, Option<&'a Bound<'py, PyAny>>);

impl PyBranch {
    /// `set_sampling`'s arguments checked (the grammar compiled), as the call that applies them.
    fn sampling_setup(
        &self,
        py: Python<'_>,
        (params, seed, logit_bias, grammar): SamplingArgs<'_, '_>,
        fresh: bool,
    ) -> PyResult<impl FnOnce(&mut ContextState, Handle) -> lloyal_core::Result<()> + Send + 'static> {
        self.core().check_open().py()?;
        let params = extract_params(Some(params), None)?;
        let seed: Option<u32> = seed.map(|s| narrow("seed", s, "in 0..=4294967295")).transpose()?;
        let bias = match logit_bias {
            Some(b) => bias_list(self.core().model(), b)?,
            None => Vec::new(),
        };
        let grammar = grammar_arg(py, self.core().model().clone(), grammar)?;
        Ok(move |s: &mut ContextState, h: Handle| {
            // Every argument is checked above: these fail only on a disposed branch, at the first.
            s.branch_set_grammar(h, grammar)?;
            s.branch_set_params(h, params)?;
            if fresh {
                s.branch_start_afresh(h)?;
            }
            if let Some(seed) = seed {
                s.branch_reseed_sampler(h, seed)?;
            }
            s.branch_set_logit_bias(h, bias)
        })
    }
}
