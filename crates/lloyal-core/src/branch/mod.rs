//! A branch: its private state (this file: sequence, sampler, logits snapshot, metrics,
//! biases), its single-branch operations (`ops`), BlinkKV reseed (`reseed`) and speculative
//! verify (`verify`).

pub(crate) mod logits;
pub mod ops;
pub mod reseed;
pub mod score;
pub mod verify;

pub(crate) use logits::Logits;
pub use ops::BranchInfo;

use std::sync::{Arc, Weak};

use crate::engine::gen::GenStream;
use crate::error::{LloyalError, Result};
use crate::grammar::Grammar;
use crate::metrics::{log_sum_exp_both, replaced_lse, PerplexityTracker};
use crate::sampler::{top_candidates, Sampler};
use crate::sampling::adjusted_replacements;

/// `logits` at the tokens in `keep`, `-inf` everywhere else.
fn keep_only(logits: &[f32], keep: impl IntoIterator<Item = i32>) -> Vec<f32> {
    let mut masked = vec![f32::NEG_INFINITY; logits.len()];
    for t in keep {
        masked[t as usize] = logits[t as usize];
    }
    masked
}

/// `logits` with every token the grammar forbids at `-inf` (the caller also masks the tokens
/// biased to `-inf`), as far as sampling with `sampler` can tell: with top-k active (no
/// DRY/mirostat, which see every candidate) only the best candidates after penalties and
/// biases are checked, doubling the window until `top_k` allowed tokens are found (the chain
/// keeps exactly the top-k allowed ones) or the unchecked rest could only add under 1e-7 of
/// probability mass; otherwise the whole vocabulary is masked.
fn allowed_logits(
    grammar: &mut Grammar,
    logits: &[f32],
    sampler: &Sampler,
    biases: &[(i32, f32)],
) -> Result<Vec<f32>> {
    if grammar.accepted().is_empty() {
        // At the start rule the allowed set is a property of the grammar alone (cached).
        return Ok(keep_only(logits, grammar.start_allowed().iter().copied()));
    }
    let params = sampler.params();
    if params.top_k <= 0 || params.dry.is_some() || params.mirostat.is_some() {
        let mut masked = logits.to_vec();
        grammar.mask(&mut masked)?;
        return Ok(masked);
    }
    let k = params.top_k as usize;
    let repl = adjusted_replacements(logits, sampler.history(), params, biases);
    let mut window = (4 * k).max(256);
    loop {
        let top: Vec<(i32, f32)> = top_candidates(logits, &repl, window.min(logits.len()))
            .into_iter()
            .filter(|c| c.1 != f32::NEG_INFINITY)
            .collect();
        let ids: Vec<i32> = top.iter().map(|c| c.0).collect();
        let allowed = grammar.allowed_among(&ids);
        let keep: Vec<i32> =
            ids.iter().zip(&allowed).filter(|(_, &ok)| ok).map(|(&t, _)| t).take(k).collect();
        // Tokens outside the window score at most `boundary`; once even k of them would carry
        // under 1e-7 of the best allowed token's probability (after temperature), they cannot
        // change the draw beyond that mass, so the rest of the vocabulary need not be checked.
        let best_allowed = top.iter().zip(&allowed).find(|(_, &ok)| ok).map(|(c, _)| c.1);
        let boundary = top.last().map(|c| c.1).unwrap_or(f32::NEG_INFINITY);
        let negligible = best_allowed.is_some_and(|best| {
            let t = if params.temperature > 0.0 { params.temperature } else { 1.0 };
            let missing = k.saturating_sub(keep.len()).max(1) as f32;
            (boundary - best) / t < (1e-7f32 / missing).ln()
        });
        if keep.len() == k || negligible || window >= logits.len() || ids.len() < window {
            return Ok(keep_only(logits, keep));
        }
        window *= 4;
    }
}

/// What drawing a produced token did to the sampler, applied when that token is committed.
pub(crate) enum Drawn {
    /// The final draw's RNG state after the draw (the chain itself keeps no state).
    Rng(u64),
    /// The copy the token was drawn with (mirostat, XTC: the chain changed too).
    Sampler(Box<Sampler>),
}

