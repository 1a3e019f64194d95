//! The draw of a sampler that only scales by a temperature (no top-k, top-p, min-p, typical,
//! XTC, DRY or mirostat: what an OpenAI client asks for by default), straight from the row.
//!
//! The chain's way builds a candidate array of the whole vocabulary (262,144 entries for
//! Gemma 3, 3 MB), has llama.cpp divide each logit by the temperature, and [`super::rng::draw`]
//! walks it twice with a scalar `exp` each entry: ~1 ms a row, ten times the cost of a top-k
//! draw. Here one pass over the row divides each logit by the temperature and sums the weights
//! `exp(y - max)` 64 to a span with a branch-free `exp` the compiler vectorises (the largest
//! `y` is the largest logit's, read from the row's span maxima when the caller has them), and
//! the draw walks the span sums, then one span's 64 weights.
//!
//! Same distribution and the same use of the random number as the chain: `u` in [0, 1) picks
//! the first token (in vocabulary order) whose cumulative weight passes `u` times the total.
//! The sums are ordered differently and the `exp` differs from libm's by an ulp or so, so a
//! draw within ~1e-15 (relative) of a boundary between two tokens may land on the neighbour.

use multiversion::{multiversion, target::selected_target};

use super::replaced::Replaced;

/// Weights summed to one span (the snapshot's span): the span sums are what the draw walks
/// first.
use crate::scan::SPAN;

/// Lanes of the per-span accumulators (independent adds the compiler can vectorise).
const LANES: usize = 8;

/// `exp(x)` for `x <= 0` (NaN-free input; `-inf` and anything below -708 give 0, where
/// libm's result is under 1e-307 and adds nothing to a total of at least 1). Cody-Waite
/// reduction to `|r| <= ln 2 / 2` and a degree-13 Taylor polynomial (truncation below 1e-17
/// relative), scaled by `2^k` through the exponent bits; no branches, so loops over it
/// vectorise. `FUSED`: the polynomial's steps are fused multiply-adds (one instruction and one
/// rounding each), for a CPU with FMA; without it `mul_add` would be a libm call a step.
#[inline(always)]
pub(super) fn exp_nonpositive<const FUSED: bool>(x: f64) -> f64 {
    let step = |p: f64, r: f64, c: f64| if FUSED { p.mul_add(r, c) } else { p * r + c };
    // ln 2 split as fdlibm's exp splits it: the high part times any k here is exact
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    // 1.5 * 2^52: adding it rounds to an integer held in the low mantissa bits
    const SHIFT: f64 = 6_755_399_441_055_744.0;
    let x = x.max(-708.0); // -inf and NaN-free input: the floor, sent to 0 below
    let kd = x * std::f64::consts::LOG2_E + SHIFT;
    let k = kd - SHIFT;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p: f64 = 1.0 / 6_227_020_800.0;
    let p = step(p, r, 1.0 / 479_001_600.0);
    let p = step(p, r, 1.0 / 39_916_800.0);
    let p = step(p, r, 1.0 / 3_628_800.0);
    let p = step(p, r, 1.0 / 362_880.0);
    let p = step(p, r, 1.0 / 40_320.0);
    let p = step(p, r, 1.0 / 5_040.0);
    let p = step(p, r, 1.0 / 720.0);
    let p = step(p, r, 1.0 / 120.0);
    let p = step(p, r, 1.0 / 24.0);
    let p = step(p, r, 1.0 / 6.0);
    let p = step(p, r, 0.5);
    let p = step(p, r, 1.0);
    let p = step(p, r, 1.0);
    // k + 1023 is in [1, 1023] here: the low bits of kd's mantissa, moved to the exponent
    let scale = f64::from_bits(kd.to_bits().wrapping_add(1023) << 52);
    let keep: u64 = if x > -708.0 { u64::MAX } else { 0 };
    f64::from_bits((p * scale).to_bits() & keep)
}

/// The weight `exp(x / t - max)` of logit `x` (`max` its row's largest `x / t`).
#[inline(always)]
fn weight<const FUSED: bool>(x: f32, t: f32, max: f32) -> f64 {
    exp_nonpositive::<FUSED>(f64::from(x / t - max))
}

