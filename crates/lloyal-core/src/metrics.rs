//! Entropy, surprisal and perplexity from logits, numerically stable (log-sum-exp).

use multiversion::multiversion;

use crate::error::{LloyalError, Result};
pub use crate::scan::RowStats;
use crate::scan::{row_stats, scan_row};

/// Logarithm base for information measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base {
    Nats,
    Bits,
}

impl Base {
    /// Parse "nats" / "bits".
    pub fn parse(s: &str) -> Result<Base> {
        match s {
            "nats" => Ok(Base::Nats),
            "bits" => Ok(Base::Bits),
            other => Err(LloyalError::invalid(format!("base must be \"nats\" or \"bits\", got {other:?}"))),
        }
    }

    /// Convert a value in nats to this base.
    pub fn scale(self, nats: f64) -> f64 {
        match self {
            Base::Nats => nats,
            Base::Bits => nats / std::f64::consts::LN_2,
        }
    }
}

// A decoded row's maximum and log-sum-exps come from `crate::scan` (one pass, explicit SIMD).
// The kernels below serve the rarer questions (argmax of a plain slice, entropy): compiled for
// AVX-512, for AVX2 + FMA and for the build's baseline (`#[multiversion]`), the best version the
// CPU runs picked at the first call.

/// Accumulator width: 32 f32 lanes = four independent AVX2 vectors, so the adds of one
/// iteration do not wait on the previous one (8 lanes ran ~4x slower, latency-bound).
const LANES: usize = 32;
const BLOCK: usize = 4096;

/// `exp(y)` for `y` in [-87.3, 88] (the callers clamp), branch-free so loops vectorise:
/// round-to-nearest range reduction `y = n ln2 + r`, |r| <= ln2/2, then a degree-6
/// polynomial for `e^r` (relative error < 2e-7) scaled by `2^n`. `n` is read from the
/// mantissa of the rounding sum (no float to int conversion).
#[inline(always)]
pub(crate) fn exp_in_range(y: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let t = y * std::f32::consts::LOG2_E;
    let rounded = t + MAGIC;
    let n = rounded - MAGIC;
    let r = (t - n) * std::f32::consts::LN_2;
    let p = 1.0
        + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // `rounded`'s low mantissa bits hold n (two's complement around MAGIC's bit pattern).
    let n_int = rounded.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    p * f32::from_bits((n_int.wrapping_add(127) as u32) << 23)
}

/// `exp(x)` for f32 ([`exp_in_range`]); inputs below -87 give exactly 0 (so `-inf` logits
/// vanish). max/min rather than clamp: a NaN logit becomes -87 (contributes ~0) instead of
/// poisoning the whole sum.
#[inline(always)]
#[allow(clippy::manual_clamp)]
fn exp_f32(x: f32) -> f32 {
    let e = exp_in_range(x.max(-87.0).min(88.0));
    if x < -87.0 {
        0.0
    } else {
        e
    }
}

/// Largest value, NaN ignored (`-inf` for an empty slice or when none), vectorised.
pub(crate) fn max_f32(xs: &[f32]) -> f32 {
    max_f32_lanes::<LANES>(xs)
}

/// [`max_f32`] with `L` accumulator lanes: wide for long slices, 16 for short blocks, where
/// folding the lanes at the end would cost as much as the scan.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512dq+avx512vl", "x86_64+avx2+fma"))]
pub(crate) fn max_f32_lanes<const L: usize>(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; L];
    let mut chunks = xs.chunks_exact(L);
    for c in &mut chunks {
        for k in 0..L {
            acc[k] = acc[k].max(c[k]);
        }
    }
    let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
    acc.iter().copied().fold(tail, f32::max)
}

/// `(sum exp(x - m), sum exp(x - m) * x)` over `xs` (for entropy).
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512dq+avx512vl", "x86_64+avx2+fma"))]
fn exp_sums_weighted(xs: &[f32], m: f32) -> (f64, f64) {
    let (mut total, mut weighted) = (0f64, 0f64);
    for block in xs.chunks(BLOCK) {
        let mut acc = [0f32; LANES];
        let mut wacc = [0f32; LANES];
        let mut chunks = block.chunks_exact(LANES);
        for c in &mut chunks {
            for k in 0..LANES {
                let e = exp_f32(c[k] - m);
                acc[k] += e;
                wacc[k] += e * c[k].max(-1e30);
            }
        }
        for &x in chunks.remainder() {
            let e = exp_f32(x - m);
            acc[0] += e;
            wacc[0] += e * x.max(-1e30);
        }
        total += acc.iter().map(|&v| f64::from(v)).sum::<f64>();
        weighted += wacc.iter().map(|&v| f64::from(v)).sum::<f64>();
    }
    (total, weighted)
}

