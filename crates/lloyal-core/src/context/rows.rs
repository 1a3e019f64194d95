//! Logits rows of the last decode: copied out, or read in place as branches' snapshots (and
//! copied out before a decode may overwrite them).

use super::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::scan::{scan_rows, RowJob};
use crate::tenancy::Handle;

impl ContextState {
    /// Copy the logits of batch row `row` of the last decode (which must have requested them).
    pub(crate) fn copy_logits_row(&mut self, row: i32) -> Result<Vec<f32>> {
        let src = self.raw.logits_row(row);
        let src =
            src.ok_or_else(|| LloyalError::Backend(format!("llama.cpp has no logits for batch row {row}")))?;
        Ok(src.to_vec())
    }

    /// For each `(row, branch)`: logits row `row` of the last decode becomes the branch's
    /// `next_logits`, read in place and summarised in one pass (`scan::scan_rows`), the rows'
    /// parts shared among the decode's threads (on an engine thread: `omp::parallel_for`).
    /// Each branch's snapshot also gets the log-sum-exp of its sampling distribution's scale
    /// (sampling perplexity at commit) when the branch tracks it.
    pub(crate) fn fill_next_logits_rows(&mut self, rows: &[(i32, Handle)]) -> Result<()> {
        let ids: Vec<i32> = rows.iter().map(|r| r.0).collect();
        let Some(srcs) = self.raw.output_rows(&ids) else {
            return Err(LloyalError::Backend(format!(
                "llama.cpp has no logits for one of the batch rows {ids:?}"
            )));
        };
        let mut jobs = Vec::with_capacity(rows.len());
        for (&(row, handle), src) in rows.iter().zip(srcs) {
            if let Some(device) = self.raw.device_summary(row) {
                self.branch_mut(handle)?.next_logits.set_summarised(src, device);
                continue;
            }
            let b = self.branch_mut(handle)?;
            let mut logits = std::mem::take(&mut b.next_logits);
            jobs.push((handle, b.summary_scale(), logits.take_maxima(), logits, src));
        }
        let threads = usize::try_from(self.shape.n_threads).unwrap_or(1);
        let scans = jobs
            .iter_mut()
            .map(|(_, scale, maxima, _, src)| RowJob { src: src.get(), maxima, scale: *scale })
            .collect();
        let stats = scan_rows(scans, threads, |n, job| crate::omp::parallel_for(n, threads, job));
        for ((handle, _, maxima, mut logits, src), stats) in jobs.into_iter().zip(stats) {
            logits.set_in_place(src, stats, maxima);
            self.branch_mut(handle)?.next_logits = logits;
        }
        Ok(())
    }

    /// Copy out every logits row read in place that the next decode may overwrite: all but
    /// the snapshots of the branches on sequences `keep`, which that decode replaces when it
    /// succeeds and leaves where they are when it fails (`RawContext::fails_cleanly`).
    pub(crate) fn keep_output_rows(&mut self, keep: &[i32]) {
        for b in self.branches.values_mut() {
            if b.next_logits.in_place() {
                b.next_logits.copy_out(Vec::new()); // decoded, not published yet (several calls)
            }
            if b.logits.in_place() && !keep.contains(&b.seq_id) {
                b.logits.copy_out(b.next_logits.take_buffer());
            }
        }
    }
}
