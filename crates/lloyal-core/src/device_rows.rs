//! Row summaries computed where the logits are: a decode summarises its own rows instead of the
//! host passing over them afterwards. Off unless `LLOYAL_DEVICE_ROWS=1`: measured slower on a GPU.
//!
//! A sampled row needs its maximum, its log-sum-exp, the log-sum-exp at the branch's sampling
//! scale and (for top-k) its best tokens; on the host that is a pass over 262,144 floats a row
//! (`crate::scan`). llama.cpp's backend-sampling hook (`llama_set_sampler`) lets a sequence add
//! its own operations to the decode's graph. lloyal's sampler adds, for each output row:
//! - the row's argmax, `log sum exp(x - max)` and `log sum exp(s (x - max))` (`probs`, 2 floats);
//! - the ids of its [`TOP`] best tokens, in no order (`candidates`);
//! - and leaves the row itself as it is (`logits`), so llama.cpp still copies every row to the
//!   host: `Branch.logits`, grammars, biases and every other sampler read the row as before.
//!
//! The draw itself stays on the host ([`crate::sampler`]), with the branch's RNG, so a seed gives
//! the same tokens whichever side summarised the row; the sums are in `f32` on the device (the
//! host sums in `f64`), so perplexities agree to about 1e-6 relative, not bit for bit.
//!
//! Measured on an H200 (benches/RESULTS.md, "Rows summarised on the GPU"): host work fell to
//! 0.05 ms a row, but the decode grew more than that (B = 16: 0.46x llama-batched-bench against
//! 0.79x with host rows). llama.cpp builds the hook's operations once per row, and a reduction
//! over one 262,144-float row runs as one small kernel (one block) after another, 16 rows in
//! turn: the GPU idles through them. What would pay is one set of operations over all the
//! batch's rows together (a row's sums split into parallel parts), which the per-row hook does
//! not offer; the plumbing here (one summariser per sequence, rows read from llama.cpp's
//! backend-sampling buffers) is what such a version would reuse.

use std::collections::HashMap;
use std::ffi::c_char;
use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::error::{LloyalError, Result};
use crate::scan::{RowStats, Scaled};

/// Best tokens a device row lists (top-k sampling reads them instead of the row when `k` plus
/// the branch's replaced logits fit).
pub const TOP: usize = 128;

/// The variable that picks where rows are summarised: `0` (the default: on the host) or `1` (by
/// the decode, on whatever device holds the output layer, the CPU backend included).
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
    /// The sampling scale the second sum used.
    pub scale: f32,
    /// The [`TOP`] best tokens (fewer on a smaller vocabulary), in no order.
    pub top: Vec<i32>,
}

