//! The draw of a sampler that only scales by a temperature (no top-k, top-p, min-p, typical,
//! XTC, DRY or mirostat: what an OpenAI client asks for by default), straight from the row.
//!
//! The chain's way builds a candidate array of the whole vocabulary (262,144 entries for
//! Gemma 3, 3 MB), has llama.cpp divide each logit by the temperature, and [`super::rng::draw`]
//! walks it twice with a scalar `exp` each entry: ~1 ms a row, ten times the cost of a top-k
//! draw. Here the scaled row goes to a reused buffer, the weights `exp(y - max)` are summed 64
//! to a span with a branch-free `exp` the compiler vectorises, and the draw walks the span
//! sums, then one span's 64 weights.
//!
//! Same distribution and the same use of the random number as the chain: `u` in [0, 1) picks
//! the first token (in vocabulary order) whose cumulative weight passes `u` times the total.
//! The sums are ordered differently and the `exp` differs from libm's by an ulp or so, so a
//! draw within ~1e-15 (relative) of a boundary between two tokens may land on the neighbour.

/// Weights summed to one span: the span sums are what the draw walks first.
const SPAN: usize = 64;

/// Lanes of the per-span accumulators (independent adds the compiler can vectorise).
const LANES: usize = 8;

/// `exp(x)` for `x <= 0` (NaN-free input; `-inf` and anything below -708 give 0, where
/// libm's result is under 1e-307 and adds nothing to a total of at least 1). Cody-Waite
/// reduction to `|r| <= ln 2 / 2` and a degree-13 Taylor polynomial (truncation below 1e-17
/// relative), scaled by `2^k` through the exponent bits; no branches, so loops over it
/// vectorise.
#[inline(always)]
pub(super) fn exp_nonpositive(x: f64) -> f64 {
    // ln 2 split as fdlibm's exp splits it: the high part times any k here is exact
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    // 1.5 * 2^52: adding it rounds to an integer held in the low mantissa bits
    const SHIFT: f64 = 6_755_399_441_055_744.0;
    let x = x.max(-708.0); // -inf and NaN-free input: the floor, sent to 0 below
    let kd = x * std::f64::consts::LOG2_E + SHIFT;
    let k = kd - SHIFT;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = 1.0 / 6_227_020_800.0;
    let p = p * r + 1.0 / 479_001_600.0;
    let p = p * r + 1.0 / 39_916_800.0;
    let p = p * r + 1.0 / 3_628_800.0;
    let p = p * r + 1.0 / 362_880.0;
    let p = p * r + 1.0 / 40_320.0;
    let p = p * r + 1.0 / 5_040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // k + 1023 is in [1, 1023] here: the low bits of kd's mantissa, moved to the exponent
    let scale = f64::from_bits(kd.to_bits().wrapping_add(1023) << 52);
    let keep: u64 = if x > -708.0 { u64::MAX } else { 0 };
    f64::from_bits((p * scale).to_bits() & keep)
}

/// The weights `exp(y - max)` of 8 scaled logits (`max` their row's maximum).
#[inline(always)]
fn weights8(y: &[f32; LANES], max: f32) -> [f64; LANES] {
    let mut w = [0.0f64; LANES];
    for (w, &y) in w.iter_mut().zip(y) {
        *w = exp_nonpositive(f64::from(y - max));
    }
    w
}

/// The maximum of `values` (NaN-free), in 16 lanes: one running maximum would be a chain of
/// 262,144 dependent steps.
fn lane_max(values: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let (groups, rest) = values.as_chunks::<16>();
    for g in groups {
        for (a, &v) in acc.iter_mut().zip(g) {
            *a = if v > *a { v } else { *a };
        }
    }
    let rest = rest.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    acc.iter().copied().fold(rest, f32::max)
}

/// Draw from softmax(`logits` / `temperature`) with `u` in [0, 1): the logits with
/// `repl` (token, value) put in first, each divided by the temperature in f32 as llama.cpp's
/// temperature sampler does; `scaled` is a reused buffer. `None` when no value is finite.
pub(super) fn temperature_draw(
    logits: &[f32],
    repl: &[(usize, f32)],
    temperature: f32,
    u: f64,
    scaled: &mut Vec<f32>,
) -> Option<i32> {
    scaled.clear();
    scaled.extend(logits.iter().map(|&x| x / temperature));
    for &(i, v) in repl {
        if let Some(y) = scaled.get_mut(i) {
            *y = v / temperature;
        }
    }
    let max = lane_max(scaled);
    if !max.is_finite() {
        return None;
    }
    let weight = |y: f32| exp_nonpositive(f64::from(y - max));
    let sums: Vec<f64> = scaled
        .chunks(SPAN)
        .map(|span| {
            let mut acc = [0.0f64; LANES];
            let (groups, rest) = span.as_chunks::<LANES>();
            for group in groups {
                let w = weights8(group, max);
                for (a, w) in acc.iter_mut().zip(w) {
                    *a += w;
                }
            }
            let rest: f64 = rest.iter().map(|&y| weight(y)).sum();
            acc.iter().sum::<f64>() + rest
        })
        .collect();
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
        for (j, &y) in scaled[s * SPAN..].iter().take(SPAN).enumerate() {
            let w = weight(y);
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
    let span = &scaled[s * SPAN..(s * SPAN + SPAN).min(scaled.len())];
    span.iter().rposition(|&y| weight(y) > 0.0).map(|j| (s * SPAN + j) as i32)
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
        let mut scaled = Vec::new();
        let t = std::time::Instant::now();
        for _ in 0..200 {
            std::hint::black_box(temperature_draw(&logits, &[], 0.8, rng.next_f64(), &mut scaled));
        }
        println!("temperature_draw: {:.3} ms a row", t.elapsed().as_secs_f64() * 1e3 / 200.0);
    }

    #[test]
    fn the_exponential_matches_libm_to_an_ulp_or_two() {
        let mut rng = Rng::seeded(3);
        let mut worst = 0.0f64;
        for i in 0..200_000 {
            let x = if i < 1000 { -(i as f64) * 0.708 } else { -rng.next_f64() * 708.0 };
            let (a, b) = (exp_nonpositive(x), x.exp());
            worst = worst.max(((a - b) / b).abs());
        }
        assert!(worst < 5e-16, "relative error {worst:e}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(f64::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-800.0), 0.0);
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
        let mut scaled = Vec::new();
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
            for _ in 0..300 {
                let u = rng.next_f64();
                let want = chain_draw(&logits, &repl, t, u);
                assert_eq!(temperature_draw(&logits, &repl, t, u, &mut scaled), want, "n={n} t={t} u={u}");
            }
            // the ends of [0, 1): the first and the last token with a weight
            for u in [0.0, 1.0 - f64::EPSILON] {
                assert_eq!(
                    temperature_draw(&logits, &repl, t, u, &mut scaled),
                    chain_draw(&logits, &repl, t, u)
                );
            }
        }
        let banned = vec![f32::NEG_INFINITY; 100];
        assert_eq!(temperature_draw(&banned, &[], 1.0, 0.5, &mut scaled), None);
    }
}
