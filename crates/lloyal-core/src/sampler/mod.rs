//! A sampler chain owned at the llama.cpp sys level: built from SamplingParams, cloneable
//! (RNG and DRY history included), applied to a logits snapshot. The final draw's RNG is in
//! `rng.rs`, the choice of candidates from a row in `candidates.rs`; the chains that are the
//! temperature alone (`temperature.rs`) or top-p alone (`top_p.rs`) are drawn from the row
//! without the chain, with the same tokens, a row with replacements read through
//! `replaced.rs`.

mod candidates;
mod replaced;
mod rng;
mod temperature;
mod top_p;

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Mutex;

use llama_cpp_sys_2 as sys;

use crate::error::{LloyalError, Result};
use crate::model::Model;
use crate::sampling::{adjusted_replacements, SamplingParams};
use candidates::{allowed_finite, best_allowed_in_windows, greedy_token_in, pad_to_k, token_data};
pub use candidates::{argmax, greedy_token, top_candidates, top_candidates_in};
pub use rng::Rng;
use rng::{draw, draw_index, rng_for};

/// llama.cpp's LLAMA_DEFAULT_SEED: draw a random seed.
const RANDOM_SEED: u32 = 0xFFFF_FFFF;

/// Most tokens of accepted history kept for penalties (and replayed when rebuilding).
pub const MAX_HISTORY: usize = 8192;

/// Owned `llama_sampler*` chain. Freed on drop.
struct RawChain(NonNull<sys::llama_sampler>);

// SAFETY: a llama_sampler is plain heap state with no thread affinity; the chain is only
// used through &mut (one thread at a time), and the context lock serialises use.
unsafe impl Send for RawChain {}

impl Drop for RawChain {
    fn drop(&mut self) {
        // SAFETY: the pointer came from llama_sampler_chain_init/clone and is freed once.
        unsafe { sys::llama_sampler_free(self.0.as_ptr()) }
    }
}

/// DRY samplers made before, by their settings, for [`DryPrototypes::sampler`] to clone.
#[derive(Default)]
pub struct DryPrototypes(Mutex<Vec<(DryKey, RawChain)>>);

/// A DRY sampler's settings: multiplier and base (bits), allowed length, window, breakers.
type DryKey = (u32, u32, i32, i32, Vec<String>);

/// How many DRY settings a model keeps made (a server's requests mostly share one).
const DRY_PROTOTYPES: usize = 8;

impl DryPrototypes {
    /// A new DRY sampler for `dry` over `window` tokens (owned by the caller): a clone of the one
    /// made for the same settings before. Making one scans the whole vocabulary for every
    /// sequence breaker (llama.cpp's `get_overlapping_token_sequences`: ~48 ms for the 4 default
    /// breakers with 262,144 tokens, paid by every request that asked for DRY); a clone copies
    /// what the scan found.
    fn sampler(
        &self,
        vocab: *const sys::llama_vocab,
        dry: &crate::sampling::Dry,
        window: i32,
    ) -> Result<*mut sys::llama_sampler> {
        let key: DryKey = (
            dry.multiplier.to_bits(),
            dry.base.to_bits(),
            dry.allowed_length,
            window,
            dry.sequence_breakers.clone(),
        );
        let mut made = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(at) = made.iter().position(|(k, _)| *k == key) {
            let hit = made.remove(at);
            let clone = hit.1.cloned();
            made.push(hit); // most recently used last
            return Ok(clone);
        }
        let breakers: Vec<CString> = dry
            .sequence_breakers
            .iter()
            .map(|s| {
                CString::new(s.as_str()).map_err(|_| LloyalError::invalid("NUL in dry sequence breaker"))
            })
            .collect::<Result<_>>()?;
        let mut ptrs: Vec<*const std::ffi::c_char> = breakers.iter().map(|c| c.as_ptr()).collect();
        // SAFETY: vocab outlives the call; breaker strings live until after init copies them.
        let smpl = unsafe {
            sys::llama_sampler_init_dry(
                vocab,
                dry.multiplier,
                dry.base,
                dry.allowed_length,
                window,
                ptrs.as_mut_ptr(),
                ptrs.len(),
            )
        };
        let proto = NonNull::new(smpl)
            .map(RawChain)
            .ok_or_else(|| LloyalError::invalid("llama.cpp rejected the DRY settings"))?;
        let clone = proto.cloned();
        if made.len() >= DRY_PROTOTYPES {
            made.remove(0);
        }
        made.push((key, proto));
        Ok(clone)
    }
}

