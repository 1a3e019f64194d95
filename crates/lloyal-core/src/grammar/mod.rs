//! Grammars: the parse state a branch samples under. Every kind runs on llguidance (`llg`),
//! whose token mask is cheap enough to apply before every sample: JSON schema, Lark and regular
//! expressions directly, GBNF translated with its meaning kept (`gbnf_syntax` reads it,
//! `gbnf_lark` translates it). llama.cpp's grammar engine (`gbnf`, checked first by
//! `gbnf_check`) runs a GBNF grammar only when asked to, or when the grammar has a construct
//! llguidance cannot express (the grammar then says why: [`Grammar::fallback`]).
//!
//! Every `accept` is preceded by a check, so a forbidden token is a `GrammarError` with the
//! grammar unchanged.

pub mod gbnf;
pub mod gbnf_check;
mod gbnf_lark;
mod gbnf_syntax;
mod llg;
pub mod schema;

use std::sync::Arc;

pub use gbnf::json_schema_to_grammar;

use crate::error::{LloyalError, Result};
use crate::model::Model;
use crate::sampler::Sampler;
use gbnf::GbnfEngine;
use llg::LlgEngine;

/// Up to this many allowed tokens, sampling under an llguidance grammar takes its candidates
/// from the allowed tokens themselves rather than from the row's best tokens.
const FEW_ALLOWED: usize = 4096;

/// What a grammar's text is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GrammarKind {
    /// llama.cpp GBNF rules (llama.cpp's engine).
    Gbnf,
    /// A JSON Schema as JSON text (llguidance).
    JsonSchema,
    /// A Lark grammar in llguidance's dialect (llguidance).
    Lark,
    /// A regular expression the whole output must match (llguidance).
    Regex,
}

impl GrammarKind {
    /// The name used in Python (`Grammar.kind`) and in saved states.
    pub fn name(self) -> &'static str {
        match self {
            GrammarKind::Gbnf => "gbnf",
            GrammarKind::JsonSchema => "json_schema",
            GrammarKind::Lark => "lark",
            GrammarKind::Regex => "regex",
        }
    }

    /// The kind called `name` (see [`Self::name`]).
    pub fn parse(name: &str) -> Option<GrammarKind> {
        [GrammarKind::Gbnf, GrammarKind::JsonSchema, GrammarKind::Lark, GrammarKind::Regex]
            .into_iter()
            .find(|k| k.name() == name)
    }
}

/// The text a grammar was built from (kept for cloning into state files and for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarSource {
    /// What `text` is.
    pub kind: GrammarKind,
    /// GBNF rules, JSON schema, Lark grammar or regular expression.
    pub text: String,
    /// Name of the GBNF start rule (empty for other kinds).
    pub root: String,
    /// Which engine runs a GBNF grammar.
    pub engine: GbnfEngineChoice,
}

/// Which engine runs a GBNF grammar.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum GbnfEngineChoice {
    /// llguidance, unless the grammar has a construct it cannot express (then llama.cpp's).
    #[default]
    Auto,
    /// llguidance, or `GrammarError` saying which construct it cannot express.
    Llguidance,
    /// llama.cpp's grammar engine.
    LlamaCpp,
}

impl GbnfEngineChoice {
    /// The name used in Python (`engine=`) and in saved states.
    pub fn name(self) -> &'static str {
        match self {
            GbnfEngineChoice::Auto => "auto",
            GbnfEngineChoice::Llguidance => "llguidance",
            GbnfEngineChoice::LlamaCpp => "llama.cpp",
        }
    }

    /// The choice called `name` (see [`Self::name`]).
    pub fn parse(name: &str) -> Option<GbnfEngineChoice> {
        [GbnfEngineChoice::Auto, GbnfEngineChoice::Llguidance, GbnfEngineChoice::LlamaCpp]
            .into_iter()
            .find(|c| c.name() == name)
    }
}

enum Engine {
    Gbnf(GbnfEngine),
    Llg(Box<LlgEngine>),
}

/// A grammar's parse state over one model's vocabulary.
pub struct Grammar {
    engine: Engine,
    model: Arc<Model>,
    source: Arc<GrammarSource>,
    /// Tokens accepted since the start (replayed to restore a saved state).
    accepted: Vec<i32>,
    /// Why a GBNF grammar runs on llama.cpp's engine although llguidance was wanted.
    fallback: Option<Arc<str>>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("kind", &self.source.kind).field("root", &self.source.root).finish()
    }
}

