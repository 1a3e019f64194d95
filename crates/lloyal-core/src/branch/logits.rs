//! A branch's logits snapshot: the values of one decoded row, their [`RowStats`] and the
//! maxima top-k sampling reads instead of the row ([`crate::scan`]).
//!
//! A decoded row is read where llama.cpp wrote it ([`OutputRow`]) rather than copied: copying
//! 16 rows of 262,144 floats took ~60% of a B = 16 tick's host work. The context copies a row
//! out before a decode may overwrite it (`ContextState::keep_output_rows`), so a snapshot
//! always reads as the row it was given.

use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use crate::device_rows::{self, DeviceSummary};
use crate::raw::OutputRow;
use crate::scan::{scan_row, RowStats};

/// Refuse logits a caller hands in (`Branch.set_logits`, `Context.sample(logits=)`) that no
/// token could be sampled from: the wrong length, a NaN, or every value -inf. `what` names the
/// argument in the message.
pub fn check_supplied(logits: &[f32], n_vocab: usize, what: &str) -> crate::error::Result<()> {
    use crate::error::LloyalError;
    if logits.len() != n_vocab {
        return Err(LloyalError::invalid(format!(
            "{what} must have shape ({n_vocab},) (the model's vocabulary), got ({},); pass an array of \
             length n_vocab (e.g. a modified copy of the last logits)",
            logits.len()
        )));
    }
    if logits.iter().any(|x| x.is_nan()) {
        return Err(LloyalError::invalid(format!("{what} must not contain NaN")));
    }
    if !logits.iter().any(|&x| x > f32::NEG_INFINITY) {
        return Err(LloyalError::invalid(format!(
            "every value of {what} is -inf: no token could be sampled; leave at least one finite (or +inf)"
        )));
    }
    Ok(())
}

/// What one pass over the values learned.
#[derive(Debug)]
struct Summary {
    stats: RowStats,
    /// The maximum of each `scan::SPAN` values.
    maxima: Vec<f32>,
}

/// One row of logits (empty before any decode) with its summary. A decoded row is summarised
/// in the same pass that first reads it ([`Logits::fill_in_place`]);
/// rows set otherwise on first use. The values never change once set, so the summary stays
/// theirs.
#[derive(Debug, Default)]
pub(crate) struct Logits {
    values: Vec<f32>,
    /// A row read in place, and its values once copied out (then read instead of the row).
    row: Option<(OutputRow, OnceLock<Vec<f32>>)>,
    summary: OnceLock<Summary>,
}

impl Logits {
    /// A snapshot of `values` (summarised on first use).
    pub(crate) fn new(values: Vec<f32>) -> Self {
        Logits { values, row: None, summary: OnceLock::new() }
    }

    /// Take `row` as the values, read in place and summarised in one pass, with the
    /// log-sum-exp of `scale * row` too when `scale` is given (the buffers are reused).
    #[cfg(test)]
    pub(crate) fn fill_in_place(&mut self, row: OutputRow, scale: Option<f32>) {
        let mut maxima = self.take_maxima();
        let stats = scan_row(row.get(), None, &mut maxima, scale);
        self.set_in_place(row, stats, maxima);
    }

    /// The span-maxima buffer, to scan a new row into ([`Self::set_in_place`]).
    pub(crate) fn take_maxima(&mut self) -> Vec<f32> {
        self.summary.take().map(|s| s.maxima).unwrap_or_default()
    }

    /// Take `row` as the values, read in place, with what a scan of it found.
    pub(crate) fn set_in_place(&mut self, row: OutputRow, stats: RowStats, maxima: Vec<f32>) {
        self.row = Some((row, OnceLock::new()));
        self.summary = OnceLock::from(Summary { stats, maxima });
    }

    /// Take `row` as the values, read in place, summarised by the decode ([`crate::device_rows`]).
    pub(crate) fn set_summarised(&mut self, row: OutputRow, device: DeviceSummary) {
        self.set_in_place(row, device_rows::row_stats(&device), device.maxima);
    }

    /// These buffers for another row, what they held dropped: the larger of the owned values'
    /// and a copied-out row's allocations becomes the spare ([`Self::take_buffer`]).
    pub(crate) fn recycle(mut self) -> Logits {
        if let Some(copy) = self.row.take().and_then(|(_, mut copy)| copy.take()) {
            if copy.capacity() > self.values.capacity() {
                self.values = copy;
            }
        }
        self
    }

    /// Whether the values are still read in place (not copied out yet).
    pub(crate) fn in_place(&self) -> bool {
        self.row.as_ref().is_some_and(|(_, copy)| copy.get().is_none())
    }

    /// Copy a row read in place out (into `spare`'s allocation), so the values outlive the
    /// next decode; nothing to do otherwise.
    pub(crate) fn copy_out(&self, mut spare: Vec<f32>) {
        if let Some((row, copy)) = &self.row {
            copy.get_or_init(|| {
                spare.clear();
                spare.extend_from_slice(row.get());
                spare
            });
        }
    }

    /// This snapshot for another holder (a fork, a saved state): copied out first, so the
    /// values stay readable wherever it goes.
    pub(crate) fn share(this: &Arc<Logits>) -> Arc<Logits> {
        this.copy_out(Vec::new());
        Arc::clone(this)
    }

    /// The owned values' allocation, to copy a row into: only for a buffer whose values are
    /// never read (a branch's `next_logits` between decodes), which it leaves empty.
    pub(crate) fn take_buffer(&mut self) -> Vec<f32> {
        self.summary.take();
        std::mem::take(&mut self.values)
    }