impl RawChain {
    /// A fresh copy of this sampler (null when llama.cpp cannot allocate one).
    fn cloned(&self) -> *mut sys::llama_sampler {
        // SAFETY: a valid sampler; a clone only reads it (the prototype is never applied), under
        // the prototypes' lock.
        unsafe { sys::llama_sampler_clone(self.0.as_ptr()) }
    }

    fn new() -> Result<Self> {
        // SAFETY: plain constructor calls with default params.
        let ptr = unsafe { sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params()) };
        NonNull::new(ptr).map(RawChain).ok_or_else(|| {
            LloyalError::Backend("llama_sampler_chain_init returned null (out of memory?)".into())
        })
    }

    fn add(&mut self, smpl: *mut sys::llama_sampler) -> Result<()> {
        if smpl.is_null() {
            return Err(LloyalError::invalid("llama.cpp rejected a sampler setting"));
        }
        // SAFETY: the chain takes ownership of a valid, non-null sampler.
        unsafe { sys::llama_sampler_chain_add(self.0.as_ptr(), smpl) };
        Ok(())
    }
}

/// One sequence's sampling machinery: the llama.cpp chain plus the Rust-side token history
/// (used for penalties, which are applied on the logits in O(history)) and the RNG of the
/// final draw.
pub struct Sampler {
    chain: RawChain,
    params: SamplingParams,
    history: Vec<i32>,
    rng: Rng,
    candidates: Vec<sys::llama_token_data>,
}

/// Whether the chain of `params` is the temperature alone ([`plan_steps`] with every filter
/// off, no DRY, no mirostat, not greedy): a draw from softmax(logits / temperature).
fn only_temperature(params: &SamplingParams) -> bool {
    params.top_p >= 1.0 && temperature_after(params)
}

/// Whether the chain of `params` is top-p then the temperature: [`only_temperature`] with a
/// top-p below 1 (so the chain sees the whole row).
fn only_top_p(params: &SamplingParams) -> bool {
    params.top_p < 1.0 && temperature_after(params)
}

/// Whether the chain of `params` ends with the temperature and has no filter but (maybe)
/// top-p: no top-k, typical, min-p, XTC, DRY or mirostat, not greedy.
fn temperature_after(params: &SamplingParams) -> bool {
    !params.is_greedy()
        && params.temperature > 0.0
        && params.top_k <= 0
        && params.typical_p >= 1.0
        && params.min_p <= 0.0
        && params.xtc.as_ref().is_none_or(|x| x.probability <= 0.0)
        && params.dry.as_ref().is_none_or(|d| d.multiplier <= 0.0)
        && params.mirostat.is_none()
}

fn seed_of(params: &SamplingParams) -> u32 {
    params.seed.unwrap_or(RANDOM_SEED)
}

/// One llama.cpp sampler of a chain, in order.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    Temp(f32),
    Mirostat { n_vocab: i32, seed: u32, tau: f32, eta: f32 },
    MirostatV2 { seed: u32, tau: f32, eta: f32 },
    Greedy,
    TopK(i32),
    Typical(f32),
    TopP(f32),
    MinP(f32),
    Xtc { p: f32, t: f32, min_keep: usize, seed: u32 },
}

/// The chain order of llama.cpp's common sampler (penalties and biases are applied on the
/// logits before the chain; DRY is added first by `build_chain`).
fn plan_steps(params: &SamplingParams, n_vocab: i32) -> Vec<Step> {
    let seed = seed_of(params);
    if let Some(m) = &params.mirostat {
        let last = if m.version == 1 {
            Step::Mirostat { n_vocab, seed, tau: m.tau, eta: m.eta }
        } else {
            Step::MirostatV2 { seed, tau: m.tau, eta: m.eta }
        };
        return vec![Step::Temp(params.temperature.max(0.0)), last];
    }
    if params.is_greedy() {
        return vec![Step::Greedy];
    }
    let mut steps = Vec::new();
    if params.top_k > 0 {
        steps.push(Step::TopK(params.top_k));
    }
    if params.typical_p < 1.0 {
        steps.push(Step::Typical(params.typical_p));
    }
    if params.top_p < 1.0 {
        steps.push(Step::TopP(params.top_p));
    }
    if params.min_p > 0.0 {
        steps.push(Step::MinP(params.min_p));
    }
    if let Some(x) = params.xtc.as_ref().filter(|x| x.probability > 0.0) {
        steps.push(Step::Xtc { p: x.probability, t: x.threshold, min_keep: x.min_keep.max(1), seed });
    }
    // The final draw is ours ([`Rng`]), so its state can be saved and restored exactly.
    steps.push(Step::Temp(params.temperature));
    steps
}

