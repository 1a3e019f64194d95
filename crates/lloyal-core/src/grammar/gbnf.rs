//! GBNF grammars on llama.cpp's grammar engine, and llama.cpp's JSON-schema-to-GBNF converter.
//!
//! llama.cpp aborts (not throws) when a grammar accepts an end-of-generation token it does not
//! allow, and throws across the C ABI on any other forbidden token; so every `accept` here is
//! preceded by [`GbnfEngine::allows`], and a forbidden token is a `GrammarError` with the grammar
//! unchanged.

use std::ffi::CString;

use std::ptr::NonNull;

use super::gbnf_check::check_gbnf;

use llama_cpp_sys_2 as sys;

use crate::backend::{clear_recent_errors, recent_errors_or};
use crate::error::{LloyalError, Result};
use crate::model::Model;
use crate::raw::vocab_ptr;

/// An owned llama.cpp grammar sampler: parse state over GBNF rules.
pub(crate) struct GbnfEngine {
    raw: NonNull<sys::llama_sampler>,
    n_vocab: i32,
    /// Reused candidate buffer for masks.
    candidates: Vec<sys::llama_token_data>,
}

// SAFETY: a grammar sampler is plain heap state with no thread affinity; it is only used
// through &mut or under the context lock.
unsafe impl Send for GbnfEngine {}

impl Drop for GbnfEngine {
    fn drop(&mut self) {
        // SAFETY: the pointer came from llama_rs_sampler_init_grammar / llama_sampler_clone
        // and is freed exactly once.
        unsafe { sys::llama_sampler_free(self.raw.as_ptr()) }
    }
}

/// GBNF (with a `root` rule) for a JSON schema, via llama.cpp's converter.
pub fn json_schema_to_grammar(schema_json: &str) -> Result<String> {
    if schema_json.contains('\0') {
        return Err(LloyalError::Grammar("the JSON schema contains a NUL byte".into()));
    }
    // Parse here first: serde_json bounds nesting (128 levels), so a deeply nested schema is
    // refused before llama.cpp's recursive converter could overflow the stack.
    let schema = serde_json::from_str::<serde_json::Value>(schema_json).map_err(|e| {
        LloyalError::Grammar(if e.to_string().contains("recursion limit") {
            format!("the JSON schema nests too deeply ({e}); use $defs/$ref for deep structures")
        } else {
            format!("the JSON schema is not valid JSON ({e}); pass a JSON Schema object")
        })
    })?;
    // llama.cpp's converter reports only that it failed, and converts some schemas no document
    // meets (a minimum above the maximum) into rules that match nothing: llguidance says why.
    let refused = |what: &str| {
        let why = super::llg::schema_refusal(schema.clone()).unwrap_or_else(|| {
            "it uses a construct llama.cpp's converter does not support; Grammar.from_json_schema \
             compiles it with llguidance instead"
                .into()
        });
        LloyalError::Grammar(format!("{what}: {why}"))
    };
    let gbnf = llama_cpp_2::json_schema_to_grammar(schema_json)
        .map_err(|_| refused("llama.cpp could not convert the JSON schema to a grammar"))?;
    check_gbnf(&gbnf).map_err(|e| {
        LloyalError::Grammar(format!("the JSON schema converts to a grammar that cannot be used: {e}"))
    })?;
    let syntax = super::gbnf_syntax::parse(&gbnf).map_err(|e| {
        LloyalError::Grammar(format!("the JSON schema converts to a grammar that does not parse ({e})"))
    })?;
    if super::matches_nothing(&syntax, "root").is_some() {
        return Err(refused("the JSON schema converts to a grammar that accepts no text"));
    }
    Ok(gbnf)
}

