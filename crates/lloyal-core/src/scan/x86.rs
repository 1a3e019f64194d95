//! The block kernels in AVX-512F+DQ (16 lanes) and AVX2+FMA (8 lanes), picked at run time: the
//! compiler's own vectorisation of the portable kernels stays at 8 lanes without FMA (LLVM
//! prefers 256-bit vectors on Intel, and Rust never fuses a multiply and an add), 3x slower.
//!
//! `exp(y)` for `y = x - m <= 0` as `2^u`, `u = y log2(e)`: `u = n + f` with `n` whole, a
//! degree-5 minimax polynomial for `2^f` (relative error < 2e-7; exactly 1 at 0), times `2^n`.
//! - AVX-512 splits `u` at `n = floor(u)` with one instruction (`vreduceps`, AVX512DQ) and
//!   scales by `n` with another (`vscalefps`): 9 instructions a vector of exponentials (and a
//!   subtraction and a clamp shared by a value's two), against 14 for the Cody-Waite reduction
//!   in base e used before (`vrndscaleps`, a two-part `ln 2`, degree 6), which took about 1.5x as
//!   long over a row. `y` below -87.3 and NaN count as -87.3.
//! - AVX2 has neither: `u`, held at -126 and above (NaN too, so `y` needs no clamp of its own),
//!   plus `1.5 * 2^23 + 127` rounds it to the nearest whole `n` and leaves `n + 127` in the
//!   sum's low bits, which shifted into the exponent field are `2^n`; `f = u - n` is in
//!   `[-0.5, 0.5]`. 11 instructions, with no `vroundps` (2 micro-ops on Intel) or conversion
//!   back to integers, against 12 before plus the clamp of `y`: a row with both sums took 15%
//!   less time (the plain sum 8% less) with `-C target-cpu=haswell` on a Zen 4.

use std::arch::x86_64::*;

use super::{Kernels, SPAN};

/// Whether this CPU runs the AVX-512 kernels (AVX-512F and DQ).
fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq")
}

/// Whether this CPU runs the AVX2 kernels (AVX2 and FMA).
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// The kernels of the best instruction set this CPU has (None: neither); AVX2 at most when
/// `avx2_at_most`.
pub(super) fn kernels(avx2_at_most: bool) -> Option<Kernels> {
    if !avx2_at_most && has_avx512() {
        return Some(avx512::KERNELS);
    }
    has_avx2().then_some(avx2::KERNELS)
}

/// Every kernel set this CPU runs, best first (the tests compare them).
#[cfg(test)]
pub(super) fn every() -> Vec<(&'static str, Kernels)> {
    let mut out = Vec::new();
    if has_avx512() {
        out.push(("avx512", avx512::KERNELS));
    }
    if has_avx2() {
        out.push(("avx2", avx2::KERNELS));
    }
    out
}

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// The lowest `y` summed by AVX-512: `e^-87.3` is about the smallest normal float.
const FLOOR: f32 = -87.3;
/// `2^f` on `[0, 1)` (AVX-512), highest degree first: a minimax fit of the relative error with
/// the constant held at 1 (so `2^0` is exact: a row of one finite value has that value as its lse).
const POLY: [f32; 6] = [1.867_126_3e-3, 9.017_038e-3, 5.579_991e-2, 2.401_644_6e-1, 6.931_513e-1, 1.0];
/// `2^f` on `[-0.5, 0.5]` (AVX2), fitted the same way (relative error < 2e-7 in f32). Its linear
/// term is near `ln 2` but not it: with `ln 2` the error is 3.1e-7.
#[allow(clippy::approx_constant)]
const POLY_HALF: [f32; 6] = [1.326_469_8e-3, 9.671_51e-3, 5.550_734e-2, 2.402_224_2e-1, 6.931_47e-1, 1.0];
/// The lowest `u` AVX2 sums (`2^-126`, the smallest normal float): `2^n` is built in the exponent bits.
const MIN_EXPONENT: f32 = -126.0;
/// `1.5 * 2^23 + 127`: adding it to `u` (`|u| < 2^22`) rounds it to the nearest whole `n` and
/// leaves `n + 127` in the low bits of the sum.
const ROUND_BIAS: f32 = 12_583_039.0;