fn init_step(step: Step) -> *mut sys::llama_sampler {
    // SAFETY: each llama_sampler_init_* is a plain constructor taking scalars (validated by
    // SamplingParams::validate); the result is null-checked by RawChain::add.
    unsafe {
        match step {
            Step::Temp(t) => sys::llama_sampler_init_temp(t),
            Step::Mirostat { n_vocab, seed, tau, eta } => {
                sys::llama_sampler_init_mirostat(n_vocab, seed, tau, eta, 100)
            }
            Step::MirostatV2 { seed, tau, eta } => sys::llama_sampler_init_mirostat_v2(seed, tau, eta),
            Step::Greedy => sys::llama_sampler_init_greedy(),
            Step::TopK(k) => sys::llama_sampler_init_top_k(k),
            Step::Typical(p) => sys::llama_sampler_init_typical(p, 1),
            Step::TopP(p) => sys::llama_sampler_init_top_p(p, 1),
            Step::MinP(p) => sys::llama_sampler_init_min_p(p, 1),
            Step::Xtc { p, t, min_keep, seed } => sys::llama_sampler_init_xtc(p, t, min_keep, seed),
        }
    }
}

fn build_chain(model: &Model, params: &SamplingParams) -> Result<RawChain> {
    params.validate()?;
    let mut chain = RawChain::new()?;
    let vocab = crate::raw::vocab_ptr(model.llama());
    if let Some(dry) = params.dry.as_ref().filter(|d| d.multiplier > 0.0) {
        // llama.cpp clamps a negative window to 0 (= DRY off); -1 means "whole history" in our API.
        let window = if dry.penalty_last_n < 0 {
            i32::try_from(model.n_ctx_train()).unwrap_or(i32::MAX)
        } else {
            dry.penalty_last_n
        };
        let smpl = model.dry_prototypes().sampler(vocab, dry, window)?;
        chain.add(smpl)?;
    }
    for step in plan_steps(params, model.n_vocab()) {
        chain.add(init_step(step))?;
    }
    Ok(chain)
}

impl Sampler {
    /// Build a sampler for `params` (validated first).
    pub fn new(model: &Model, params: SamplingParams) -> Result<Self> {
        let chain = build_chain(model, &params)?;
        let rng = rng_for(&params);
        Ok(Sampler { chain, params, history: Vec::new(), rng, candidates: Vec::new() })
    }

    /// Rebuild a sampler from saved parts: parameters, accepted history (replayed into DRY /
    /// mirostat state) and the RNG state.
    pub fn restore(model: &Model, params: SamplingParams, history: Vec<i32>, rng_state: u64) -> Result<Self> {
        model.check_tokens(&history)?;
        let mut s = Sampler::new(model, params)?;
        s.history = history;
        s.replay_history();
        s.rng = Rng::from_state(rng_state);
        Ok(s)
    }

    /// The RNG state of the final draw (for saving).
    pub fn rng_state(&self) -> u64 {
        self.rng.state()
    }

    /// Put the final draw's RNG back to `state` (from [`Self::rng_state`]).
    pub fn set_rng_state(&mut self, state: u64) {
        self.rng = Rng::from_state(state);
    }