impl Grammar {
    /// Compile `source` (every kind on llguidance; GBNF as its `engine` says). Invalid text →
    /// `GrammarError` with the engine's reason.
    pub fn compile(model: Arc<Model>, source: GrammarSource) -> Result<Grammar> {
        let (engine, fallback) = match source.kind {
            GrammarKind::Gbnf => gbnf_engine(&model, &source)?,
            kind => {
                if source.text.contains('\0') {
                    return Err(LloyalError::Grammar(format!("the {} contains a NUL byte", kind.name())));
                }
                (Engine::Llg(Box::new(LlgEngine::compile(&model, kind, &source.text)?)), None)
            }
        };
        Ok(Grammar { engine, model, source: Arc::new(source), accepted: Vec::new(), fallback })
    }

    /// The engine that runs this grammar: `"llguidance"` or `"llama.cpp"`.
    pub fn engine_name(&self) -> &'static str {
        match self.engine {
            Engine::Llg(_) => "llguidance",
            Engine::Gbnf(_) => "llama.cpp",
        }
    }

    /// Why this GBNF grammar runs on llama.cpp's engine although llguidance was wanted (the
    /// construct llguidance cannot express), if it does.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Rebuild a saved grammar: compile `source`, then accept `accepted` from the start.
    pub fn restore(model: Arc<Model>, source: &GrammarSource, accepted: &[i32]) -> Result<Grammar> {
        let mut g = Grammar::compile(model, source.clone())?;
        for &t in accepted {
            g.accept(t)?;
        }
        Ok(g)
    }

    /// Tokens accepted since the start (or the last `reset`).
    pub fn accepted(&self) -> &[i32] {
        &self.accepted
    }

    /// The model whose vocabulary this grammar masks.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The text this grammar was built from.
    pub fn source(&self) -> &GrammarSource {
        &self.source
    }

    /// Whether sampling applies the full mask before drawing (llguidance: a mask costs tens
    /// of µs) rather than checking the unconstrained draw first (llama.cpp's GBNF engine,
    /// whose full mask over a 262k vocabulary costs ~100 ms).
    pub fn masks_first(&self) -> bool {
        matches!(self.engine, Engine::Llg(_))
    }

    /// An independent copy with the same parse state.
    pub fn try_clone(&self) -> Result<Grammar> {
        let engine = match &self.engine {
            Engine::Gbnf(g) => Engine::Gbnf(g.try_clone()?),
            Engine::Llg(g) => Engine::Llg(Box::new(g.try_clone())),
        };
        Ok(Grammar {
            engine,
            model: self.model.clone(),
            source: self.source.clone(),
            accepted: self.accepted.clone(),
            fallback: self.fallback.clone(),
        })
    }

    /// Back to the start.
    pub fn reset(&mut self) -> Result<()> {
        match &mut self.engine {
            Engine::Gbnf(g) => g.reset(),
            Engine::Llg(g) => g.reset()?,
        }
        self.accepted.clear();
        Ok(())
    }

    /// Whether the grammar accepts `token` next (an end-of-generation token only when the
    /// grammar is complete). Out-of-range tokens are not allowed.
    pub fn allows(&mut self, token: i32) -> bool {
        match &mut self.engine {
            Engine::Gbnf(g) => g.allows(token),
            Engine::Llg(g) => g.allows(token),
        }
    }

    /// Which of `tokens` the grammar allows next.
    pub fn allowed_among(&mut self, tokens: &[i32]) -> Vec<bool> {
        match &mut self.engine {
            Engine::Gbnf(g) => g.allowed_among(tokens),
            Engine::Llg(g) => g.allowed_among(tokens),
        }
    }

    /// The tokens allowed at the start rule of a GBNF grammar, computed once per rules and
    /// root and kept by the model: every generation under the same grammar starts here, and a
    /// full pass over a 262k vocabulary costs ~150 ms.
    pub fn start_allowed(&mut self) -> Arc<Vec<i32>> {
        let (model, source) = (self.model.clone(), self.source.clone());
        model.grammar_start(&source.text, &source.root, || {
            let Ok(mut fresh) = Grammar::compile(model.clone(), (*source).clone()) else {
                return Vec::new();
            };
            let all: Vec<i32> = (0..model.n_vocab()).collect();
            let allowed = fresh.allowed_among(&all);
            all.into_iter().zip(allowed).filter(|(_, ok)| *ok).map(|(t, _)| t).collect()
        })
    }

    fn check_len(&self, n: usize) -> Result<()> {
        let want = self.model.n_vocab() as usize;
        if n != want {
            return Err(LloyalError::invalid(format!("logits must have n_vocab={want} entries, got {n}")));
        }
        Ok(())
    }

    /// Set every token the grammar forbids to `-inf` in `logits` (length n_vocab). A grammar
    /// that failed (an llguidance limit) → `GrammarError`, `logits` unchanged.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        self.check_len(logits.len())?;
        match &mut self.engine {
            Engine::Gbnf(g) => {
                g.mask(logits);
                Ok(())
            }
            Engine::Llg(g) => g.mask(logits),
        }
    }

    /// `logits` (length n_vocab) with every forbidden token at `-inf`, as a new vector.
    pub fn masked(&mut self, logits: &[f32]) -> Result<Vec<f32>> {
        self.check_len(logits.len())?;
        match &mut self.engine {
            Engine::Gbnf(g) => {
                let mut out = logits.to_vec();
                g.mask(&mut out);
                Ok(out)
            }
            Engine::Llg(g) => g.masked(logits),
        }
    }

    /// A token drawn by `sampler` from `logits` restricted to what the grammar allows, without
    /// a masked copy of the row (llguidance: from the allowed tokens themselves when they are
    /// few, else from windows of the row's best tokens; see [`Sampler::sample_allowed`]).
    /// `None`: the caller draws from the masked row (llama.cpp's engine, or a sampler that needs
    /// the whole row). A grammar that can no longer compute masks → `GrammarError`.
    pub(crate) fn sample_allowed(
        &mut self,
        sampler: &mut Sampler,
        logits: &[f32],
        maxima: &[f32],
        biases: &[(i32, f32)],
    ) -> Result<Option<i32>> {
        self.check_len(logits.len())?;
        let Engine::Llg(g) = &mut self.engine else {
            return Ok(None);
        };
        let n = logits.len();
        let mask = g.current_mask()?;
        let allowed = |t: i32| t >= 0 && (t as usize) < n && mask.is_allowed(t as u32);
        let few: Option<Vec<i32>> = (mask.num_set() <= FEW_ALLOWED).then(|| {
            let mut ids = Vec::new();
            mask.iter_set_entries(|i| {
                if i < n {
                    ids.push(i as i32);
                }
            });
            ids
        });
        Ok(sampler.sample_allowed(logits, maxima, biases, few.as_deref(), &allowed))
    }

    /// The `GrammarError` of a grammar that can no longer compute masks (llguidance hit a
    /// limit), if it is in that state.
    pub fn failure(&mut self) -> Option<LloyalError> {
        match &mut self.engine {
            Engine::Gbnf(_) => None,
            Engine::Llg(g) => g.current_mask().err(),
        }
    }

    /// Advance past `token`; a token the grammar forbids → `GrammarError`, state unchanged.
    pub fn accept(&mut self, token: i32) -> Result<()> {
        self.model.check_token(i64::from(token))?; // outside the vocabulary: InvalidToken
        if !self.allows(token) {
            return Err(self.forbidden(token));
        }
        match &mut self.engine {
            Engine::Gbnf(g) => g.accept(token)?,
            Engine::Llg(g) => g.accept(token)?,
        }
        self.accepted.push(token);
        Ok(())
    }

    /// The error for a forbidden token, naming its text (or the grammar's own failure).
    pub fn forbidden(&mut self, token: i32) -> LloyalError {
        if let Some(failed) = self.failure() {
            return failed;
        }
        let text = self.model.token_bytes(token, true).map(|b| String::from_utf8_lossy(&b).into_owned());
        LloyalError::Grammar(format!(
            "token {token} ({:?}) is not allowed by the grammar here; sample with the grammar \
             applied or check it with Grammar.apply first",
            text.unwrap_or_default()
        ))
    }
}