    fn summary(&self) -> &Summary {
        self.summary.get_or_init(|| {
            let mut maxima = Vec::new();
            let stats = scan_row(self, None, &mut maxima, None);
            Summary { stats, maxima }
        })
    }

    /// Maximum, first argmax and log-sum-exp of the values.
    pub(crate) fn stats(&self) -> RowStats {
        self.summary().stats
    }

    /// The maximum of each `scan::SPAN` values (the top-k prefilter).
    pub(crate) fn maxima(&self) -> &[f32] {
        &self.summary().maxima
    }

    /// `-log softmax(values)[token]` in nats (as [`crate::metrics::surprisal`]): `inf` for a
    /// banned or out-of-range token.
    pub(crate) fn surprisal(&self, token: usize) -> f64 {
        match self.get(token) {
            Some(&l) if l != f32::NEG_INFINITY => (self.stats().lse - f64::from(l)).max(0.0),
            _ => f64::INFINITY,
        }
    }
}

impl Deref for Logits {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.row {
            Some((row, copy)) => copy.get().map_or_else(|| row.get(), Vec::as_slice),
            None => &self.values,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::metrics::{log_sum_exp, surprisal, Base};
    use crate::sampler::argmax;
    use crate::scan::SPAN;

    /// `values` as a decoded row, current until `epoch` moves.
    fn filled(values: &[f32], scale: Option<f32>, epoch: &Arc<AtomicU64>) -> Logits {
        let mut l = Logits::default();
        l.fill_in_place(OutputRow::over(values.to_vec(), epoch), scale);
        l
    }

    #[test]
    fn filled_and_lazy_summaries_agree_with_the_separate_passes() {
        // Several blocks, the maximum twice (the first wins), in a late block.
        let mut values: Vec<f32> = (0..10_000).map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0).collect();
        values[6000] = 9.5;
        values[9000] = 9.5;
        let filled = filled(&values, Some(1.25), &Arc::default());
        let lazy = Logits::new(values.clone());
        for stats in [filled.stats(), lazy.stats()] {
            assert_eq!(stats.argmax, 6000);
            assert_eq!(stats.argmax, argmax(&values));
            assert_eq!(stats.max, 9.5);
            assert_eq!(stats.lse, log_sum_exp(&values));
        }
        assert!(filled.stats().scaled_lse(1.25).is_some() && lazy.stats().scaled.is_none());
        assert_eq!(filled.maxima(), lazy.maxima());
        assert_eq!(filled.maxima().len(), values.len().div_ceil(SPAN));
        assert_eq!(&*filled, &values[..]);
        for t in [0, 6000, 9999] {
            assert_eq!(filled.surprisal(t), surprisal(&values, t, Base::Nats));
        }
        values[7] = f32::NEG_INFINITY;
        assert_eq!(Logits::new(values).surprisal(7), f64::INFINITY);
        assert_eq!(filled.surprisal(10_000), f64::INFINITY, "out of range");
    }

    #[test]
    fn refilling_replaces_values_and_summary() {
        let epoch = Arc::default();
        let mut l = filled(&[1.0, 3.0, 2.0], None, &epoch);
        assert_eq!(l.stats().argmax, 1);
        l.fill_in_place(OutputRow::over(vec![f32::NEG_INFINITY, f32::NEG_INFINITY], &epoch), None);
        let s = l.stats();
        assert_eq!((s.argmax, s.max, s.lse), (0, f32::NEG_INFINITY, f64::NEG_INFINITY));
        assert_eq!(&*l, &[f32::NEG_INFINITY, f32::NEG_INFINITY]);
        assert_eq!(l.maxima(), &[f32::NEG_INFINITY]);
    }

    #[test]
    fn a_row_read_in_place_outlives_the_next_decode_only_once_copied_out() {
        let epoch: Arc<AtomicU64> = Arc::default();
        let kept = filled(&[1.0, 2.0, 3.0], None, &epoch);
        let lost = filled(&[4.0, 5.0], None, &epoch);
        assert!(kept.in_place() && lost.in_place());
        kept.copy_out(Vec::with_capacity(8));
        assert!(!kept.in_place() && lost.in_place());
        epoch.fetch_add(1, Ordering::Release); // llama.cpp decodes again
        assert_eq!(&*kept, &[1.0, 2.0, 3.0], "the copy is read now");
        assert!(lost.is_empty(), "a row not copied out reads as empty, never as other values");
        assert_eq!(kept.stats().argmax, 2);
    }

    #[test]
    fn sharing_copies_out_and_refilling_reuses_the_copy() {
        let epoch: Arc<AtomicU64> = Arc::default();
        let mine = Arc::new(filled(&[0.5; 100], None, &epoch));
        let fork = Logits::share(&mine);
        assert!(Arc::ptr_eq(&mine, &fork) && !fork.in_place());
        epoch.fetch_add(1, Ordering::Release);
        assert_eq!(fork.len(), 100);
        drop(fork);
        let mut recycled = Arc::try_unwrap(mine).unwrap().recycle();
        assert!(!recycled.in_place());
        recycled.fill_in_place(OutputRow::over(vec![1.0; 10], &epoch), None);
        assert_eq!(&*recycled, &[1.0; 10]);
        assert!(recycled.take_buffer().capacity() >= 100, "the old copy became the spare buffer");
    }
}
