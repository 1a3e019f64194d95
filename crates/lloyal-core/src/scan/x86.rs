//! The block kernels in AVX-512F (16 lanes) and AVX2+FMA (8 lanes), picked at run time: the
//! compiler's own vectorisation of the portable kernels stays at 8 lanes without FMA (LLVM
//! prefers 256-bit vectors on Intel, and Rust never fuses a multiply and an add), 3x slower.
//!
//! `exp(y)` for `y <= 0`: `y = n ln2 + r` with `n = round(y log2 e)` and `r` from a two-part
//! `ln2` (Cody-Waite), `|r| <= ln2 / 2`, a degree-6 polynomial for `e^r` (relative error
//! < 2e-7), times `2^n`. `y` below -87.3 (and NaN) count as -87.3.

use std::arch::x86_64::*;

use super::{Kernels, SPAN};

/// The kernels of the best instruction set this CPU has (None: neither); AVX2 at most when
/// `avx2_at_most`.
pub(super) fn kernels(avx2_at_most: bool) -> Option<Kernels> {
    if !avx2_at_most && is_x86_feature_detected!("avx512f") {
        return Some(Kernels { maxima: maxima_512, exp_sums: exp_sums_512 });
    }
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        return Some(Kernels { maxima: maxima_256, exp_sums: exp_sums_256 });
    }
    None
}

/// Every kernel set this CPU runs, best first (the tests compare them).
#[cfg(test)]
pub(super) fn every() -> Vec<(&'static str, Kernels)> {
    let mut out = Vec::new();
    if is_x86_feature_detected!("avx512f") {
        out.push(("avx512", Kernels { maxima: maxima_512, exp_sums: exp_sums_512 }));
    }
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        out.push(("avx2", Kernels { maxima: maxima_256, exp_sums: exp_sums_256 }));
    }
    out
}

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4; // ln 2 rounded to 11 bits: n * LN2_HI is exact
const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 - LN2_HI
const FLOOR: f32 = -87.3;
/// `e^r` = 1 + r + r^2/2 + ... + r^6/720, highest degree first.
const POLY: [f32; 7] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