/// log(sum(exp(logits))) computed stably; `-inf` when every logit is `-inf`. The same kernel
/// and bits as a snapshot's [`RowStats::lse`] ([`crate::scan`]).
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    row_stats(logits).lse
}

/// `log(sum(exp(s * x')))` where `x'` is `logits` with `replace` entries `(index, value)`
/// substituted (penalties, biases), from `lse`, the log-sum-exp of `s * logits` without them:
/// O(replacements), no pass over the row. `s` must be positive.
pub fn replaced_lse(lse: f64, logits: &[f32], s: f32, replace: &[(usize, f32)]) -> f64 {
    if replace.is_empty() || lse == f64::INFINITY {
        return lse;
    }
    let s = f64::from(s);
    // A reference at least every replaced value: the sum stays <= n and never overflows.
    let m = replace.iter().fold(lse, |m, &(_, v)| m.max(f64::from(v) * s));
    if !m.is_finite() {
        return m;
    }
    let mut sum = (lse - m).exp();
    for &(i, v) in replace {
        if let Some(&old) = logits.get(i) {
            sum += (f64::from(v) * s - m).exp() - (f64::from(old) * s - m).exp();
        }
    }
    m + sum.max(f64::MIN_POSITIVE).ln()
}

/// log(sum(exp(s * x'))) where `x'` is `logits` with `replace` entries `(index, value)`
/// substituted (penalties, biases), without copying the logits. `s` must be positive.
pub fn log_sum_exp_scaled(logits: &[f32], s: f32, replace: &[(usize, f32)]) -> f64 {
    log_sum_exp_both(logits, s, replace).1
}

/// `(log_sum_exp(logits), log_sum_exp_scaled(logits, s, replace))` from one pass (the per-token
/// normalisers of model and sampling perplexity when no snapshot summary has them).
pub fn log_sum_exp_both(logits: &[f32], s: f32, replace: &[(usize, f32)]) -> (f64, f64) {
    let stats = scan_row(logits, None, &mut Vec::new(), Some(s));
    let scaled = if s == 1.0 { stats.lse } else { stats.scaled_lse(s).unwrap_or(f64::NAN) };
    (stats.lse, replaced_lse(scaled, logits, s, replace))
}

/// Shannon entropy of softmax(logits).
pub fn entropy(logits: &[f32], base: Base) -> f64 {
    let max = max_f32(logits);
    if !max.is_finite() {
        return 0.0;
    }
    let (sum, weighted) = exp_sums_weighted(logits, max);
    // H = log Z - E[l] with log Z = max + ln(sum) and E[l] = weighted / sum.
    let h = f64::from(max) + sum.ln() - weighted / sum;
    base.scale(h.max(0.0))
}

/// Surprisal `-log p(token)` under softmax(logits); `inf` for a banned token.
pub fn surprisal(logits: &[f32], token: usize, base: Base) -> f64 {
    let Some(&l) = logits.get(token) else { return f64::INFINITY };
    if l == f32::NEG_INFINITY {
        return f64::INFINITY;
    }
    let lse = log_sum_exp(logits);
    base.scale((lse - f64::from(l)).max(0.0))
}

/// Running perplexity: exp(mean surprisal in nats); `inf` before any observation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PerplexityTracker {
    sum_nats: f64,
    count: u64,
}

impl PerplexityTracker {
    /// A fresh tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record one token's surprisal in nats.
    pub fn add(&mut self, surprisal_nats: f64) {
        self.sum_nats += surprisal_nats;
        self.count += 1;
    }

