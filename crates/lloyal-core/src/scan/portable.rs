//! The block kernels for CPUs without AVX2+FMA (and other architectures): plain Rust over
//! 16-lane arrays, which the compiler vectorises for the build's baseline.

use super::{Kernels, SPAN};
use crate::metrics::{exp_in_range, max_f32_lanes};

pub(super) const KERNELS: Kernels = Kernels { maxima, exp_sums };

const LANES: usize = 16;

fn maxima(src: &[f32], dst: Option<&mut [f32]>, maxima: &mut [f32]) -> f32 {
    if let Some(dst) = dst {
        dst.copy_from_slice(src);
    }
    let mut best = f32::NEG_INFINITY;
    for (span, m) in src.chunks(SPAN).zip(maxima.iter_mut()) {
        // `max` ignores a NaN operand: a NaN logit never wins.
        *m = max_f32_lanes::<LANES>(span);
        best = best.max(*m);
    }
    best
}

fn exp_sums(src: &[f32], m: f32, scale: Option<f32>, _next: &[f32]) -> (f64, f64) {
    let mut plain = [0f32; LANES];
    let mut scaled = [0f32; LANES];
    let s = scale.unwrap_or(1.0);
    let sm = s * m;
    let mut lanes = src.chunks_exact(LANES);
    for c in &mut lanes {
        for k in 0..LANES {
            plain[k] += exp_nonpositive(c[k] - m);
        }
        if scale.is_some() {
            for k in 0..LANES {
                scaled[k] += exp_nonpositive(c[k] * s - sm);
            }
        }
    }
    let mut a: f64 = plain.iter().map(|&v| f64::from(v)).sum();
    let mut b: f64 = if scale.is_some() { scaled.iter().map(|&v| f64::from(v)).sum() } else { 0.0 };
    for &x in lanes.remainder() {
        a += f64::from(exp_nonpositive(x - m));
        if scale.is_some() {
            b += f64::from(exp_nonpositive(x * s - sm));
        }
    }
    (a, b)
}

/// `exp(y)` for `y <= 0` (a value minus the row's maximum), branch-free so loops vectorise
/// ([`exp_in_range`]). `y` below -87.3 (and NaN) count as -87.3: ~1e-38, nothing next to
/// the maximum's 1.
#[inline(always)]
#[allow(clippy::manual_clamp)]
pub(super) fn exp_nonpositive(y: f32) -> f32 {
    exp_in_range(y.max(-87.3).min(0.0))
}
