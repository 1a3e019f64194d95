//! Row summaries computed where the logits are: a decode summarises its own rows instead of the
//! host passing over them afterwards. Off unless `LLOYAL_DEVICE_ROWS=1`.
//!
//! A sampled row needs its maximum, its log-sum-exp, the log-sum-exp at the branch's sampling
//! scale and (for top-k) the maximum of each span of [`SPAN`] values; on the host that is a pass
//! over 262,144 floats a row (`crate::scan`). llama.cpp's backend-sampling hook
//! (`llama_set_sampler`) lets a sequence add operations to the decode's graph: lloyal gives each
//! sequence a summariser ([`graph`]), one of which computes all of that for every row of the
//! decode together, on the GPU where the output layer is. The rows themselves still come back to
//! the host (llama.cpp copies each row a summariser left alone), so `Branch.logits`, grammars,
//! biases and every sampler read them as before, and the draw stays on the host with the
//! branch's RNG: a seed gives the same tokens whichever side summarised. The device sums in
//! `f32` (the host in `f64`): perplexities agree to about 1e-6 relative, not bit for bit.
//!
//! History (benches/RESULTS.md): a first version built its operations per row (llama.cpp's hook
//! calls it once per row) and on an H200 cost more GPU time than the host pass it saved (B = 16:
//! 0.46x llama-batched-bench against 0.79x): one 262,144-float reduction after another, each a
//! single block. This one summarises all rows in one set of operations, each reduction split
//! into parts; it is still to be timed on a GPU, so it stays opt-in.

mod graph;

use std::collections::HashMap;
use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::error::{LloyalError, Result};
use crate::scan::{RowStats, Scaled, SPAN};
use graph::{summariser, Chain, Scales};

/// The variable that turns row summaries on the device on: `1` (by the decode, on whatever
/// device holds the output layer, the CPU backend included) or `0` (the default: on the host).
pub const DEVICE_ROWS_VAR: &str = "LLOYAL_DEVICE_ROWS";

/// Whether a context summarises rows on its device ([`DEVICE_ROWS_VAR`]): never for a
/// batch-invariant context (whose statistics are the host's, the same on every run) or an
/// embeddings one (no sampling).
pub fn wanted(invariant: bool, embeddings: bool) -> Result<bool> {
    wanted_by(&std::env::var(DEVICE_ROWS_VAR).unwrap_or_default(), invariant, embeddings)
}

/// [`wanted`] with the variable's value given.
fn wanted_by(choice: &str, invariant: bool, embeddings: bool) -> Result<bool> {
    let on = match choice.trim() {
        "" | "0" => false,
        "1" => true,
        other => {
            return Err(LloyalError::invalid(format!(
                "{DEVICE_ROWS_VAR}={other:?} is not a choice; use 0 or 1"
            )))
        }
    };
    Ok(on && !invariant && !embeddings)
}

/// What a decode found in one row, from the device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSummary {
    /// `log sum exp(x - max)` and `log sum exp(scale (x - max))`.
    pub lse_over_max: f32,
    pub scaled_over_max: f32,
    /// The sampling scale of the second sum.
    pub scale: f32,
    /// The maximum of each [`SPAN`] values, and its position in its span.
    pub maxima: Vec<f32>,
    pub positions: Vec<i32>,
}

/// The [`RowStats`] of a row from the device's summary: its maximum (the largest span maximum),
/// that maximum's first position, the log-sum-exps from the sums.
pub fn row_stats(device: &DeviceSummary) -> RowStats {
    let mut max = f32::NEG_INFINITY;
    let mut argmax = 0;
    for (span, (&x, &at)) in device.maxima.iter().zip(&device.positions).enumerate() {
        if x > max {
            (max, argmax) = (x, (span * SPAN) as i32 + at);
        }
    }
    if !max.is_finite() {
        return RowStats { max, argmax, lse: f64::from(max), scaled: None };
    }
    let m = f64::from(max);
    let lse = m + f64::from(device.lse_over_max);
    let scaled = m * f64::from(device.scale) + f64::from(device.scaled_over_max);
    RowStats { max, argmax, lse, scaled: Some(Scaled { scale: device.scale, lse: scaled }) }
}

/// The summaries of the last decode's rows, as the device wrote them for its row 0.
#[derive(Debug, Default)]
struct BatchSummary {
    /// The batch index of each output row, in order.
    outputs: Vec<i32>,
    scales: Vec<f32>,
    /// `[lse_0..R, scaled_0..R, span maxima of each row]` and the maxima's positions.
    values: Vec<f32>,
    positions: Vec<i32>,
}

