//! JSON schema, Lark and regex grammars on llguidance: a token mask computed from the parser
//! state (tens of µs per token) over a token trie built once per model.
//!
//! llguidance's `Matcher` is the parse state. Every failure (a lexer or parser limit hit while
//! computing a mask) leaves it in a permanent error state, so a grammar that failed once keeps
//! raising `GrammarError` with llguidance's message instead of guessing.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use toktrie::SimpleVob;

use super::GrammarKind;
use crate::error::{LloyalError, Result};
use crate::model::Model;

/// The limits every llguidance grammar compiles and runs under: each bounds time or memory, so
/// a pathological grammar is refused (or fails with `GrammarError`) instead of hanging.
fn limits() -> ParserLimits {
    ParserLimits {
        // Symbols in the compiled grammar (a few MB of JSON schema).
        max_grammar_size: 200_000,
        // Lexer work to build the initial regexes (~50k per ms: ≤ ~20 ms).
        initial_lexer_fuel: 1_000_000,
        // Lexer work per token mask (~14k per ms: ≤ ~15 ms).
        step_lexer_fuel: 200_000,
        // Earley items per token mask (~20k per ms).
        step_max_items: 50_000,
        // Lexer states (~1-2 kB each: ≤ ~250 MB).
        max_lexer_states: 100_000,
        ..ParserLimits::default()
    }
}

/// The parser factory for `model`: its token trie is built from the whole vocabulary (seconds
/// for 262k tokens), so it is made once per model, on the first llguidance grammar.
pub(crate) fn factory(model: &Model) -> Result<Arc<ParserFactory>> {
    model
        .llg_factory(|| {
            let env = llama_cpp_2::sampling::LlamaSampler::llguidance_tok_env(model.llama());
            let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            factory.quiet();
            *factory.limits_mut() = limits();
            Ok(Arc::new(factory))
        })
        .map_err(|e| LloyalError::Grammar(format!("could not set up llguidance for this model: {e}")))
}

/// Parse state of one llguidance grammar, with the mask of the current state once computed.
pub(crate) struct LlgEngine {
    matcher: Matcher,
    mask: Option<SimpleVob>,
    n_vocab: usize,
}

/// The llguidance grammar for `text` of `kind`; a JSON schema read as llama.cpp's converter
/// reads one ([`super::schema::prepare`]: objects that list properties closed, compact
/// separators, `oneOf` as `anyOf`, unknown keywords and formats ignored).
fn top_level(kind: GrammarKind, text: &str) -> Result<TopLevelGrammar> {
    match kind {
        GrammarKind::JsonSchema => {
            let schema: Value = serde_json::from_str(text).map_err(|e| {
                LloyalError::Grammar(if e.to_string().contains("recursion limit") {
                    format!("the JSON schema nests too deeply ({e}); use $defs/$ref for deep structures")
                } else {
                    format!("the JSON schema is not valid JSON ({e}); pass a JSON Schema object")
                })
            })?;
            Ok(TopLevelGrammar::from_json_schema(super::schema::prepare(schema)))
        }
        GrammarKind::Lark => Ok(TopLevelGrammar::from_lark(text.to_string())),
        GrammarKind::Regex => Ok(TopLevelGrammar::from_regex(text)),
        GrammarKind::Gbnf => {
            Err(LloyalError::Grammar("GBNF grammars run on llama.cpp's engine, not llguidance".into()))
        }
    }
}

/// Why llguidance refuses the JSON schema `schema` (read as [`top_level`] reads it), without a
/// model: a schema llama.cpp's converter cannot convert gets this reason (an unknown type, a
/// `$ref` to nothing, bounds no number meets), which llama.cpp's converter does not report.
/// `None` when llguidance takes it.
pub(crate) fn schema_refusal(schema: Value) -> Option<String> {
    let schema = super::schema::prepare(schema);
    let builder = llguidance::GrammarBuilder::new(None, limits());
    let options = llguidance::JsonCompileOptions::default();
    match catch_unwind(AssertUnwindSafe(|| options.json_to_llg_with_overrides(builder, schema))) {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some("llguidance failed on it".into()),
    }
}