    /// exp(mean surprisal); `inf` when empty.
    pub fn perplexity(&self) -> f64 {
        if self.count == 0 {
            f64::INFINITY
        } else {
            (self.sum_nats / self.count as f64).exp()
        }
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of surprisals in nats.
    pub fn sum_nats(&self) -> f64 {
        self.sum_nats
    }

    /// Rebuild from saved parts.
    pub fn from_parts(sum_nats: f64, count: u64) -> Self {
        PerplexityTracker { sum_nats, count }
    }

    /// Forget everything.
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_entropy_is_log_n() {
        let logits = vec![3.0f32; 8];
        assert!((entropy(&logits, Base::Bits) - 3.0).abs() < 1e-9);
        assert!((entropy(&logits, Base::Nats) - 8f64.ln()).abs() < 1e-9);
    }

    #[test]
    fn stable_with_huge_logits() {
        let logits = [1000.0f32, 1000.0, f32::NEG_INFINITY];
        assert!((entropy(&logits, Base::Bits) - 1.0).abs() < 1e-9);
        assert!((surprisal(&logits, 0, Base::Bits) - 1.0).abs() < 1e-9);
        assert_eq!(surprisal(&logits, 2, Base::Nats), f64::INFINITY);
    }

    #[test]
    fn fast_exp_is_accurate() {
        for i in -870..880 {
            let x = i as f32 / 10.0;
            let (got, want) = (f64::from(exp_f32(x)), f64::from(x).exp());
            // f32 range reduction costs ~|x| * 6e-8 relative; 1e-5 covers the whole range.
            assert!(((got - want) / want).abs() < 1e-5, "exp({x}) = {got}, want {want}");
        }
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn entropy_and_lse_match_reference() {
        let logits: Vec<f32> = (0..10_007).map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 10.0).collect();
        let m = logits.iter().copied().fold(f32::MIN, f32::max) as f64;
        let z: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
        let lse = m + z.ln();
        let h: f64 = -logits
            .iter()
            .map(|&l| {
                let lp = l as f64 - lse;
                lp.exp() * lp
            })
            .sum::<f64>();
        assert!((log_sum_exp(&logits) - lse).abs() < 1e-5);
        assert!((entropy(&logits, Base::Nats) - h).abs() < 1e-5);
        let mut replaced = logits.clone();
        replaced[3] = 50.0;
        replaced[9] = f32::NEG_INFINITY;
        let want = log_sum_exp_scaled(&replaced, 0.5, &[]);
        let got = log_sum_exp_scaled(&logits, 0.5, &[(3, 50.0), (9, f32::NEG_INFINITY)]);
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        let (plain, scaled) = log_sum_exp_both(&logits, 0.5, &[(3, 50.0), (9, f32::NEG_INFINITY)]);
        assert!((plain - lse).abs() < 1e-5, "{plain} vs {lse}");
        assert!((scaled - want).abs() < 1e-5, "{scaled} vs {want}");
    }

    #[test]
    fn unscaled_normalisers_share_one_pass() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 7.0 - 5.0).collect();
        // A bias above the maximum (the sampling maximum moves), a ban and an ordinary penalty.
        let repl = [(3, 40.0), (9, f32::NEG_INFINITY), (500, -2.0)];
        let mut replaced = logits.clone();
        for &(i, v) in &repl {
            replaced[i] = v;
        }
        let (plain, sampling) = log_sum_exp_both(&logits, 1.0, &repl);
        assert!((plain - log_sum_exp(&logits)).abs() < 1e-6, "{plain}");
        assert!((sampling - log_sum_exp(&replaced)).abs() < 1e-6, "{sampling}");
        let (plain, sampling) = log_sum_exp_both(&logits, 1.0, &[(7, -1.0)]);
        replaced = logits.clone();
        replaced[7] = -1.0;
        assert!((plain - log_sum_exp(&logits)).abs() < 1e-6);
        assert!((sampling - log_sum_exp(&replaced)).abs() < 1e-6);
    }

    #[test]
    fn both_normalisers_handle_all_banned_and_odd_lengths() {
        let banned = [f32::NEG_INFINITY; 5];
        assert_eq!(log_sum_exp_both(&banned, 2.0, &[]).0, f64::NEG_INFINITY);
        let odd: Vec<f32> = (0..37).map(|i| i as f32 / 4.0).collect();
        let (plain, scaled) = log_sum_exp_both(&odd, 2.0, &[]);
        assert!((plain - log_sum_exp(&odd)).abs() < 1e-6);
        assert!((scaled - log_sum_exp_scaled(&odd, 2.0, &[])).abs() < 1e-6);
    }

    #[test]
    fn perplexity_of_constant_surprisal() {
        let mut t = PerplexityTracker::new();
        assert_eq!(t.perplexity(), f64::INFINITY);
        t.add(2f64.ln());
        t.add(2f64.ln());
        assert!((t.perplexity() - 2.0).abs() < 1e-12);
        assert_eq!(t.count(), 2);
    }

    #[test]
    fn base_parse() {
        assert_eq!(Base::parse("bits").unwrap(), Base::Bits);
        assert!(Base::parse("dits").is_err());
    }
}