/// The sum of the weights of each [`SPAN`] logits of `row`, in [`LANES`] accumulators.
#[inline(always)]
fn span_sums_with<const FUSED: bool>(row: &Replaced, t: f32, max: f32) -> Vec<f64> {
    row.spans()
        .map(|span| {
            let mut acc = [0.0f64; LANES];
            let (groups, rest) = span.as_chunks::<LANES>();
            for group in groups {
                for (a, &x) in acc.iter_mut().zip(group) {
                    *a += weight::<FUSED>(x, t, max);
                }
            }
            let rest: f64 = rest.iter().map(|&x| weight::<FUSED>(x, t, max)).sum();
            acc.iter().sum::<f64>() + rest
        })
        .collect()
}

/// A logit's weight: `(x, t, max)` to `exp(x / t - max)`.
type Weight = fn(f32, f32, f32) -> f64;

/// A row's span sums at `(t, max)` and the weight function they were made with.
type SpanSums = fn(&Replaced, f32, f32) -> (Vec<f64>, Weight);

/// [`span_sums_with`], fused where the CPU has FMA, and the weight function that goes with it.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512dq+avx512vl", "x86_64+avx2+fma"))]
fn span_sums(row: &Replaced, t: f32, max: f32) -> (Vec<f64>, Weight) {
    if selected_target!().supports_feature_str("fma") {
        (span_sums_with::<true>(row, t, max), weight::<true>)
    } else {
        (span_sums_with::<false>(row, t, max), weight::<false>)
    }
}

/// Draw from softmax(`logits` / `temperature`) with `u` in [0, 1): the logits with
/// `repl` (token, value) put in first, each divided by the temperature in f32 as llama.cpp's
/// temperature sampler does (on the fly: one pass over the row for the span sums); `maxima`
/// the row's span maxima when known. `None` when no value is finite.
pub(super) fn temperature_draw(
    logits: &[f32],
    maxima: &[f32],
    repl: &[(usize, f32)],
    temperature: f32,
    u: f64,
) -> Option<i32> {
    draw_with(logits, maxima, repl, temperature, u, span_sums)
}