impl GbnfEngine {
    /// Parse `gbnf` starting at rule `root`. Invalid rules → `GrammarError` with llama.cpp's reason.
    pub(crate) fn new(model: &Model, gbnf: &str, root: &str) -> Result<GbnfEngine> {
        let (c_gbnf, c_root) = match (CString::new(gbnf), CString::new(root)) {
            (Ok(g), Ok(r)) => (g, r),
            _ => return Err(LloyalError::Grammar("the grammar or its root name contains a NUL byte".into())),
        };
        if gbnf.trim().is_empty() {
            return Err(LloyalError::Grammar(
                "the grammar is empty; pass GBNF rules with a root rule".into(),
            ));
        }
        check_gbnf(gbnf)?;
        clear_recent_errors();
        let vocab = vocab_ptr(model.llama());
        // SAFETY: vocab outlives the call (the model is held); the strings live across it;
        // the wrapper catches C++ exceptions and returns null on failure.
        let raw = unsafe { sys::llama_rs_sampler_init_grammar(vocab, c_gbnf.as_ptr(), c_root.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| {
            let detail = recent_errors_or("parse error");
            LloyalError::Grammar(format!("invalid grammar (root rule {root:?}): {detail}"))
        })?;
        Ok(GbnfEngine { raw, n_vocab: model.n_vocab(), candidates: Vec::new() })
    }

    /// An independent copy with the same parse state.
    pub(crate) fn try_clone(&self) -> Result<GbnfEngine> {
        // SAFETY: self.raw is a live grammar sampler; clone returns a new owned sampler.
        let raw = unsafe { sys::llama_sampler_clone(self.raw.as_ptr()) };
        let raw =
            NonNull::new(raw).ok_or_else(|| LloyalError::Grammar("could not clone the grammar".into()))?;
        Ok(GbnfEngine { raw, n_vocab: self.n_vocab, candidates: Vec::new() })
    }

    /// Back to the start rule.
    pub(crate) fn reset(&mut self) {
        // SAFETY: self.raw is a live grammar sampler.
        unsafe { sys::llama_sampler_reset(self.raw.as_ptr()) }
    }

    fn apply(&mut self, start: usize) {
        let mut arr = sys::llama_token_data_array {
            data: self.candidates[start..].as_mut_ptr(),
            size: self.candidates.len() - start,
            selected: -1,
            sorted: false,
        };
        // SAFETY: arr points into our candidate buffer, alive and exclusively borrowed; the
        // grammar sampler only lowers logits to -inf in place (it never throws in apply).
        unsafe { sys::llama_sampler_apply(self.raw.as_ptr(), &mut arr) };
    }

    /// Whether the grammar accepts `token` next (an end-of-generation token only when the
    /// grammar is complete). Out-of-range tokens are not allowed.
    pub(crate) fn allows(&mut self, token: i32) -> bool {
        if token < 0 || token >= self.n_vocab {
            return false;
        }
        self.candidates.clear();
        self.candidates.push(sys::llama_token_data { id: token, logit: 0.0, p: 0.0 });
        self.apply(0);
        self.candidates[0].logit != f32::NEG_INFINITY
    }

    /// Which of `tokens` the grammar allows next (one pass of the grammar over them).
    pub(crate) fn allowed_among(&mut self, tokens: &[i32]) -> Vec<bool> {
        let n_vocab = self.n_vocab;
        self.candidates.clear();
        self.candidates.extend(tokens.iter().map(|&id| sys::llama_token_data { id, logit: 0.0, p: 0.0 }));
        if self.candidates.is_empty() {
            return Vec::new();
        }
        self.apply(0);
        self.candidates.iter().map(|c| c.logit != f32::NEG_INFINITY && c.id >= 0 && c.id < n_vocab).collect()
    }

    /// Set every token the grammar forbids to `-inf` in `logits` (length n_vocab, checked by
    /// the caller).
    pub(crate) fn mask(&mut self, logits: &mut [f32]) {
        // Only tokens still possible need the (expensive) grammar check.
        let n = logits.len() as i32;
        let live: Vec<i32> = (0..n).filter(|&t| logits[t as usize] != f32::NEG_INFINITY).collect();
        for (t, ok) in live.iter().zip(self.allowed_among(&live)) {
            if !ok {
                logits[*t as usize] = f32::NEG_INFINITY;
            }
        }
    }

    /// Advance past `token`, which [`Self::allows`] must have allowed.
    pub(crate) fn accept(&mut self, token: i32) -> Result<()> {
        // SAFETY: the token is in range and allowed (checked by the caller), so llama.cpp
        // neither aborts (EOG) nor throws; the wrapper catches any exception anyway and
        // reports a status.
        let status = unsafe { sys::llama_rs_sampler_accept(self.raw.as_ptr(), token) };
        if status != sys::LLAMA_RS_STATUS_OK {
            return Err(LloyalError::Grammar(format!("the grammar failed to accept token {token}")));
        }
        Ok(())
    }
}