/// The tokens a generation request bans on its branch until it has made its `min_tokens` (the
/// model's end-of-generation tokens and the request's stop tokens, as vLLM's `min_tokens`
/// does): in force while its stream runs, so a request that ends any way leaves none behind.
/// The stream is held weakly: a request that ended before its `min_tokens` leaves an inactive
/// ban, which keeps nothing of the request alive.
#[derive(Clone)]
pub(crate) struct GenBan {
    pub(crate) tokens: Arc<Vec<i32>>,
    pub(crate) stream: Weak<GenStream>,
}

/// How [`draw`] starts over from the sampler's state before the draw (a grammar resample).
enum Reset<'a> {
    Rng(u64),
    Clone(&'a Sampler),
}

/// Token `t`'s logit with `biases` added (a ban is -inf whatever the logit).
fn biased_logit(logits: &[f32], biases: &[(i32, f32)], t: i32) -> f32 {
    let base = logits.get(t as usize).copied().unwrap_or(f32::NEG_INFINITY);
    biases.iter().filter(|b| b.0 == t).fold(base, |v, b| crate::sampling::biased(v, b.1))
}

/// One token from `logits` with `sampler`, honouring the grammar: llguidance masks before
/// drawing; GBNF checks the unconstrained draw and, only when it is rejected, draws again from
/// the masked logits with the sampler reset as before the first draw.
fn draw(
    sampler: &mut Sampler,
    reset: Reset<'_>,
    grammar: Option<&mut Grammar>,
    logits: &Logits,
    biases: &[(i32, f32)],
    resamples: &mut u64,
) -> Result<i32> {
    let nothing_allowed = || {
        LloyalError::Grammar(
            "the grammar allows no token here: every token it allows is banned (by a logit \
             bias, or by min_tokens, which bans the end of generation where the grammar can only \
             end); change the bias, min_tokens or the grammar"
                .into(),
        )
    };
    let unconstrained = |sampler: &mut Sampler| {
        sampler.sample_with(logits, logits.maxima(), biases, || logits.stats().argmax)
    };
    let Some(grammar) = grammar else {
        let token = unconstrained(sampler);
        // A -inf token is drawn only when nothing finite is left: the bias banned every token
        // the row did not (the sampler's fallback would hand out the first banned one).
        return if biased_logit(logits, biases, token) == f32::NEG_INFINITY {
            Err(LloyalError::invalid(
                "every token the logits leave is banned by the logit bias or steering: no token could be \
                 sampled; ban fewer tokens",
            ))
        } else {
            Ok(token)
        };
    };
    if grammar.masks_first() {
        // llguidance: the mask is cheap, so apply it before drawing (one draw, exact), on the
        // k best allowed tokens when the sampler takes top-k, else on a masked copy of the row.
        if let Some(token) = grammar.sample_allowed(sampler, logits, logits.maxima(), biases)? {
            return if grammar.allows(token) { Ok(token) } else { Err(grammar.forbidden(token)) };
        }
        let mut masked = grammar.masked(logits)?;
        for &(i, v) in biases {
            if v == f32::NEG_INFINITY {
                masked[i as usize] = v;
            }
        }
        if masked.iter().all(|&l| l == f32::NEG_INFINITY) {
            return Err(nothing_allowed());
        }
        let token = sampler.sample(&masked, biases);
        return if grammar.allows(token) { Ok(token) } else { Err(grammar.forbidden(token)) };
    }
    // Sample unconstrained first; only a rejected token pays for the full mask.
    let token = unconstrained(sampler);
    if grammar.allows(token) {
        return Ok(token);
    }
    let mut masked = allowed_logits(grammar, logits, sampler, biases)?;
    for &(i, v) in biases.iter().filter(|b| b.1 == f32::NEG_INFINITY) {
        masked[i as usize] = v;
    }
    if masked.iter().all(|&l| l == f32::NEG_INFINITY) {
        return Err(nothing_allowed());
    }
    match reset {
        Reset::Rng(state) => sampler.set_rng_state(state),
        Reset::Clone(original) => *sampler = original.try_clone()?,
    }
    let token = sampler.sample(&masked, biases);
    *resamples += 1;
    if grammar.allows(token) {
        Ok(token)
    } else {
        Err(grammar.forbidden(token))
    }
}

