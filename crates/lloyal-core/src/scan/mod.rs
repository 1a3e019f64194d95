//! One pass over a decoded row of logits: what sampling and the perplexities need from it.
//!
//! A row is 262,144 floats at Gemma 3; every pass over it costs as much as the rest of a token's
//! host work. [`scan_row`] reads it once, block by block (16 KB, so each block is in L1 for the
//! whole step), and in that pass
//! - copies it into the branch's snapshot (optional),
//! - keeps the maximum of every [`SPAN`] values, which top-k sampling then reads instead of the
//!   row ([`crate::sampler::top_candidates`]),
//! - finds the maximum and its first position (greedy sampling),
//! - sums `exp(x - max)` (the model's log-sum-exp: perplexity, logprobs) and, when a scale `s`
//!   (the branch's `1 / temperature`) is given, `exp(s x - s max)` (sampling perplexity), both
//!   online: a block with a new maximum rescales what was summed before it.
//!
//! The kernels are explicit AVX-512F and AVX2+FMA code, picked at run time, with a portable one
//! for every other CPU. They agree to a few units in the last place, not bit for bit: a
//! perplexity can differ in its last digits between an AVX-512 host and an AVX2 one.

mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Values per stored maximum (the top-k prefilter's granularity).
pub const SPAN: usize = 64;
/// Values per online step: 16 KB, read from L1 by the exponential sums after the copy.
const BLOCK: usize = 4096;

/// What a pass over a row learns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowStats {
    /// The largest value (NaN ignored; `-inf` for an empty or all `-inf` row).
    pub max: f32,
    /// Its first position (0 when every value is `-inf`).
    pub argmax: i32,
    /// `log(sum(exp(x)))`; `max` itself when that is not finite.
    pub lse: f64,
    /// `log(sum(exp(scale * x)))` for the scale the pass was asked for.
    pub scaled: Option<Scaled>,
}

/// The log-sum-exp of a row scaled by `scale` (a sampler's `1 / temperature`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scaled {
    pub scale: f32,
    pub lse: f64,
}

impl RowStats {
    /// `log(sum(exp(scale * x)))` if this pass summed it for `scale`.
    pub fn scaled_lse(&self, scale: f32) -> Option<f64> {
        self.scaled.filter(|s| s.scale == scale).map(|s| s.lse)
    }
}

/// Copy `src` into `dst` (same length, when given) and write the maximum of each `SPAN` values
/// of `src` into `maxima` (`src.len().div_ceil(SPAN)` entries); the largest of them.
type MaximaKernel = fn(src: &[f32], dst: Option<&mut [f32]>, maxima: &mut [f32]) -> f32;

/// `(sum exp(x - m), sum exp(s x - s m))` over `src` (the second only when `s` is given),
/// prefetching `next` (the following block) into cache meanwhile.
type ExpSumsKernel = fn(src: &[f32], m: f32, s: Option<f32>, next: &[f32]) -> (f64, f64);

/// The block kernels of one instruction set.
#[derive(Clone, Copy)]
struct Kernels {
    maxima: MaximaKernel,
    exp_sums: ExpSumsKernel,
}

/// The kernels of the best instruction set the CPU has, at most the one `LLOYAL_ROW_KERNELS`
/// names (`avx2`, `portable`: to run as a host without AVX-512 would; read once).
fn kernels() -> Kernels {
    static CHOSEN: std::sync::OnceLock<Kernels> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let cap = std::env::var("LLOYAL_ROW_KERNELS").unwrap_or_default();
        #[cfg(target_arch = "x86_64")]
        if cap != "portable" {
            if let Some(k) = x86::kernels(cap == "avx2") {
                return k;
            }
        }
        portable::KERNELS
    })
}

/// Scan `src`: copy it into `copy` (replacing its contents) when given, its [`SPAN`] maxima
/// into `maxima` (replaced), and its [`RowStats`], with the scaled sum for `scale` when given.
pub fn scan_row(
    src: &[f32],
    copy: Option<&mut Vec<f32>>,
    maxima: &mut Vec<f32>,
    scale: Option<f32>,
) -> RowStats {
    scan_with(kernels(), src, copy, maxima, scale)
}

/// [`scan_row`] with the kernels `k`.
fn scan_with(
    k: Kernels,
    src: &[f32],
    copy: Option<&mut Vec<f32>>,
    maxima: &mut Vec<f32>,
    scale: Option<f32>,
) -> RowStats {
    maxima.resize(src.len().div_ceil(SPAN), f32::NEG_INFINITY);
    // Every value is overwritten below: only a change of length touches the buffer.
    let mut copy = copy;
    if let Some(dst) = copy.as_deref_mut() {
        dst.resize(src.len(), 0.0);
    }
    let scale = scale.filter(|s| s.is_finite() && *s > 0.0 && *s != 1.0);
    let (mut max, mut sum, mut scaled_sum) = (f32::NEG_INFINITY, 0f64, 0f64);
    for (b, block) in src.chunks(BLOCK).enumerate() {
        let at = b * BLOCK;
        let dst = copy.as_mut().map(|d| &mut d[at..at + block.len()]);
        let spans = &mut maxima[at / SPAN..(at + block.len()).div_ceil(SPAN)];
        let block_max = (k.maxima)(block, dst, spans);
        if block_max > max {
            if max > f32::NEG_INFINITY && block_max.is_finite() {
                // The sums so far were taken against the old maximum: rebase them.
                let shift = f64::from(max) - f64::from(block_max);
                sum *= shift.exp();
                scaled_sum *= (shift * f64::from(scale.unwrap_or(1.0))).exp();
            }
            max = block_max;
        }
        if max.is_finite() {
            let next = &src[(at + block.len()).min(src.len())..(at + block.len() + BLOCK).min(src.len())];
            let (a, s) = (k.exp_sums)(block, max, scale, next);
            sum += a;
            scaled_sum += s;
        }
    }
    let argmax = first_position(src, maxima, max);
    if !max.is_finite() {
        let lse = f64::from(max);
        return RowStats { max, argmax, lse, scaled: scale.map(|scale| Scaled { scale, lse }) };
    }
    let lse = f64::from(max) + sum.max(f64::MIN_POSITIVE).ln();
    let scaled = scale.map(|scale| Scaled {
        scale,
        lse: f64::from(max) * f64::from(scale) + scaled_sum.max(f64::MIN_POSITIVE).ln(),
    });
    RowStats { max, argmax, lse, scaled }
}

/// The stats of `values` (what [`scan_row`] gives for them; no copy, maxima discarded).
pub fn row_stats(values: &[f32]) -> RowStats {
    scan_row(values, None, &mut Vec::new(), None)
}

/// The first position holding `max`, found through the span maxima (0 when `max` is `-inf`).
fn first_position(row: &[f32], maxima: &[f32], max: f32) -> i32 {
    if max == f32::NEG_INFINITY {
        return 0;
    }
    let Some(s) = maxima.iter().position(|&m| m == max) else { return 0 };
    let span = &row[s * SPAN..((s + 1) * SPAN).min(row.len())];
    (s * SPAN + span.iter().position(|&v| v == max).unwrap_or(0)) as i32
}

#[cfg(test)]
mod tests;