/// [`temperature_draw`] with the span sums (and the weight function that goes with them) from
/// `sums_of` (the tests give the unfused ones of a CPU without FMA).
fn draw_with(
    logits: &[f32],
    maxima: &[f32],
    repl: &[(usize, f32)],
    temperature: f32,
    u: f64,
    sums_of: SpanSums,
) -> Option<i32> {
    let row = Replaced::new(logits, repl);
    // Dividing by t > 0 keeps the order (rounding is monotonic): the largest x / t is the
    // largest x divided by t.
    let max_x = row.maxima(maxima).iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let t = temperature;
    let max = max_x / t;
    if !max.is_finite() {
        return None;
    }
    let (sums, weight_of) = sums_of(&row, t, max);
    let weight = |x: f32| weight_of(x, t, max);
    let total: f64 = sums.iter().sum();
    let mut target = u * total;
    let mut last = None;
    for (s, &sum) in sums.iter().enumerate() {
        if sum <= 0.0 {
            continue;
        }
        if target >= sum {
            target -= sum;
            last = Some(s);
            continue;
        }
        // The draw falls in this span: walk its weights (the chain's walk, one span long).
        for (j, &x) in row.span(s).iter().enumerate() {
            let w = weight(x);
            if w > 0.0 {
                if target < w {
                    return Some((s * SPAN + j) as i32);
                }
                target -= w;
            }
        }
        last = Some(s); // rounding left `target` past the span's weights: the next span
    }
    // Rounding carried the target past every weight: the last token with a weight, as the
    // chain's walk gives.
    let s = last?;
    row.span(s).iter().rposition(|&x| weight(x) > 0.0).map(|j| (s * SPAN + j) as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::rng::{draw, Rng};
    use llama_cpp_sys_2 as sys;

    /// `cargo test --release -- --ignored --nocapture temperature_draw_speed`
    #[test]
    #[ignore]
    fn temperature_draw_speed() {
        let mut rng = Rng::seeded(5);
        let logits: Vec<f32> = (0..262_144).map(|_| (rng.next_f64() * 20.0 - 10.0) as f32).collect();
        let t = std::time::Instant::now();
        for _ in 0..200 {
            std::hint::black_box(temperature_draw(&logits, &[], &[], 0.8, rng.next_f64()));
        }
        println!("temperature_draw: {:.3} ms a row", t.elapsed().as_secs_f64() * 1e3 / 200.0);
    }

    #[test]
    fn the_exponential_matches_libm_to_an_ulp_or_two() {
        let mut rng = Rng::seeded(3);
        let mut worst = 0.0f64;
        for i in 0..200_000 {
            let x = if i < 1000 { -(i as f64) * 0.708 } else { -rng.next_f64() * 708.0 };
            let (a, b) = (exp_nonpositive::<false>(x), x.exp());
            let fused = exp_nonpositive::<true>(x);
            worst = worst.max(((fused - b) / b).abs());
            worst = worst.max(((a - b) / b).abs());
        }
        assert!(worst < 5e-16, "relative error {worst:e}");
        for f in [exp_nonpositive::<false>, exp_nonpositive::<true>] {
            assert_eq!(f(0.0), 1.0);
            assert_eq!(f(f64::NEG_INFINITY), 0.0);
            assert_eq!(f(-800.0), 0.0);
        }
    }

    /// The chain's draw: the candidates divided by the temperature, then `rng::draw`.
    fn chain_draw(logits: &[f32], repl: &[(usize, f32)], t: f32, u: f64) -> Option<i32> {
        let mut cands: Vec<sys::llama_token_data> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| sys::llama_token_data { id: i as i32, logit: l, p: 0.0 })
            .collect();
        for &(i, v) in repl {
            cands[i].logit = v;
        }
        for c in &mut cands {
            c.logit /= t;
        }
        draw(&cands, u)
    }

    #[test]
    fn draws_the_chains_token_for_the_same_random_number() {
        let mut rng = Rng::seeded(11);
        for (n, t) in [(262_144usize, 0.8f32), (1000, 1.0), (130, 1.7), (64, 0.3), (7, 1.0)] {
            // logits like a model's: a few large, a long tail, some banned
            let logits: Vec<f32> = (0..n)
                .map(|i| {
                    let x = (rng.next_f64() * 2.0 - 1.0) as f32 * 6.0;
                    if i % 997 == 5 {
                        x + 14.0
                    } else if i % 613 == 1 {
                        f32::NEG_INFINITY
                    } else {
                        x
                    }
                })
                .collect();
            let repl = [(n / 2, f32::NEG_INFINITY), (n - 1, 9.0), (0, -3.0)];
            let maxima: Vec<f32> = logits.chunks(SPAN).map(crate::metrics::max_f32_lanes::<16>).collect();
            for _ in 0..300 {
                let u = rng.next_f64();
                let want = chain_draw(&logits, &repl, t, u);
                assert_eq!(temperature_draw(&logits, &[], &repl, t, u), want, "n={n} t={t} u={u}");
                // the span maxima of the row before its replacements, as a snapshot has them
                assert_eq!(temperature_draw(&logits, &maxima, &repl, t, u), want);
                // a CPU without FMA: the polynomial's steps rounded twice
                let unfused = |v: &Replaced, t: f32, m: f32| {
                    (span_sums_with::<false>(v, t, m), weight::<false> as Weight)
                };
                assert_eq!(draw_with(&logits, &maxima, &repl, t, u, unfused), want);
                let plain = temperature_draw(&logits, &maxima, &[], t, u);
                assert_eq!(plain, chain_draw(&logits, &[], t, u), "n={n} t={t} u={u}");
            }
            // the ends of [0, 1): the first and the last token with a weight
            for u in [0.0, 1.0 - f64::EPSILON] {
                assert_eq!(temperature_draw(&logits, &[], &repl, t, u), chain_draw(&logits, &repl, t, u));
            }
        }
        let banned = vec![f32::NEG_INFINITY; 100];
        assert_eq!(temperature_draw(&banned, &[], &[], 1.0, 0.5), None);
    }
}