/// The rest of a span or block that does not fill a vector: plain Rust.
pub(super) fn tail_max(values: &[f32]) -> f32 {
    values.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Ask for the two cache lines of `next[at..at + 32]` (what the exponentials of the same
/// offset in this block read): the next block arrives while this one computes.
#[inline]
pub(super) fn prefetch(next: &[f32], at: usize) {
    if let Some(line) = next.get(at..(at + 32).min(next.len())) {
        for j in (0..line.len()).step_by(16) {
            // SAFETY: a prefetch only hints the cache; the address is inside `next` anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line[j..].as_ptr().cast::<i8>()) };
        }
    }
}

pub(super) fn tail_exp_sums(values: &[f32], m: f32, scale: Option<f32>) -> (f64, f64) {
    let e = super::portable::exp_nonpositive;
    let plain = values.iter().map(|&x| f64::from(e(x - m))).sum();
    let scaled = scale.map_or(0.0, |s| values.iter().map(|&x| f64::from(e(x * s - s * m))).sum());
    (plain, scaled)
}

/// The kernels of one instruction set, from the vector type and intrinsics it names: the
/// same loops over 64-float spans (the maxima, with the copy) and 32-float steps (the
/// exponential sums, with the prefetch of the next block) for every width.
macro_rules! width_kernels {
    (
        feature: $feature:literal, lanes: $lanes:literal, vector: $v:ty,
        load: $load:ident, store: $store:ident, splat: $splat:ident, zero: $zero:ident,
        max: $max:ident, add: $add:ident, sub: $sub:ident, mul: $mul:ident,
        hmax: $hmax:path, exp2: $exp2:path, floored: $floored:literal $(,)?
    ) => {
        use std::arch::x86_64::*;

        use super::{prefetch, tail_exp_sums, tail_max, Kernels, FLOOR, LOG2E, SPAN};

        pub(super) const KERNELS: Kernels = Kernels { maxima, exp_sums };

        /// Vectors per 64-float span and per 32-float step.
        const PER_SPAN: usize = SPAN / $lanes;
        const PER_STEP: usize = 32 / $lanes;

        fn maxima(src: &[f32], dst: Option<&mut [f32]>, maxima: &mut [f32]) -> f32 {
            // SAFETY: `kernels` hands this module's kernels out only when the CPU has its
            // `$feature` instruction set.
            unsafe { maxima_simd(src, dst, maxima) }
        }

        fn exp_sums(src: &[f32], m: f32, scale: Option<f32>, next: &[f32]) -> (f64, f64) {
            // SAFETY: `kernels` hands this module's kernels out only when the CPU has its
            // `$feature` instruction set.
            unsafe {
                match scale {
                    Some(s) => exp_sums_simd::<true>(src, m, s, next),
                    None => exp_sums_simd::<false>(src, m, 1.0, next),
                }
            }
        }

        #[target_feature(enable = $feature)]
        fn maxima_simd(src: &[f32], mut dst: Option<&mut [f32]>, maxima: &mut [f32]) -> f32 {
            let mut best = f32::NEG_INFINITY;
            for (s, m) in maxima.iter_mut().enumerate() {
                let at = s * SPAN;
                let span = &src[at..(at + SPAN).min(src.len())];
                if span.len() < SPAN {
                    if let Some(dst) = dst.as_deref_mut() {
                        dst[at..].copy_from_slice(span);
                    }
                    *m = tail_max(span);
                    best = best.max(*m);
                    continue;
                }
                let p = span.as_ptr();
                let q = dst.as_deref_mut().map(|d| d[at..at + SPAN].as_mut_ptr());
                let mut x = [$zero(); PER_SPAN];
                for (i, x) in x.iter_mut().enumerate() {
                    // SAFETY: `span` holds SPAN floats: PER_SPAN loads of `$lanes` from its start.
                    *x = unsafe { $load(p.add($lanes * i)) };
                }
                if let Some(q) = q {
                    for (i, x) in x.iter().enumerate() {
                        // SAFETY: `q` points at SPAN writable floats; lane group `i` is `$lanes` of them.
                        unsafe { $store(q.add($lanes * i), *x) };
                    }
                }
                // max_ps(x, acc) is `acc` when `x` is NaN: a NaN logit never wins.
                let acc = x.iter().fold($splat(f32::NEG_INFINITY), |acc, &x| $max(x, acc));
                *m = $hmax(acc);
                best = best.max(*m);
            }
            best
        }

        #[target_feature(enable = $feature)]
        fn exp_sums_simd<const SCALED: bool>(src: &[f32], m: f32, s: f32, next: &[f32]) -> (f64, f64) {
            // u = (x - m) log2(e) and s (x - m) log2(e): 0 at the maximum, whose term is exactly 1.
            let (vm, vc, vcs, vfloor) = ($splat(m), $splat(LOG2E), $splat(s * LOG2E), $splat(FLOOR));
            let (mut a, mut b): ([$v; PER_STEP], [$v; PER_STEP]) = ([$zero(); PER_STEP], [$zero(); PER_STEP]);
            let mut steps = src.chunks_exact(32);
            for (i, step) in (&mut steps).enumerate() {
                prefetch(next, 32 * i);
                let p = step.as_ptr();
                for k in 0..PER_STEP {
                    // SAFETY: `step` holds 32 floats: PER_STEP loads of `$lanes` from its start.
                    let x = unsafe { $load(p.add($lanes * k)) };
                    let y = $sub(x, vm);
                    // NaN too: max_ps returns its second operand (AVX2's exp2 holds `u` itself)
                    let y = if $floored { $max(y, vfloor) } else { y };
                    a[k] = $add(a[k], $exp2($mul(y, vc)));
                    if SCALED {
                        b[k] = $add(b[k], $exp2($mul(y, vcs)));
                    }
                }
            }
            let lanes = |v: [$v; PER_STEP]| {
                let mut out = [0f32; 32];
                for (k, x) in v.iter().enumerate() {
                    // SAFETY: `out` holds 32 floats; lane group `k` is `$lanes` of them.
                    unsafe { $store(out.as_mut_ptr().add($lanes * k), *x) };
                }
                out.iter().map(|&x| f64::from(x)).sum::<f64>()
            };
            let (ta, tb) = tail_exp_sums(steps.remainder(), m, SCALED.then_some(s));
            (lanes(a) + ta, if SCALED { lanes(b) + tb } else { 0.0 })
        }
    };
}

// Each width's intrinsics, in the macro's order.
mod avx512 {
    width_kernels! { feature: "avx512f,avx512dq", lanes: 16, vector: __m512, load: _mm512_loadu_ps,
    store: _mm512_storeu_ps, splat: _mm512_set1_ps, zero: _mm512_setzero_ps, max: _mm512_max_ps,
    add: _mm512_add_ps, sub: _mm512_sub_ps, mul: _mm512_mul_ps,
    hmax: _mm512_reduce_max_ps, exp2: super::exp2_512, floored: true }
}

mod avx2 {
    width_kernels! { feature: "avx2,fma", lanes: 8, vector: __m256, load: _mm256_loadu_ps,
    store: _mm256_storeu_ps, splat: _mm256_set1_ps, zero: _mm256_setzero_ps, max: _mm256_max_ps,
    add: _mm256_add_ps, sub: _mm256_sub_ps, mul: _mm256_mul_ps,
    hmax: super::hmax_256, exp2: super::exp2_256, floored: false }
}

/// `2^u` of each of `us` by the AVX2 (`avx512 == false`) or AVX-512 exponential, in place of
/// the kernels' own calls; `None` when the CPU lacks that instruction set (the tests check
/// both widths' accuracy).
#[cfg(test)]
pub(super) fn exp2_each(avx512: bool, us: &[f32]) -> Option<Vec<f32>> {
    let lanes = if avx512 { 16 } else { 8 };
    let has = if avx512 { has_avx512() } else { has_avx2() };
    if !has || !us.len().is_multiple_of(lanes) {
        return None;
    }
    let mut out = vec![0f32; us.len()];
    for (u, e) in us.chunks_exact(lanes).zip(out.chunks_exact_mut(lanes)) {
        // SAFETY: the CPU has the width's instruction set (checked above); both slices hold
        // `lanes` floats, what one vector loads and stores.
        unsafe {
            if avx512 {
                _mm512_storeu_ps(e.as_mut_ptr(), exp2_512(_mm512_loadu_ps(u.as_ptr())));
            } else {
                _mm256_storeu_ps(e.as_mut_ptr(), exp2_256(_mm256_loadu_ps(u.as_ptr())));
            }
        }
    }
    Some(out)
}

/// `max` over the lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn hmax_256(v: __m256) -> f32 {
    let v = _mm256_max_ps(v, _mm256_permute2f128_ps::<1>(v, v));
    let v = _mm256_max_ps(v, _mm256_shuffle_ps::<0b01_00_11_10>(v, v));
    let v = _mm256_max_ps(v, _mm256_shuffle_ps::<0b10_11_00_01>(v, v));
    _mm256_cvtss_f32(v)
}

/// `2^u` per lane, `u >= -149` (below, 0): split at `floor(u)` and scaled by it (module notes).
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) fn exp2_512(u: __m512) -> __m512 {
    // imm8: keep 0 fraction bits, round down, no precision exception: `f = u - floor(u)`.
    let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(u);
    let p = POLY[1..].iter().fold(_mm512_set1_ps(POLY[0]), |p, &c| _mm512_fmadd_ps(p, f, _mm512_set1_ps(c)));
    _mm512_scalef_ps(p, u) // vscalefps scales by floor(u) itself
}

/// `2^u` per lane, `u <= 0`; `u` below -126 and NaN count as -126 (module notes).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn exp2_256(u: __m256) -> __m256 {
    let u = _mm256_max_ps(u, _mm256_set1_ps(MIN_EXPONENT));
    let biased = _mm256_add_ps(u, _mm256_set1_ps(ROUND_BIAS));
    let f = _mm256_sub_ps(u, _mm256_sub_ps(biased, _mm256_set1_ps(ROUND_BIAS)));
    let p = POLY_HALF[1..]
        .iter()
        .fold(_mm256_set1_ps(POLY_HALF[0]), |p, &c| _mm256_fmadd_ps(p, f, _mm256_set1_ps(c)));
    // the low bits `n + 127` (1 to 127) shifted into the exponent field: 2^n
    let two_n = _mm256_slli_epi32::<23>(_mm256_castps_si256(biased));
    _mm256_mul_ps(p, _mm256_castsi256_ps(two_n))
}