/// The rest of a span or block that does not fill a vector: plain Rust.
fn tail_max(values: &[f32]) -> f32 {
    values.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Ask for the two cache lines of `next[at..at + 32]` (what the exponentials of the same
/// offset in this block read): the next block arrives while this one computes.
#[inline]
fn prefetch(next: &[f32], at: usize) {
    if let Some(line) = next.get(at..(at + 32).min(next.len())) {
        for j in (0..line.len()).step_by(16) {
            // SAFETY: a prefetch only hints the cache; the address is inside `next` anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line[j..].as_ptr().cast::<i8>()) };
        }
    }
}

fn tail_exp_sums(values: &[f32], m: f32, scale: Option<f32>) -> (f64, f64) {
    let e = super::portable::exp_nonpositive;
    let plain = values.iter().map(|&x| f64::from(e(x - m))).sum();
    let scaled = scale.map_or(0.0, |s| values.iter().map(|&x| f64::from(e(x * s - s * m))).sum());
    (plain, scaled)
}

// ---- AVX-512F ------------------------------------------------------------------------------

fn maxima_512(src: &[f32], dst: Option<&mut [f32]>, maxima: &mut [f32]) -> f32 {
    // SAFETY: `kernels` hands this out only when the CPU has AVX-512F.
    unsafe { maxima_avx512(src, dst, maxima) }
}

fn exp_sums_512(src: &[f32], m: f32, scale: Option<f32>, next: &[f32]) -> (f64, f64) {
    // SAFETY: `kernels` hands this out only when the CPU has AVX-512F.
    unsafe {
        match scale {
            Some(s) => exp_sums_avx512::<true>(src, m, s, next),
            None => exp_sums_avx512::<false>(src, m, 1.0, next),
        }
    }
}

#[target_feature(enable = "avx512f")]
fn maxima_avx512(src: &[f32], mut dst: Option<&mut [f32]>, maxima: &mut [f32]) -> f32 {
    let mut best = f32::NEG_INFINITY;
    for (s, m) in maxima.iter_mut().enumerate() {
        let at = s * SPAN;
        let span = &src[at..(at + SPAN).min(src.len())];
        if span.len() < SPAN {
            if let Some(dst) = dst.as_deref_mut() {
                dst[at..].copy_from_slice(span);
            }
            *m = tail_max(span);
        } else {
            let p = span.as_ptr();
            // SAFETY: `span` holds SPAN = 64 floats: four 16-float loads from its start.
            let v = unsafe {
                [
                    _mm512_loadu_ps(p),
                    _mm512_loadu_ps(p.add(16)),
                    _mm512_loadu_ps(p.add(32)),
                    _mm512_loadu_ps(p.add(48)),
                ]
            };
            if let Some(dst) = dst.as_deref_mut() {
                let q = dst[at..at + SPAN].as_mut_ptr();
                for (i, x) in v.iter().enumerate() {
                    // SAFETY: `q` points at 64 writable floats; lane group `i` is 16 of them.
                    unsafe { _mm512_storeu_ps(q.add(16 * i), *x) };
                }
            }
            // max_ps(x, acc) is `acc` when `x` is NaN: a NaN logit never wins.
            let acc = v.iter().fold(_mm512_set1_ps(f32::NEG_INFINITY), |acc, &x| _mm512_max_ps(x, acc));
            *m = _mm512_reduce_max_ps(acc);
        }
        best = best.max(*m);
    }
    best
}

#[target_feature(enable = "avx512f")]
fn exp_512(y: __m512) -> __m512 {
    let y = _mm512_max_ps(y, _mm512_set1_ps(FLOOR));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        y,
        _mm512_set1_ps(LOG2E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), y);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let p = POLY[1..].iter().fold(_mm512_set1_ps(POLY[0]), |p, &c| _mm512_fmadd_ps(p, r, _mm512_set1_ps(c)));
    _mm512_scalef_ps(p, n)
}

#[target_feature(enable = "avx512f")]
fn exp_sums_avx512<const SCALED: bool>(src: &[f32], m: f32, s: f32, next: &[f32]) -> (f64, f64) {
    let (vm, vs, vsm) = (_mm512_set1_ps(m), _mm512_set1_ps(s), _mm512_set1_ps(-s * m));
    let zero = _mm512_setzero_ps();
    let (mut a, mut b) = ([zero; 2], [zero; 2]);
    let mut pairs = src.chunks_exact(32);
    for (i, pair) in (&mut pairs).enumerate() {
        prefetch(next, 32 * i);
        let p = pair.as_ptr();
        // SAFETY: `pair` holds 32 floats: two 16-float loads from its start.
        let x = unsafe { [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))] };
        for i in 0..2 {
            a[i] = _mm512_add_ps(a[i], exp_512(_mm512_sub_ps(x[i], vm)));
            if SCALED {
                b[i] = _mm512_add_ps(b[i], exp_512(_mm512_fmadd_ps(x[i], vs, vsm)));
            }
        }
    }
    let lanes = |v: [__m512; 2]| {
        let mut out = [0f32; 32];
        // SAFETY: `out` holds 32 floats: two 16-float stores.
        unsafe {
            _mm512_storeu_ps(out.as_mut_ptr(), v[0]);
            _mm512_storeu_ps(out.as_mut_ptr().add(16), v[1]);
        }
        out.iter().map(|&x| f64::from(x)).sum::<f64>()
    };
    let (ta, tb) = tail_exp_sums(pairs.remainder(), m, SCALED.then_some(s));
    (lanes(a) + ta, if SCALED { lanes(b) + tb } else { 0.0 })
}

// ---- AVX2 + FMA ----------------------------------------------------------------------------

fn maxima_256(src: &[f32], dst: Option<&mut [f32]>, maxima: &mut [f32]) -> f32 {
    // SAFETY: `kernels` hands this out only when the CPU has AVX2 and FMA.
    unsafe { maxima_avx2(src, dst, maxima) }
}