    /// Whether a draw changes more than the final draw's RNG: mirostat updates its `mu`, XTC
    /// draws from an RNG of its own. Every other step of the chain keeps no state between
    /// draws (DRY and the penalties change only when a token is accepted).
    pub fn draw_mutates_chain(&self) -> bool {
        self.params.mirostat.is_some() || self.params.xtc.as_ref().is_some_and(|x| x.probability > 0.0)
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Accepted-token history (most recent last, at most [`MAX_HISTORY`]).
    pub fn history(&self) -> &[i32] {
        &self.history
    }

    /// Switch to new parameters, keeping the token history (replayed into stateful samplers).
    /// A no-op when the parameters are unchanged.
    pub fn set_params(&mut self, model: &Model, params: SamplingParams) -> Result<()> {
        if params == self.params {
            return Ok(());
        }
        if params.seed != self.params.seed {
            self.rng = rng_for(&params);
        }
        self.rebuild(model, params)
    }

    /// Restart the RNG with `seed` (history kept). The chain is rebuilt even when the seed is
    /// unchanged, so XTC's own RNG restarts too.
    pub fn reseed(&mut self, model: &Model, seed: u32) -> Result<()> {
        self.rebuild(model, SamplingParams { seed: Some(seed), ..self.params.clone() })?;
        self.rng = Rng::seeded(seed);
        Ok(())
    }

    /// Forget the accepted history: penalties, DRY and mirostat start as a new sampler's (the
    /// parameters and the RNG kept). On error nothing changes.
    pub fn forget_history(&mut self, model: &Model) -> Result<()> {
        let chain = build_chain(model, &self.params)?;
        self.chain = chain;
        self.history.clear();
        Ok(())
    }

    /// A fresh llama.cpp chain for `params`, with the accepted history replayed into its
    /// stateful samplers (DRY, mirostat). On error nothing changes.
    fn rebuild(&mut self, model: &Model, params: SamplingParams) -> Result<()> {
        self.chain = build_chain(model, &params)?;
        self.params = params;
        self.replay_history();
        Ok(())
    }

    /// Feed the accepted history into the chain's stateful samplers (DRY, mirostat).
    fn replay_history(&mut self) {
        for &t in &self.history {
            // SAFETY: valid chain; history tokens were range-checked when accepted/restored.
            unsafe { sys::llama_sampler_accept(self.chain.0.as_ptr(), t) };
        }
    }

    /// Pick a token from `logits` (not modified). Penalties use this sampler's history.
    /// `extra_bias` entries are added to the logits first (logit bias, steering).
    ///
    /// With top-k active (and no DRY, which must see every candidate), the k best tokens
    /// are selected here in one O(n) pass and only they reach llama.cpp's chain, instead of
    /// a 262k-entry candidate array that llama.cpp would partially sort. A chain that is the
    /// temperature alone, or top-p then the temperature, is not run at all: the same token is
    /// drawn from the row ([`temperature`], [`top_p`]).
    pub fn sample(&mut self, logits: &[f32], extra_bias: &[(i32, f32)]) -> i32 {
        self.sample_with(logits, &[], extra_bias, || argmax(logits))
    }

    /// [`Self::sample`] with what a snapshot's summary knows already
    /// ([`crate::scan::scan_row`]): `maxima`, the maximum of each `scan::SPAN` logits (empty:
    /// not known), and `argmax`, asked only for a greedy draw that nothing replaces (no
    /// penalties or biases).
    pub fn sample_with(
        &mut self,
        logits: &[f32],
        maxima: &[f32],
        extra_bias: &[(i32, f32)],
        argmax: impl FnOnce() -> i32,
    ) -> i32 {
        let repl = adjusted_replacements(logits, &self.history, &self.params, extra_bias);
        let p = &self.params;
        if p.is_greedy() && p.dry.is_none() {
            return if repl.is_empty() { argmax() } else { greedy_token_in(logits, maxima, &repl) };
        }
        if only_temperature(p) {
            // The chain would only divide by the temperature: drawn straight from the row.
            let u = self.rng.next_f64();
            return temperature::temperature_draw(logits, maxima, &repl, p.temperature, u)
                .unwrap_or_else(|| greedy_token(logits, &repl));
        }
        let mut drawn = None;
        if only_top_p(p) {
            let nucleus =
                top_p::survivors(logits, maxima, &repl, p.top_p, p.temperature, &mut self.candidates);
            if let Some(nucleus) = nucleus {
                // The chain's survivors, found without it: drawn as `draw_candidates` draws them,
                // unless the draw lands on a token tied with a neighbour (the chain's order).
                let u = self.rng.next_f64();
                match draw_index(&self.candidates, u) {
                    Some(at) if nucleus.drawn_untied(at) => return self.candidates[at].id,
                    Some(_) => drawn = Some(u),
                    None => return greedy_token(logits, &repl),
                }
            }
        }
        self.candidates.clear();
        if p.top_k > 0 && p.dry.is_none() && p.mirostat.is_none() {
            let top = top_candidates_in(logits, maxima, &repl, p.top_k as usize);
            self.candidates.extend(top.into_iter().map(token_data));
        } else {
            self.candidates
                .extend(logits.iter().enumerate().map(|(i, &logit)| token_data((i as i32, logit))));
            for &(i, v) in &repl {
                self.candidates[i].logit = v;
            }
        }
        self.draw_candidates(drawn, || greedy_token(logits, &repl))
    }

    /// [`Self::sample_with`] over `logits` with every token `allowed` rejects at `-inf` (a
    /// grammar's mask), without building that row. With top-k (and neither DRY nor mirostat,
    /// which see every candidate) or greedy, the candidates are the k best allowed tokens: taken
    /// from `few` (every allowed token, when a grammar allows few) or from the row's best tokens
    /// in a window that grows while it holds fewer than k allowed ones (`maxima`: the row's span
    /// maxima), then padded with `-inf` candidates as top-k of the masked row is. The same
    /// candidates, so the same token, as [`Self::sample`] of the masked row; `None` when that
    /// needs the whole row (no top-k, fewer than k allowed outside `few`, nothing allowed).
    pub fn sample_allowed(
        &mut self,
        logits: &[f32],
        maxima: &[f32],
        extra_bias: &[(i32, f32)],
        few: Option<&[i32]>,
        allowed: &dyn Fn(i32) -> bool,
    ) -> Option<i32> {
        let p = &self.params;
        let greedy = p.is_greedy();
        if p.dry.is_some() || p.mirostat.is_some() || (!greedy && p.top_k <= 0) {
            return None;
        }
        let k = if greedy { 1 } else { p.top_k as usize }.min(logits.len());
        let repl = adjusted_replacements(logits, &self.history, &self.params, extra_bias);
        let best = match few {
            Some(ids) => allowed_finite(logits, &repl, ids),
            None => best_allowed_in_windows(logits, maxima, &repl, k, allowed)?,
        };
        let first = best.first()?.0;
        if greedy {
            return Some(first);
        }
        self.candidates.clear();
        self.candidates.extend(pad_to_k(best, k).into_iter().map(token_data));
        Some(self.draw_candidates(None, || first))
    }

    /// Run the chain over `self.candidates` and draw with `u` (the RNG's next number when
    /// `None`); `fallback` when nothing survives.
    fn draw_candidates(&mut self, u: Option<f64>, fallback: impl FnOnce() -> i32) -> i32 {
        let mut arr = sys::llama_token_data_array {
            data: self.candidates.as_mut_ptr(),
            size: self.candidates.len(),
            selected: -1,
            sorted: false,
        };
        // SAFETY: arr points into our candidate buffer, alive and exclusively borrowed for the call.
        unsafe { sys::llama_sampler_apply(self.chain.0.as_ptr(), &mut arr) };
        if arr.selected >= 0 && (arr.selected as usize) < arr.size {
            // A selecting sampler (mirostat) picked the token.
            // SAFETY: selected is within [0, size) of the (possibly re-pointed) data array.
            return unsafe { (*arr.data.add(arr.selected as usize)).id };
        }
        if arr.data.is_null() || arr.size == 0 {
            return fallback();
        }
        // SAFETY: after apply, `data[..size]` is the surviving candidate set (our buffer or
        // memory owned by a chain sampler), valid until the next call on this chain.
        let survivors = unsafe { std::slice::from_raw_parts(arr.data, arr.size) };
        let u = u.unwrap_or_else(|| self.rng.next_f64());
        draw(survivors, u).unwrap_or_else(fallback)
    }

    /// Record an accepted token (penalty history, DRY/mirostat state).
    pub fn accept(&mut self, token: i32) {
        // SAFETY: valid chain; token ids are validated by callers.
        unsafe { sys::llama_sampler_accept(self.chain.0.as_ptr(), token) };
        if self.history.len() == MAX_HISTORY {
            self.history.drain(..MAX_HISTORY / 2);
        }
        self.history.push(token);
    }

    /// Deep copy: RNG state, DRY/mirostat state and history included.
    pub fn try_clone(&self) -> Result<Self> {
        // SAFETY: cloning a valid chain; the result is checked for null.
        let ptr = unsafe { sys::llama_sampler_clone(self.chain.0.as_ptr()) };
        let chain =
            NonNull::new(ptr).map(RawChain).ok_or_else(|| LloyalError::invalid("sampler clone failed"))?;
        Ok(Sampler {
            chain,
            params: self.params.clone(),
            history: self.history.clone(),
            rng: self.rng,
            candidates: Vec::new(),
        })
    }
}

/// The survivors of a llama.cpp chain of `steps` over `cands` (the tests of the draws that
/// go without it compare with this).
#[cfg(test)]
fn chain_survivors(steps: &[Step], cands: &mut [sys::llama_token_data]) -> Vec<sys::llama_token_data> {
    let mut chain = RawChain::new().expect("a chain");
    for &step in steps {
        chain.add(init_step(step)).expect("a sampler");
    }
    let mut arr = sys::llama_token_data_array {
        data: cands.as_mut_ptr(),
        size: cands.len(),
        selected: -1,
        sorted: false,
    };
    // SAFETY: arr points into `cands`, alive and exclusively borrowed for the call; after it,
    // `data[..size]` is `cands` or memory the chain owns, copied out before the chain is freed.
    unsafe {
        sys::llama_sampler_apply(chain.0.as_ptr(), &mut arr);
        std::slice::from_raw_parts(arr.data, arr.size).to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::{argmax, draw, greedy_token, plan_steps, top_candidates, Rng, Step};
    use crate::sampling::{Mirostat, SamplingParams};
    use llama_cpp_sys_2 as sys;

    /// A xorshift64 generator from `seed` (nonzero): the sampler tests' reproducible rows.
    pub(super) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut state = seed;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    #[test]
    fn chain_order_and_disabled_steps() {
        let p = SamplingParams { seed: Some(3), ..Default::default() };
        assert_eq!(
            plan_steps(&p, 10),
            vec![Step::TopK(40), Step::TopP(0.95), Step::MinP(0.05), Step::Temp(0.8)]
        );
        assert_eq!(plan_steps(&SamplingParams::greedy(), 10), vec![Step::Greedy]);
        let m = SamplingParams {
            mirostat: Some(Mirostat { version: 2, tau: 5.0, eta: 0.1 }),
            seed: Some(1),
            ..Default::default()
        };
        assert_eq!(plan_steps(&m, 10)[1], Step::MirostatV2 { seed: 1, tau: 5.0, eta: 0.1 });
        let all = SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(0), ..Default::default() };
        assert_eq!(plan_steps(&all, 10), vec![Step::Temp(0.8)]);
    }

    #[test]
    fn rng_is_deterministic_and_restorable() {
        let mut a = Rng::seeded(7);
        let first: Vec<f64> = (0..4).map(|_| a.next_f64()).collect();
        let mut b = Rng::seeded(7);
        assert_eq!(first, (0..4).map(|_| b.next_f64()).collect::<Vec<_>>());
        let mut c = Rng::from_state(b.state());
        assert_eq!(b.next_f64(), c.next_f64());
        assert!(first.iter().all(|u| (0.0..1.0).contains(u)));
        assert_ne!(Rng::seeded(1).next_f64(), Rng::seeded(2).next_f64());
    }

    #[test]
    fn draw_follows_softmax_and_skips_banned() {
        let cand = |id, logit| sys::llama_token_data { id, logit, p: 0.0 };
        let cands = [cand(5, 0.0), cand(9, f32::NEG_INFINITY), cand(3, 2f32.ln())];
        // weights 1 : 0 : 2 of a total 3
        assert_eq!(draw(&cands, 0.0), Some(5));
        assert_eq!(draw(&cands, 0.33), Some(5));
        assert_eq!(draw(&cands, 0.34), Some(3));
        assert_eq!(draw(&cands, 0.999_999), Some(3));
        assert_eq!(draw(&[cand(1, f32::NEG_INFINITY)], 0.5), None);
        let mut rng = Rng::seeded(1);
        let hits = (0..3000).filter(|_| draw(&cands, rng.next_f64()) == Some(3)).count();
        assert!((1850..2150).contains(&hits), "{hits} of 3000 draws picked the 2/3 token");
    }

    #[test]
    fn top_candidates_is_exact_with_replacements() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32).collect();
        let repl = vec![(37usize, -5.0f32), (3, 500.0)];
        let mut adjusted = logits.clone();
        for &(i, v) in &repl {
            adjusted[i] = v;
        }
        let mut want: Vec<(i32, f32)> = adjusted.iter().enumerate().map(|(i, &v)| (i as i32, v)).collect();
        want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        want.truncate(10);
        assert_eq!(top_candidates(&logits, &repl, 10), want);
        assert_eq!(top_candidates(&[1.0, 3.0, 3.0], &[], 1), vec![(1, 3.0)]);
    }

    #[test]
    fn argmax_first_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, 0.0]), 1);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), 0);
        assert_eq!(argmax(&[f32::NAN, -5.0, f32::NAN]), 1);
        // Longer than one 16-lane chunk, the maximum in the remainder and ties across chunks.
        let mut long: Vec<f32> = (0..1000).map(|i| (i % 97) as f32).collect();
        assert_eq!(argmax(&long), 96);
        long[999] = 500.0;
        assert_eq!(argmax(&long), 999);
        long[17] = 500.0;
        assert_eq!(argmax(&long), 17);
        assert_eq!(greedy_token(&long, &[]), 17);
        assert_eq!(greedy_token(&long, &[(17, 0.0), (3, 600.0)]), 3);
        assert_eq!(greedy_token(&long, &[(17, 0.0)]), 999);
    }

    /// The block prefilter gives exactly a full sort's top-k (ties to the lower id), with
    /// replacements, many ties, -inf runs and a NaN, at sizes on both sides of the cut-over.
    #[test]
    fn top_candidates_equals_a_full_sort() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for &(n, k) in &[(100usize, 5usize), (4_000, 1), (20_000, 40), (262_144, 40), (65_536, 200)] {
            let mut logits: Vec<f32> = (0..n).map(|_| (next() % 1000) as f32 / 50.0 - 10.0).collect();
            for x in logits.iter_mut().take(n / 3) {
                *x = f32::NEG_INFINITY;
            }
            logits[n / 2] = f32::NAN;
            let few = vec![(n - 1, 100.0), (7, -50.0), (n / 4, 19.98)];
            // a long list (a ban of a third of the row, unsorted) takes the bisected lookup
            let mut many = few.clone();
            many.extend((1..n / 3).rev().step_by(2).map(|i| (n - 1 - i, f32::NEG_INFINITY)));
            for repl in [few, many] {
                let mut want: Vec<(i32, f32)> = logits
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| !x.is_nan())
                    .map(|(i, &x)| (i as i32, repl.iter().find(|r| r.0 == i).map_or(x, |r| r.1)))
                    .collect();
                want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                want.truncate(k);
                assert_eq!(top_candidates(&logits, &repl, k), want, "n={n} k={k} {} replaced", repl.len());
            }
            let mut all: Vec<(i32, f32)> =
                logits.iter().enumerate().filter(|(_, x)| !x.is_nan()).map(|(i, &x)| (i as i32, x)).collect();
            all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let plain: Vec<(i32, f32)> = all.into_iter().take(k).collect();
            assert_eq!(top_candidates(&logits, &[], k), plain, "n={n} k={k} no replacements");
        }
    }

    /// A full sort's top-k too for a masked row (fewer numbers than k: the bound from the span
    /// maxima is -inf, every value is a candidate) and for a row like a model's, whose best
    /// values sit in a few stretches of the vocabulary and most of the rest far below.
    #[test]
    fn top_candidates_of_a_masked_or_stretched_row_equals_a_full_sort() {
        let sorted_top = |logits: &[f32], k: usize| {
            let mut all: Vec<(i32, f32)> = logits.iter().enumerate().map(|(i, &x)| (i as i32, x)).collect();
            all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            all.truncate(k);
            all
        };
        let n = 262_144;
        let mut masked = vec![f32::NEG_INFINITY; n];
        for (j, t) in [5usize, 70_000, 70_001, 200_000, n - 1].into_iter().enumerate() {
            masked[t] = j as f32;
        }
        let top = top_candidates(&masked, &[], 40);
        assert_eq!(top, sorted_top(&masked, 40));
        assert_eq!(
            top[..5].iter().map(|c| c.0).collect::<Vec<_>>(),
            vec![262_143, 200_000, 70_001, 70_000, 5]
        );
        assert_eq!((top[5], top[39]), ((0, f32::NEG_INFINITY), (35, f32::NEG_INFINITY)));

        let mut bits = xorshift(0x9e37_79b9_7f4a_7c15);
        let mut next = move || (bits() % 10_000) as f32 / 1000.0;
        let stretched: Vec<f32> = (0..n)
            .map(|i| match i {
                0..=99_999 => next() - 30.0,
                150_000..=152_047 | 240_000..=240_511 => next() + 8.0,
                _ => next() - 5.0,
            })
            .collect();
        for k in [1, 40, 200] {
            assert_eq!(top_candidates(&stretched, &[], k), sorted_top(&stretched, k), "k={k}");
        }
    }
}