/// The summarisers a context has set, by sequence. Field of `RawContext`, dropped after the
/// llama.cpp context (which holds pointers to them).
pub struct DeviceRows {
    set: HashMap<i32, Chain>,
    /// Chains taken off, freed after the next decode (the graph they were built into is gone).
    replaced: Vec<Chain>,
    /// The next decode's output rows' scales, read by the summarisers.
    scales: Scales,
    /// The batch index of each output row of the decode in flight (its scales: `scales`),
    /// then what that decode summarised.
    pending: Vec<i32>,
    last: Option<BatchSummary>,
    n_vocab: usize,
}

impl DeviceRows {
    /// Summarisers for a context whose rows are `n_vocab` values.
    pub fn new(n_vocab: usize) -> Self {
        DeviceRows {
            set: HashMap::new(),
            replaced: Vec::new(),
            scales: Scales::default(),
            pending: Vec::new(),
            last: None,
            n_vocab,
        }
    }

    /// Before a decode: its output rows (`(batch index, sequence, scale)`, in order). Every
    /// sequence gets a summariser; whether one was set (llama.cpp then rebuilds its graph and
    /// may move its output buffer); `None` when llama.cpp refused one (every summariser is then
    /// taken off again).
    pub fn want(&mut self, ctx: NonNull<sys::llama_context>, outputs: &[(i32, i32, f32)]) -> Option<bool> {
        let mut changed = false;
        for &(_, seq, _) in outputs {
            if self.set.contains_key(&seq) {
                continue;
            }
            let Some(chain) = summariser(&self.scales) else {
                self.clear(ctx);
                return None;
            };
            // SAFETY: valid context and chain; the chain outlives its use by the context (kept
            // in `set`, or in `replaced` until the next decode, and the context is freed first).
            if !unsafe { sys::llama_set_sampler(ctx.as_ptr(), seq, chain.ptr()) } {
                self.clear(ctx);
                return None;
            }
            self.set.insert(seq, chain);
            changed = true;
        }
        if let Ok(mut s) = self.scales.lock() {
            *s = outputs.iter().map(|o| o.2).collect();
        }
        self.pending = outputs.iter().map(|o| o.0).collect();
        self.last = None;
        Some(changed)
    }

    /// Take every summariser off `ctx` (they are freed after the next decode).
    pub fn clear(&mut self, ctx: NonNull<sys::llama_context>) {
        for (seq, chain) in self.set.drain() {
            // SAFETY: valid context; a null sampler takes the sequence's off.
            unsafe { sys::llama_set_sampler(ctx.as_ptr(), seq, std::ptr::null_mut()) };
            self.replaced.push(chain);
        }
        self.last = None;
    }

    /// A decode succeeded: read what it summarised (row 0's buffers, valid until the next
    /// decode); chains taken off before it are no longer referenced.
    pub fn decoded(&mut self, ctx: NonNull<sys::llama_context>) {
        self.replaced.clear();
        let outputs = std::mem::take(&mut self.pending);
        self.last = None;
        let (Some(&first), false) = (outputs.first(), self.set.is_empty()) else { return };
        let rows = outputs.len();
        let spans = self.n_vocab / SPAN;
        let p = ctx.as_ptr();
        // SAFETY: valid context; llama.cpp returns null / 0 for a row without backend data, and
        // otherwise `count` values at the pointer, valid until the next decode (copied here).
        let (values, positions) = unsafe {
            let (v, nv) = (
                sys::llama_get_sampled_probs_ith(p, first),
                sys::llama_get_sampled_probs_count_ith(p, first),
            );
            let (c, nc) = (
                sys::llama_get_sampled_candidates_ith(p, first),
                sys::llama_get_sampled_candidates_count_ith(p, first),
            );
            if v.is_null() || c.is_null() || nv as usize != rows * (2 + spans) || nc as usize != rows * spans
            {
                return;
            }
            (
                std::slice::from_raw_parts(v, nv as usize).to_vec(),
                std::slice::from_raw_parts(c, nc as usize).to_vec(),
            )
        };
        let scales = self.scales.lock().map(|s| s.clone()).unwrap_or_default();
        self.last = Some(BatchSummary { outputs, scales, values, positions });
    }