/// Everything a branch owns besides its KV cells and tree links.
pub struct BranchState {
    /// The leased sequence id.
    pub seq_id: i32,
    /// Next position to write (= cells of this sequence when it starts at 0).
    pub position: i32,
    /// Position where this branch diverged from its parent (its own cells are `[fork_head, position)`).
    pub fork_head: i32,
    pub(crate) sampler: Sampler,
    /// A produced-but-not-accepted token with what its draw did to the sampler, so
    /// `produce()` is idempotent and accepting that token keeps the RNG stream.
    pub(crate) pending: Option<(i32, Drawn)>,
    /// Whether `pending` was drawn under [`Self::gen_ban`] (drawn again when that changed).
    pub(crate) pending_banned: bool,
    /// Tokens a generation request on this branch bans until it has made its `min_tokens`.
    pub(crate) gen_ban: Option<GenBan>,
    pub(crate) model_ppl: PerplexityTracker,
    pub(crate) sampling_ppl: PerplexityTracker,
    /// Whether commits add to `sampling_ppl` (the context's `sampling_perplexity` option): its
    /// sum over the row at `1 / temperature` is a second exponential a value, so a context that
    /// never reads it does not pay for it.
    pub(crate) tracks_sampling: bool,
    /// Logits after the last decode (empty before any), read in place in llama.cpp's output
    /// buffer until a decode may overwrite it ([`Logits`]). Shared with forks until either
    /// side decodes again: forks of one branch copy its row (262,144 floats, 1 MiB, for
    /// Gemma 3) out of that buffer once between them.
    pub(crate) logits: Arc<Logits>,
    /// Where a decode writes new logits before they are published.
    pub(crate) next_logits: Logits,
    /// Inherited by forks; `-inf` bans a token.
    pub(crate) logit_bias: Vec<(i32, f32)>,
    /// Per-branch steering, not inherited.
    pub(crate) steer: Vec<(i32, f32)>,
    /// Grammar parse state (cloned on fork); sampled tokens are checked against it.
    pub(crate) grammar: Option<Grammar>,
    /// GBNF rejections of the unconstrained sample (each cost one full mask); llguidance
    /// grammars mask before sampling and never resample.
    pub(crate) grammar_resamples: u64,
}

impl BranchState {
    /// A fresh branch on `seq_id` at `position`; `tracks_sampling`: whether it keeps its
    /// sampling perplexity.
    pub fn new(seq_id: i32, position: i32, sampler: Sampler, tracks_sampling: bool) -> Self {
        BranchState {
            seq_id,
            position,
            fork_head: position,
            sampler,
            pending: None,
            pending_banned: false,
            gen_ban: None,
            model_ppl: PerplexityTracker::new(),
            sampling_ppl: PerplexityTracker::new(),
            tracks_sampling,
            logits: Arc::default(),
            next_logits: Logits::default(),
            logit_bias: Vec::new(),
            steer: Vec::new(),
            grammar: None,
            grammar_resamples: 0,
        }
    }

    /// A child on `seq_id`: same position, cloned sampler/metrics/bias, logits if asked.
    pub fn fork(&self, seq_id: i32, clone_logits: bool) -> Result<Self> {
        Ok(BranchState {
            seq_id,
            position: self.position,
            fork_head: self.position,
            sampler: self.sampler.try_clone()?,
            pending: None,
            pending_banned: false,
            gen_ban: None,
            model_ppl: self.model_ppl.clone(),
            sampling_ppl: self.sampling_ppl.clone(),
            tracks_sampling: self.tracks_sampling,
            logits: if clone_logits { Logits::share(&self.logits) } else { Arc::default() },
            next_logits: Logits::default(),
            logit_bias: self.logit_bias.clone(),
            steer: Vec::new(),
            grammar: self.grammar.as_ref().map(Grammar::try_clone).transpose()?,
            grammar_resamples: 0,
        })
    }