fn exp_sums_256(src: &[f32], m: f32, scale: Option<f32>, next: &[f32]) -> (f64, f64) {
    // SAFETY: `kernels` hands this out only when the CPU has AVX2 and FMA.
    unsafe {
        match scale {
            Some(s) => exp_sums_avx2::<true>(src, m, s, next),
            None => exp_sums_avx2::<false>(src, m, 1.0, next),
        }
    }
}

#[target_feature(enable = "avx2,fma")]
fn hmax_256(v: __m256) -> f32 {
    let v = _mm256_max_ps(v, _mm256_permute2f128_ps::<1>(v, v));
    let v = _mm256_max_ps(v, _mm256_shuffle_ps::<0b01_00_11_10>(v, v));
    let v = _mm256_max_ps(v, _mm256_shuffle_ps::<0b10_11_00_01>(v, v));
    _mm256_cvtss_f32(v)
}

#[target_feature(enable = "avx2,fma")]
fn maxima_avx2(src: &[f32], mut dst: Option<&mut [f32]>, maxima: &mut [f32]) -> f32 {
    let mut best = f32::NEG_INFINITY;
    for (s, m) in maxima.iter_mut().enumerate() {
        let at = s * SPAN;
        let span = &src[at..(at + SPAN).min(src.len())];
        if span.len() < SPAN {
            if let Some(dst) = dst.as_deref_mut() {
                dst[at..].copy_from_slice(span);
            }
            *m = tail_max(span);
        } else {
            let p = span.as_ptr();
            let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
            for i in 0..8 {
                // SAFETY: `span` holds 64 floats: eight 8-float loads from its start.
                let x = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
                if let Some(dst) = dst.as_deref_mut() {
                    // SAFETY: `dst[at..at + 64]` is writable; lane group `i` is 8 of its floats.
                    unsafe { _mm256_storeu_ps(dst[at..at + SPAN].as_mut_ptr().add(8 * i), x) };
                }
                // max_ps(x, acc) is `acc` when `x` is NaN: a NaN logit never wins.
                acc = _mm256_max_ps(x, acc);
            }
            *m = hmax_256(acc);
        }
        best = best.max(*m);
    }
    best
}

#[target_feature(enable = "avx2,fma")]
fn exp_256(y: __m256) -> __m256 {
    let y = _mm256_max_ps(y, _mm256_set1_ps(FLOOR));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        y,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), y);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let p = POLY[1..].iter().fold(_mm256_set1_ps(POLY[0]), |p, &c| _mm256_fmadd_ps(p, r, _mm256_set1_ps(c)));
    // 2^n from the exponent bits: n >= -126 (y >= -87.3), so the result is a normal float.
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(two_n))
}

#[target_feature(enable = "avx2,fma")]
fn exp_sums_avx2<const SCALED: bool>(src: &[f32], m: f32, s: f32, next: &[f32]) -> (f64, f64) {
    let (vm, vs, vsm) = (_mm256_set1_ps(m), _mm256_set1_ps(s), _mm256_set1_ps(-s * m));
    let zero = _mm256_setzero_ps();
    let (mut a, mut b) = ([zero; 4], [zero; 4]);
    let mut quads = src.chunks_exact(32);
    for (i, quad) in (&mut quads).enumerate() {
        prefetch(next, 32 * i);
        let p = quad.as_ptr();
        for i in 0..4 {
            // SAFETY: `quad` holds 32 floats: four 8-float loads from its start.
            let x = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
            a[i] = _mm256_add_ps(a[i], exp_256(_mm256_sub_ps(x, vm)));
            if SCALED {
                b[i] = _mm256_add_ps(b[i], exp_256(_mm256_fmadd_ps(x, vs, vsm)));
            }
        }
    }
    let lanes = |v: [__m256; 4]| {
        let mut out = [0f32; 32];
        for (i, x) in v.iter().enumerate() {
            // SAFETY: `out` holds 32 floats; lane group `i` is 8 of them.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), *x) };
        }
        out.iter().map(|&x| f64::from(x)).sum::<f64>()
    };
    let (ta, tb) = tail_exp_sums(quads.remainder(), m, SCALED.then_some(s));
    (lanes(a) + ta, if SCALED { lanes(b) + tb } else { 0.0 })
}