/// The [`RowStats`] of `values` from the device's summary: the maximum and its first position
/// among the listed best tokens (the maximum is one of them), the log-sum-exps from the sums.
pub fn row_stats(values: &[f32], device: &DeviceSummary) -> RowStats {
    let mut max = f32::NEG_INFINITY;
    let mut argmax = 0;
    for &t in &device.top {
        let Some(&x) = values.get(t as usize) else { continue };
        if x > max || (x == max && t < argmax && max > f32::NEG_INFINITY) {
            (max, argmax) = (x, t);
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

/// Per-sequence state of lloyal's sampler: the scale its second sum uses.
struct Summarise {
    scale: f32,
}

unsafe extern "C" fn summarise_name(_: *const sys::llama_sampler) -> *const c_char {
    c"lloyal-row-summary".as_ptr()
}

/// The host side of the sampler: nothing (lloyal draws from the row itself).
unsafe extern "C" fn summarise_apply(_: *mut sys::llama_sampler, _: *mut sys::llama_token_data_array) {}

unsafe extern "C" fn summarise_free(smpl: *mut sys::llama_sampler) {
    // SAFETY: llama.cpp calls free once, on a sampler made by `summariser` whose ctx is a
    // leaked Box<Summarise>.
    unsafe { drop(Box::from_raw((*smpl).ctx.cast::<Summarise>())) }
}

unsafe extern "C" fn summarise_init(
    _: *mut sys::llama_sampler,
    _: sys::ggml_backend_buffer_type_t,
    _: u32,
) -> bool {
    true // plain ggml operations every backend has (the scheduler places any it lacks on the CPU)
}

/// Add the row's summary to the decode's graph (see the module docs).
unsafe extern "C" fn summarise_apply_graph(
    smpl: *mut sys::llama_sampler,
    ctx: *mut sys::ggml_context,
    _: *mut sys::ggml_cgraph,
    data: *mut sys::llama_sampler_data,
) {
    // SAFETY: llama.cpp passes the sampler made by `summariser` (ctx: a Box<Summarise>), a
    // graph context and the row's data, whose `logits` is a contiguous 1-D f32 view of the row;
    // every ggml call below builds a node in `ctx` from tensors of that context.
    unsafe {
        let scale = (*(*smpl).ctx.cast::<Summarise>()).scale;
        let data = &mut *data;
        let n = sys::ggml_nelements(data.logits);
        let row = sys::ggml_reshape_2d(ctx, data.logits, n, 1);
        let column = sys::ggml_reshape_2d(ctx, data.logits, 1, n);
        let max = sys::ggml_get_rows(ctx, column, sys::ggml_argmax(ctx, row));
        let shifted = sys::ggml_sub(ctx, row, max);
        let lse = sys::ggml_log(ctx, sys::ggml_sum_rows(ctx, sys::ggml_exp(ctx, shifted)));
        let scaled = sys::ggml_scale(ctx, shifted, scale);
        let scaled_lse = sys::ggml_log(ctx, sys::ggml_sum_rows(ctx, sys::ggml_exp(ctx, scaled)));
        data.probs = sys::ggml_concat(ctx, lse, scaled_lse, 0);
        data.candidates = sys::ggml_top_k(ctx, row, TOP.min(n as usize) as i32);
    }
}

/// The sampler's operations (the `llama_sampler_i` table llama.cpp calls through).
static SUMMARISE: SamplerTable = SamplerTable(sys::llama_sampler_i {
    name: Some(summarise_name),
    accept: None,
    apply: Some(summarise_apply),
    reset: None,
    clone: None,
    free: Some(summarise_free),
    backend_init: Some(summarise_init),
    backend_accept: None,
    backend_apply: Some(summarise_apply_graph),
    backend_set_input: None,
    backend_reset: None,
    copy_state: None,
});

/// The table as a `static` (it holds only function pointers, which are shareable).
struct SamplerTable(sys::llama_sampler_i);
// SAFETY: function pointers and no state; llama.cpp only reads the table.
unsafe impl Sync for SamplerTable {}

/// An owned sampler chain holding lloyal's summariser (llama.cpp takes only chains).
struct Chain(NonNull<sys::llama_sampler>);

impl Drop for Chain {
    fn drop(&mut self) {
        // SAFETY: made by `summariser`, freed once (which frees the summariser in it).
        unsafe { sys::llama_sampler_free(self.0.as_ptr()) }
    }
}

/// A chain with one summariser at `scale`; `None` when llama.cpp could not allocate it.
fn summariser(scale: f32) -> Option<Chain> {
    let state = Box::into_raw(Box::new(Summarise { scale })).cast();
    let table = std::ptr::from_ref(&SUMMARISE.0).cast_mut();
    // SAFETY: llama.cpp only reads the table (it is never written through the pointer); the
    // sampler owns `state` from here on (freed by `summarise_free`).
    let one = unsafe { sys::llama_sampler_init(table, state) };
    if one.is_null() {
        // SAFETY: not taken by llama.cpp; reclaimed once.
        drop(unsafe { Box::from_raw(state.cast::<Summarise>()) });
        return None;
    }
    // SAFETY: plain constructor.
    let chain = unsafe { sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params()) };
    let Some(chain) = NonNull::new(chain) else {
        // SAFETY: `one` is ours alone and freed once.
        unsafe { sys::llama_sampler_free(one) };
        return None;
    };
    // SAFETY: the chain takes ownership of `one`.
    unsafe { sys::llama_sampler_chain_add(chain.as_ptr(), one) };
    Some(Chain(chain))
}

/// The summarisers a context has set, by sequence. Field of `RawContext`, dropped after the
/// llama.cpp context (which holds pointers to them).
#[derive(Default)]
pub struct DeviceRows {
    set: HashMap<i32, (f32, Chain)>,
    /// Replaced chains, freed after the next decode (the graph they were built into is gone).
    replaced: Vec<Chain>,
}

impl DeviceRows {
    /// Give each `(seq, scale)` a summariser at that scale in `ctx`: whether a sampler was set
    /// (llama.cpp then rebuilds its graph and may move its output buffer); `None` when
    /// llama.cpp refused one (every summariser is then taken off again).
    pub fn want(&mut self, ctx: NonNull<sys::llama_context>, seqs: &[(i32, f32)]) -> Option<bool> {
        let mut changed = false;
        for &(seq, scale) in seqs {
            if self.set.get(&seq).is_some_and(|(s, _)| *s == scale) {
                continue;
            }
            let Some(chain) = summariser(scale) else {
                self.clear(ctx);
                return None;
            };
            // SAFETY: valid context and chain; the chain outlives its use by the context (kept
            // in `set`, or in `replaced` until the next decode, and the context is freed first).
            let ok = unsafe { sys::llama_set_sampler(ctx.as_ptr(), seq, chain.0.as_ptr()) };
            if !ok {
                self.clear(ctx);
                return None;
            }
            changed = true;
            if let Some((_, old)) = self.set.insert(seq, (scale, chain)) {
                self.replaced.push(old);
            }
        }
        Some(changed)
    }

    /// Take every summariser off `ctx` (they are freed after the next decode).
    pub fn clear(&mut self, ctx: NonNull<sys::llama_context>) {
        for (seq, (_, chain)) in self.set.drain() {
            // SAFETY: valid context; a null sampler takes the sequence's off.
            unsafe { sys::llama_set_sampler(ctx.as_ptr(), seq, std::ptr::null_mut()) };
            self.replaced.push(chain);
        }
    }

    /// A decode ran: chains replaced before it are no longer referenced.
    pub fn decoded(&mut self) {
        self.replaced.clear();
    }

    /// The summary of batch row `row` of the last decode, when a summariser made one.
    pub fn summary(&self, ctx: NonNull<sys::llama_context>, row: i32, seq: i32) -> Option<DeviceSummary> {
        let scale = self.set.get(&seq)?.0;
        let p = ctx.as_ptr();
        // SAFETY: valid context; llama.cpp returns null / 0 for a row without backend data, and
        // otherwise `count` values at the pointer, valid until the next decode (we copy them).
        unsafe {
            let (sums, n_sums) =
                (sys::llama_get_sampled_probs_ith(p, row), sys::llama_get_sampled_probs_count_ith(p, row));
            let (ids, n_ids) = (
                sys::llama_get_sampled_candidates_ith(p, row),
                sys::llama_get_sampled_candidates_count_ith(p, row),
            );
            if sums.is_null() || n_sums != 2 || ids.is_null() || n_ids == 0 {
                return None;
            }
            Some(DeviceSummary {
                lse_over_max: *sums,
                scaled_over_max: *sums.add(1),
                scale,
                top: std::slice::from_raw_parts(ids, n_ids as usize).to_vec(),
            })
        }
    }

    /// The row itself as llama.cpp copied it for a summarised sequence (`n` floats), else null.
    pub fn row_ptr(&self, ctx: NonNull<sys::llama_context>, row: i32, n: usize) -> *mut f32 {
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

    /// Whether any summariser is set.
    pub fn any(&self) -> bool {
        !self.set.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scan::scan_row;

    #[test]
    fn the_variable_picks_the_side_and_invariant_or_embedding_contexts_stay_on_the_host() {
        assert!(!wanted_by("", false, false).unwrap());
        assert!(!wanted_by("0", false, false).unwrap());
        assert!(wanted_by(" 1", false, false).unwrap());
        assert!(!wanted_by("1", true, false).unwrap());
        assert!(!wanted_by("1", false, true).unwrap());
        let e = wanted_by("auto", false, false).unwrap_err().to_string();
        assert!(e.contains("LLOYAL_DEVICE_ROWS") && e.contains("use 0 or 1"), "{e}");
    }

    #[test]
    fn stats_from_a_device_summary_match_a_host_pass() {
        let values: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32) * 0.05 - 2.0).collect();
        let mut maxima = Vec::new();
        let host = scan_row(&values, None, &mut maxima, Some(1.25));
        // What the device computes: sums relative to the max, and the best ids in any order.
        let m = f64::from(host.max);
        let lse_over_max = values.iter().map(|&x| (f64::from(x) - m).exp()).sum::<f64>().ln() as f32;
        let scaled_over_max =
            values.iter().map(|&x| (1.25 * (f64::from(x) - m)).exp()).sum::<f64>().ln() as f32;
        let mut order: Vec<i32> = (0..1000).collect();
        order.sort_by(|&a, &b| values[b as usize].total_cmp(&values[a as usize]));
        let mut top = order[..TOP].to_vec();
        top.reverse();
        let device = DeviceSummary { lse_over_max, scaled_over_max, scale: 1.25, top };
        let stats = row_stats(&values, &device);
        assert_eq!((stats.max, stats.argmax), (host.max, host.argmax));
        assert!((stats.lse - host.lse).abs() < 1e-5, "{} vs {}", stats.lse, host.lse);
        let (a, b) = (stats.scaled_lse(1.25).unwrap(), host.scaled_lse(1.25).unwrap());
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }

    #[test]
    fn a_row_of_minus_infinity_has_no_scaled_sum() {
        let values = vec![f32::NEG_INFINITY; 4];
        let device =
            DeviceSummary { lse_over_max: f32::NAN, scaled_over_max: f32::NAN, scale: 2.0, top: vec![2, 0] };
        let stats = row_stats(&values, &device);
        assert_eq!((stats.max, stats.argmax, stats.scaled), (f32::NEG_INFINITY, 0, None));
        assert_eq!(stats.lse, f64::NEG_INFINITY);
    }
}