/// The engine for a GBNF `source` and, when `Auto` fell back to llama.cpp's, the reason.
fn gbnf_engine(model: &Model, source: &GrammarSource) -> Result<(Engine, Option<Arc<str>>)> {
    let syntax = read(source);
    // llama.cpp prints why it refused a grammar rather than logging it: lloyal's reader says why
    let why = syntax.as_ref().err().cloned();
    let llama = || {
        GbnfEngine::new(model, &source.text, &source.root).map(Engine::Gbnf).map_err(|e| match &why {
            Some(why) => {
                LloyalError::Grammar(format!("invalid grammar (root rule {:?}): {why}", source.root))
            }
            None => e,
        })
    };
    // Whichever engine: a grammar that accepts no text is refused as it is made (llama.cpp's
    // engine would only fail at the first token, blaming a logit bias).
    if let Some(reason) = syntax.as_ref().ok().and_then(|s| matches_nothing(s, &source.root)) {
        llama()?; // a grammar llama.cpp cannot read gets its reason first
        return Err(LloyalError::Grammar(reason));
    }
    if source.engine == GbnfEngineChoice::LlamaCpp {
        return Ok((llama()?, None));
    }
    match syntax.and_then(|s| translate(model, &s, &source.root)) {
        Ok(engine) => Ok((engine, None)),
        // A grammar llama.cpp refuses too gets llama.cpp's reason.
        Err(reason) if source.engine == GbnfEngineChoice::Llguidance => {
            llama()?;
            Err(LloyalError::Grammar(format!("llguidance cannot run this GBNF grammar: {reason}")))
        }
        Err(reason) => Ok((llama()?, Some(Arc::from(reason)))),
    }
}