    /// The device's summary of batch row `row` of the last decode, when it made one.
    pub fn summary(&self, row: i32) -> Option<DeviceSummary> {
        let b = self.last.as_ref()?;
        let j = b.outputs.iter().position(|&o| o == row)?;
        let (rows, spans) = (b.outputs.len(), self.n_vocab / SPAN);
        let maxima = b.values.get(2 * rows + j * spans..2 * rows + (j + 1) * spans)?;
        Some(DeviceSummary {
            lse_over_max: b.values[j],
            scaled_over_max: b.values[rows + j],
            scale: *b.scales.get(j)?,
            maxima: maxima.to_vec(),
            positions: b.positions.get(j * spans..(j + 1) * spans)?.to_vec(),
        })
    }

    /// The row itself as llama.cpp copied it for a summarised sequence (`n` floats), else null.
    pub fn row_ptr(&self, ctx: NonNull<sys::llama_context>, row: i32, n: usize) -> *mut f32 {
        if self.set.is_empty() {
            return std::ptr::null_mut();
        }
        let p = ctx.as_ptr();
        // SAFETY: valid context; null / 0 for a row no summariser kept.
        unsafe {
            let ptr = sys::llama_get_sampled_logits_ith(p, row);
            if sys::llama_get_sampled_logits_count_ith(p, row) as usize == n {
                ptr
            } else {
                std::ptr::null_mut()
            }
        }
    }
}

/// Rows one decode summarises at most (`graph::max_rows`): more and the host summarises them.
pub fn max_rows(n_vocab: usize) -> usize {
    graph::max_rows(n_vocab)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scan::scan_row;

    #[test]
    fn the_variable_turns_it_on_and_invariant_or_embedding_contexts_stay_on_the_host() {
        assert!(!wanted_by("", false, false).unwrap());
        assert!(!wanted_by("0", false, false).unwrap());
        assert!(wanted_by(" 1", false, false).unwrap());
        assert!(!wanted_by("1", true, false).unwrap());
        assert!(!wanted_by("1", false, true).unwrap());
        let e = wanted_by("auto", false, false).unwrap_err().to_string();
        assert!(e.contains("LLOYAL_DEVICE_ROWS") && e.contains("use 0 or 1"), "{e}");
    }

    #[test]
    fn a_batch_holds_what_one_row_buffer_can() {
        assert_eq!(max_rows(262_144), 262_144 / (2 + 4096));
        assert_eq!(max_rows(32_000), 32_000 / (2 + 500));
        assert_eq!(max_rows(32_001), 0, "not a whole number of spans");
    }

    #[test]
    fn stats_from_a_device_summary_match_a_host_pass() {
        let values: Vec<f32> = (0..1024).map(|i| ((i * 37 % 101) as f32) * 0.05 - 2.0).collect();
        let mut maxima = Vec::new();
        let host = scan_row(&values, None, &mut maxima, Some(1.25));
        // What the device computes: sums relative to the max, each span's maximum and position.
        let m = f64::from(host.max);
        let lse_over_max = values.iter().map(|&x| (f64::from(x) - m).exp()).sum::<f64>().ln() as f32;
        let scaled_over_max =
            values.iter().map(|&x| (1.25 * (f64::from(x) - m)).exp()).sum::<f64>().ln() as f32;
        let positions: Vec<i32> = values.chunks(SPAN).map(crate::sampler::argmax).collect();
        let device =
            DeviceSummary { lse_over_max, scaled_over_max, scale: 1.25, maxima: maxima.clone(), positions };
        let stats = row_stats(&device);
        assert_eq!((stats.max, stats.argmax), (host.max, host.argmax));
        assert!((stats.lse - host.lse).abs() < 1e-5, "{} vs {}", stats.lse, host.lse);
        let (a, b) = (stats.scaled_lse(1.25).unwrap(), host.scaled_lse(1.25).unwrap());
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }

    #[test]
    fn a_row_of_minus_infinity_has_no_scaled_sum() {
        let device = DeviceSummary {
            lse_over_max: f32::NAN,
            scaled_over_max: f32::NAN,
            scale: 2.0,
            maxima: vec![f32::NEG_INFINITY; 2],
            positions: vec![3, 0],
        };
        let stats = row_stats(&device);
        assert_eq!((stats.max, stats.argmax, stats.scaled), (f32::NEG_INFINITY, 0, None));
        assert_eq!(stats.lse, f64::NEG_INFINITY);
    }
}