impl LlgEngine {
    /// Compile `text` as a `kind` grammar and compute its first mask, so that every compile
    /// error (including limits hit by the first mask) is raised here.
    pub(crate) fn compile(model: &Model, kind: GrammarKind, text: &str) -> Result<LlgEngine> {
        // A regex of whitespace alone matches that whitespace; other kinds need some text.
        let blank = if kind == GrammarKind::Regex { text.is_empty() } else { text.trim().is_empty() };
        if blank {
            return Err(LloyalError::Grammar(format!("the {} grammar is empty; pass its text", kind.name())));
        }
        let top = top_level(kind, text)?;
        let factory = factory(model)?;
        let parser = catch_unwind(AssertUnwindSafe(|| factory.create_parser(top)))
            .map_err(|_| LloyalError::Grammar(format!("llguidance failed on this {} grammar", kind.name())))?
            .map_err(|e| LloyalError::Grammar(format!("invalid {} grammar: {e}", kind.name())))?;
        let mut engine =
            LlgEngine { matcher: Matcher::new(Ok(parser)), mask: None, n_vocab: model.n_vocab() as usize };
        // A grammar that fails before its first token accepts no text (the regex `[^\s\S]`):
        // said as such, not as a grammar that broke in use.
        match engine.matcher.compute_mask_or_eos() {
            Ok(mask) => engine.mask = Some(mask),
            Err(e) => {
                let said = e.to_string();
                let said: String = said.lines().next().unwrap_or_default().chars().take(160).collect();
                return Err(LloyalError::Grammar(format!(
                    "the {} grammar allows no first token: it accepts no text (such as a character \
                     class with no characters); llguidance said: {said}",
                    kind.name()
                )));
            }
        }
        Ok(engine)
    }

    /// The mask of the current state (computed once per state).
    pub(crate) fn current_mask(&mut self) -> Result<&SimpleVob> {
        if self.mask.is_none() {
            let mask = self.matcher.compute_mask_or_eos().map_err(|e| {
                LloyalError::Grammar(format!(
                    "the grammar failed ({e}); it cannot be used any more: simplify it or \
                     create a new one"
                ))
            })?;
            self.mask = Some(mask);
        }
        self.mask.as_ref().ok_or_else(|| LloyalError::Grammar("no grammar mask".into()))
    }

    /// Whether `token` may come next (false for any token once the grammar failed).
    pub(crate) fn allows(&mut self, token: i32) -> bool {
        let n = self.n_vocab;
        match self.current_mask() {
            Ok(mask) => token >= 0 && (token as usize) < n.min(mask.len()) && mask.is_allowed(token as u32),
            Err(_) => false,
        }
    }

    /// Which of `tokens` may come next.
    pub(crate) fn allowed_among(&mut self, tokens: &[i32]) -> Vec<bool> {
        tokens.iter().map(|&t| self.allows(t)).collect()
    }

    /// Set every forbidden token to `-inf` in `logits` (length n_vocab, checked by the caller).
    pub(crate) fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = self.current_mask()?;
        let words = mask.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << i) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// `logits` at the allowed tokens, `-inf` elsewhere (a new vector: only the allowed
    /// entries are copied, usually a small set).
    pub(crate) fn masked(&mut self, logits: &[f32]) -> Result<Vec<f32>> {
        let mask = self.current_mask()?;
        let mut out = vec![f32::NEG_INFINITY; logits.len()];
        mask.iter_set_entries(|i| {
            if let (Some(o), Some(&l)) = (out.get_mut(i), logits.get(i)) {
                *o = l;
            }
        });
        Ok(out)
    }

    /// Advance past `token`, which [`Self::allows`] must have allowed. Once the grammar has
    /// stopped only end-of-generation tokens are allowed, and they change nothing.
    pub(crate) fn accept(&mut self, token: i32) -> Result<()> {
        if !self.matcher.is_stopped() {
            self.matcher.consume_token(token as u32).map_err(|e| {
                LloyalError::Grammar(format!("the grammar failed to accept token {token}: {e}"))
            })?;
        }
        self.mask = None;
        Ok(())
    }

    /// An independent copy with the same parse state.
    pub(crate) fn try_clone(&self) -> LlgEngine {
        LlgEngine { matcher: self.matcher.clone(), mask: self.mask.clone(), n_vocab: self.n_vocab }
    }

    /// Back to the start of the grammar.
    pub(crate) fn reset(&mut self) -> Result<()> {
        self.mask = None;
        self.matcher.reset().map_err(|e| LloyalError::Grammar(format!("could not reset the grammar: {e}")))
    }
}