    /// An exact copy of everything this state holds (sampler and grammar state, a produced
    /// token, metrics, logits, position), for restoring after a multi-step call fails part-way.
    pub(crate) fn snapshot(&self) -> Result<Self> {
        let pending = match &self.pending {
            Some((t, Drawn::Rng(state))) => Some((*t, Drawn::Rng(*state))),
            Some((t, Drawn::Sampler(s))) => Some((*t, Drawn::Sampler(Box::new(s.try_clone()?)))),
            None => None,
        };
        Ok(BranchState {
            seq_id: self.seq_id,
            position: self.position,
            fork_head: self.fork_head,
            sampler: self.sampler.try_clone()?,
            pending,
            pending_banned: self.pending_banned,
            gen_ban: self.gen_ban.clone(),
            model_ppl: self.model_ppl.clone(),
            sampling_ppl: self.sampling_ppl.clone(),
            tracks_sampling: self.tracks_sampling,
            logits: Logits::share(&self.logits),
            next_logits: Logits::default(),
            logit_bias: self.logit_bias.clone(),
            steer: self.steer.clone(),
            grammar: self.grammar.as_ref().map(Grammar::try_clone).transpose()?,
            grammar_resamples: self.grammar_resamples,
        })
    }

    /// A child on `seq_id` that keeps only the first `at` positions (`0 < at < position`): no
    /// logits (prefill before sampling), no grammar, fresh metrics; the sampler (and its
    /// penalty history) is cloned.
    pub fn fork_at(&self, seq_id: i32, at: i32) -> Result<Self> {
        Ok(BranchState {
            seq_id,
            position: at,
            fork_head: at,
            sampler: self.sampler.try_clone()?,
            pending: None,
            pending_banned: false,
            gen_ban: None,
            model_ppl: Default::default(),
            sampling_ppl: Default::default(),
            tracks_sampling: self.tracks_sampling,
            logits: Arc::default(),
            next_logits: Logits::default(),
            logit_bias: self.logit_bias.clone(),
            steer: Vec::new(),
            grammar: None,
            grammar_resamples: 0,
        })
    }

    /// The logits snapshot, or `NoLogits`.
    pub fn logits(&self) -> Result<&[f32]> {
        if self.logits.is_empty() {
            Err(LloyalError::NoLogits)
        } else {
            Ok(&self.logits)
        }
    }

    /// Logit bias then steering, as one list.
    pub(crate) fn biases(&self) -> Vec<(i32, f32)> {
        let mut out: Vec<(i32, f32)> = self.logit_bias.iter().chain(self.steer.iter()).copied().collect();
        if let Some(ban) = self.gen_ban.as_ref().filter(|_| self.ban_active()) {
            out.extend(ban.tokens.iter().map(|&t| (t, f32::NEG_INFINITY)));
        }
        out
    }

    /// Whether a generation request's ban holds: set, and its request still running.
    pub(crate) fn ban_active(&self) -> bool {
        self.gen_ban.as_ref().is_some_and(|b| b.stream.upgrade().is_some_and(|s| !s.ended()))
    }

    /// Sample without side effects on the branch's committed state (idempotent until the
    /// logits, sampler or biases change). The draw runs on the branch's own sampler, whose RNG
    /// is put back until the token is committed; only a chain whose draw changes more
    /// (mirostat, XTC) draws on a copy.
    pub fn produce(&mut self) -> Result<i32> {
        let banned = self.ban_active();
        if let Some((token, _)) = &self.pending {
            if self.pending_banned == banned {
                return Ok(*token);
            }
            self.pending = None; // drawn before a ban began or after it ended: draw again
        }
        self.logits()?;
        self.pending_banned = banned;
        let biases = self.biases();
        let BranchState { sampler, grammar, logits, grammar_resamples, .. } = self;
        let before = sampler.rng_state();
        if sampler.draw_mutates_chain() {
            let mut copy = sampler.try_clone()?;
            let token =
                draw(&mut copy, Reset::Clone(sampler), grammar.as_mut(), logits, &biases, grammar_resamples)?;
            self.pending = Some((token, Drawn::Sampler(Box::new(copy))));
            return Ok(token);
        }
        let drawn = draw(sampler, Reset::Rng(before), grammar.as_mut(), logits, &biases, grammar_resamples);
        let after = sampler.rng_state();
        sampler.set_rng_state(before);
        let token = drawn?;
        self.pending = Some((token, Drawn::Rng(after)));
        Ok(token)
    }

    /// Check `token` against the grammar (no state change): `GrammarError` if forbidden.
    pub(crate) fn check_grammar(&mut self, token: i32) -> Result<()> {
        if let Some(g) = self.grammar.as_mut() {
            if !g.allows(token) {
                return Err(g.forbidden(token));
            }
        }
        Ok(())
    }