/// `source` read by lloyal's GBNF reader, after the pre-flight check that keeps input which
/// would overflow a recursive parser's stack (deep nesting) away from it; or why not.
fn read(source: &GrammarSource) -> std::result::Result<gbnf_syntax::Syntax, String> {
    if source.text.trim().is_empty() || source.text.contains('\0') || source.root.contains('\0') {
        return Err("the grammar is empty or has a NUL byte".into());
    }
    gbnf_check::check_gbnf(&source.text).map_err(|e| e.to_string())?;
    gbnf_syntax::parse(&source.text).map_err(|e| format!("the grammar does not parse ({e})"))
}

/// Why the start rule `root` of `syntax` can match no text at all, if it cannot (llguidance
/// then finds no first token; llama.cpp's engine would take tokens until it is stuck).
fn matches_nothing(syntax: &gbnf_syntax::Syntax, root: &str) -> Option<String> {
    syntax.rule(root)?;
    let matching = syntax.matching_rules();
    if matching.contains(root) {
        return None;
    }
    let empty: Vec<&str> =
        syntax.rules.iter().map(|(n, _)| n.as_str()).filter(|n| !matching.contains(n)).take(4).collect();
    Some(format!(
        "the grammar accepts no text: rule {root:?} can match nothing (rules that match nothing: {}); \
         look for a character class with no characters, such as a backwards range like [z-a], or \
         rules that only lead back to themselves",
        empty.join(", ")
    ))
}

/// GBNF on llguidance: `syntax` translated to Lark (`gbnf_lark`), compiled; or why not.
fn translate(model: &Model, syntax: &gbnf_syntax::Syntax, root: &str) -> std::result::Result<Engine, String> {
    let resolve = |text: &str| match model.tokenize(text, false, true).as_slice() {
        [one] => u32::try_from(*one).ok(),
        _ => None,
    };
    let lark = gbnf_lark::to_lark(syntax, root, &resolve)?;
    LlgEngine::compile(model, GrammarKind::Lark, &lark)
        .map(|e| Engine::Llg(Box::new(e)))
        .map_err(|e| format!("llguidance refused its translation: {e}"))
}

#[cfg(test)]
mod tests {
    use super::GrammarKind;

    #[test]
    fn kind_names_round_trip_and_unknown_names_are_refused() {
        for kind in [GrammarKind::Gbnf, GrammarKind::JsonSchema, GrammarKind::Lark, GrammarKind::Regex] {
            assert_eq!(GrammarKind::parse(kind.name()), Some(kind));
        }
        assert_eq!(GrammarKind::JsonSchema.name(), "json_schema");
        assert_eq!(GrammarKind::parse("json"), None);
    }
}
