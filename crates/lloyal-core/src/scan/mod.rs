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
//! A row is summed in [`PART`]s of 65,536 values, combined in order: [`scan_rows`] spreads the
//! parts of several rows over a decode's threads (one row alone is four jobs, not one), with the
//! same bits as [`scan_row`] on one thread.
//!
//! The kernels are explicit AVX-512F+DQ and AVX2+FMA code, picked at run time, with a portable
//! one for every other CPU. They agree to a few units in the last place, not bit for bit: a
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

/// [`scan_row`] with the kernels `k`: its parts one after another, combined.
fn scan_with(
    k: Kernels,
    src: &[f32],
    copy: Option<&mut Vec<f32>>,
    maxima: &mut Vec<f32>,
    scale: Option<f32>,
) -> RowStats {
    maxima.resize(src.len().div_ceil(SPAN), f32::NEG_INFINITY);
    let scale = usable(scale);
    let mut copy = copy;
    if let Some(dst) = copy.as_deref_mut() {
        dst.resize(src.len(), 0.0); // every value is overwritten: only a change of length touches it
    }
    let partials = scan_parts(k, src, copy.map(Vec::as_mut_slice), maxima, scale);
    combine(src, maxima, &partials, scale)
}

/// [`scan_part`] of each [`PART`] of `src` in order (copied into `copy` when given; `maxima`
/// sized for `src`).
fn scan_parts(
    k: Kernels,
    src: &[f32],
    copy: Option<&mut [f32]>,
    maxima: &mut [f32],
    scale: Option<f32>,
) -> Vec<Partial> {
    let mut dst = copy.map(|d| d.chunks_mut(PART));
    src.chunks(PART)
        .zip(maxima.chunks_mut(PART / SPAN))
        .map(|(part, spans)| scan_part(k, part, dst.as_mut().and_then(Iterator::next), spans, scale))
        .collect()
}

/// Values per part: a longer row is summed part by part, each at its own maximum, and the parts
/// combined in order, so the parts of a row may run on different threads ([`scan_rows`]) and
/// give the same bits as one thread.
pub const PART: usize = 16 * BLOCK;

/// The maximum of one part and its sums taken against it.
#[derive(Debug, Clone, Copy)]
struct Partial {
    max: f32,
    sum: f64,
    scaled_sum: f64,
}

/// The scale a pass sums for: none for 1 (the model's own sum) or a value that is no scale.
fn usable(scale: Option<f32>) -> Option<f32> {
    scale.filter(|s| s.is_finite() && *s > 0.0 && *s != 1.0)
}

/// One part, block by block, online: a block with a new maximum rescales what was summed.
fn scan_part(
    k: Kernels,
    src: &[f32],
    mut copy: Option<&mut [f32]>,
    maxima: &mut [f32],
    scale: Option<f32>,
) -> Partial {
    let (mut max, mut sum, mut scaled_sum) = (f32::NEG_INFINITY, 0f64, 0f64);
    for (b, block) in src.chunks(BLOCK).enumerate() {
        let at = b * BLOCK;
        let dst = copy.as_deref_mut().map(|d| &mut d[at..at + block.len()]);
        let spans = &mut maxima[at / SPAN..(at + block.len()).div_ceil(SPAN)];
        let block_max = (k.maxima)(block, dst, spans);
        if block_max > max {
            if max > f32::NEG_INFINITY && block_max.is_finite() {
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
    Partial { max, sum, scaled_sum }
}

/// The stats of row `src` (span maxima `maxima`) from its parts' (in order).
fn combine(src: &[f32], maxima: &[f32], partials: &[Partial], scale: Option<f32>) -> RowStats {
    let max = partials.iter().map(|p| p.max).fold(f32::NEG_INFINITY, f32::max);
    let argmax = first_position(src, maxima, max);
    if !max.is_finite() {
        let lse = f64::from(max);
        return RowStats { max, argmax, lse, scaled: scale.map(|scale| Scaled { scale, lse }) };
    }
    let s = f64::from(scale.unwrap_or(1.0));
    let (mut sum, mut scaled_sum) = (0f64, 0f64);
    for p in partials.iter().filter(|p| p.max > f32::NEG_INFINITY) {
        let shift = f64::from(p.max) - f64::from(max);
        sum += p.sum * shift.exp();
        scaled_sum += p.scaled_sum * (shift * s).exp();
    }
    let lse = f64::from(max) + sum.max(f64::MIN_POSITIVE).ln();
    let scaled = scale.map(|scale| Scaled {
        scale,
        lse: f64::from(max) * f64::from(scale) + scaled_sum.max(f64::MIN_POSITIVE).ln(),
    });
    RowStats { max, argmax, lse, scaled }
}

/// One row for [`scan_rows`]: its values, its maxima buffer (replaced) and the scale to sum for.
pub struct RowJob<'a> {
    pub src: &'a [f32],
    pub maxima: &'a mut Vec<f32>,
    pub scale: Option<f32>,
}

/// [`scan_row`] (no copy) of every row, run as `run(n, job)` runs `job(0..n)` (each index once,
/// on any threads: a parallel for) on `threads` threads: a row per job when there are enough
/// rows, else a part per job (a single row of 262,144 values is 4 jobs). Each row's stats have
/// the same bits as [`scan_row`]'s, however the parts were spread.
pub fn scan_rows(
    rows: Vec<RowJob<'_>>,
    threads: usize,
    run: impl FnOnce(usize, &(dyn Fn(usize) + Sync)),
) -> Vec<RowStats> {
    let k = kernels();
    let whole_rows = rows.len() >= threads;
    let mut rows = rows;
    type Unit<'a> = parking_lot::Mutex<(&'a [f32], &'a mut [f32], Vec<Partial>)>;
    let mut partials: Vec<Vec<Partial>> = vec![Vec::new(); rows.len()];
    {
        let mut units: Vec<(usize, Option<f32>, Unit<'_>)> = Vec::new();
        for (r, job) in rows.iter_mut().enumerate() {
            job.maxima.resize(job.src.len().div_ceil(SPAN), f32::NEG_INFINITY);
            let (src, scale, maxima) = (job.src, usable(job.scale), &mut job.maxima[..]);
            if whole_rows {
                units.push((r, scale, parking_lot::Mutex::new((src, maxima, Vec::new()))));
                continue;
            }
            for (part, spans) in src.chunks(PART).zip(maxima.chunks_mut(PART / SPAN)) {
                units.push((r, scale, parking_lot::Mutex::new((part, spans, Vec::new()))));
            }
        }
        run(units.len(), &|u| {
            let (_, scale, unit) = &units[u];
            let mut unit = unit.lock();
            let (src, maxima, partials) = &mut *unit;
            *partials = scan_parts(k, src, None, maxima, *scale);
        });
        for (r, _, unit) in units {
            partials[r].extend(unit.into_inner().2); // a row's units come in order
        }
    }
    rows.iter().zip(&partials).map(|(job, p)| combine(job.src, job.maxima, p, usable(job.scale))).collect()
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