    /// The scale of the sampling distribution's logits: `1 / temperature` (1 when greedy).
    pub(crate) fn sampling_scale(&self) -> f32 {
        let t = self.sampler.params().temperature;
        if t > 0.0 {
            1.0 / t
        } else {
            1.0
        }
    }

    /// The scale a decode's summary of this branch's row sums at besides 1 (the sampling
    /// perplexity's), or `None` when the branch does not track it.
    pub(crate) fn summary_scale(&self) -> Option<f32> {
        self.tracks_sampling.then(|| self.sampling_scale())
    }

    /// Surprisals (model, sampling) of `token` under the current snapshot, in nats; the
    /// sampling one `None` when the branch does not track it. `None` before any logits exist.
    /// O(penalties + biases) when the snapshot's pass summed the sampling scale (a decode's row,
    /// [`Logits::fill_in_place`]); one pass over the row otherwise.
    pub(crate) fn surprisals(&self, token: i32) -> Option<(f64, Option<f64>)> {
        if self.logits.is_empty() {
            return None;
        }
        let t = token as usize;
        let model_logit = *self.logits.get(t)?;
        let model = self.logits.surprisal(t);
        if !self.tracks_sampling {
            return Some((model, None));
        }
        let params = self.sampler.params();
        let repl = adjusted_replacements(&self.logits, self.sampler.history(), params, &self.biases());
        let scale = self.sampling_scale();
        let sampled_logit = repl.iter().find(|(i, _)| *i == t).map(|r| r.1).unwrap_or(model_logit);
        if repl.is_empty() && scale == 1.0 {
            return Some((model, Some(model)));
        }
        let stats = self.logits.stats();
        let lse_sampling = match (scale == 1.0, stats.scaled_lse(scale)) {
            (true, _) => replaced_lse(stats.lse, &self.logits, 1.0, &repl),
            (false, Some(raw)) => replaced_lse(raw, &self.logits, scale, &repl),
            (false, None) => log_sum_exp_both(&self.logits, scale, &repl).1,
        };
        let sampling = if sampled_logit == f32::NEG_INFINITY {
            f64::INFINITY
        } else {
            (lse_sampling - f64::from(sampled_logit) * f64::from(scale)).max(0.0)
        };
        Some((model, Some(sampling)))
    }

    /// Record an accepted token: metrics (from precomputed surprisals) and sampler history.
    /// The grammar must already allow `token` ([`Self::check_grammar`]).
    pub(crate) fn accept_with(&mut self, token: i32, surprisals: Option<(f64, Option<f64>)>) {
        if let Some(g) = self.grammar.as_mut() {
            // Pre-checked by every caller, so this cannot fail; if it ever did, the grammar is
            // left as it was (accept checks first) and the token still joins the history.
            let _ = g.accept(token);
        }
        if let Some((m, s)) = surprisals {
            self.model_ppl.add(m);
            if let Some(s) = s {
                self.sampling_ppl.add(s);
            }
        }
        match self.pending.take() {
            Some((t, Drawn::Rng(state))) if t == token => self.sampler.set_rng_state(state),
            Some((t, Drawn::Sampler(advanced))) if t == token => self.sampler = *advanced,
            _ => {}
        }
        self.sampler.accept(token);
    }

    /// Forget a produced token (the inputs it was drawn from changed).
    pub(crate) fn invalidate(&mut self) {
        self.pending = None;
    }

    /// Publish `next_logits` as the snapshot. The old snapshot's buffer becomes the next
    /// write target unless a fork still shares it.
    pub(crate) fn publish_logits(&mut self) {
        let fresh = Arc::new(std::mem::take(&mut self.next_logits));
        let old = std::mem::replace(&mut self.logits, fresh);
        self.next_logits = Arc::try_unwrap(old).map(Logits::recycle).unwrap_or_default();
        self.pending = None;
    }

    /// Model perplexity of accepted tokens (`inf` before any).
    pub fn perplexity(&self) -> f64 {
        self.model_ppl.perplexity()
    }

    /// Perplexity under the sampling distribution (penalties, biases, temperature);
    /// `SamplingPerplexityOff` when the branch's context does not track it.
    pub fn sampling_perplexity(&self) -> Result<f64> {
        if self.tracks_sampling {
            Ok(self.sampling_ppl.perplexity())
        } else {
            Err(LloyalError::SamplingPerplexityOff)
        }
    }
}
