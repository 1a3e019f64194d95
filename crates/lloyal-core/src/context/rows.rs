//! Logits rows of the last decode, copied out or into branches' snapshots.

use parking_lot::Mutex;

use super::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

impl ContextState {
    /// Copy the logits of batch row `row` (which must have requested logits).
    pub(crate) fn copy_logits_row(&mut self, row: i32) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.copy_logits_into(row, &mut out)?;
        Ok(out)
    }

    /// The logits of batch row `row` of the last decode.
    fn logits_of_row(&mut self, row: i32) -> Result<&[f32]> {
        self.raw
            .logits_row(row)
            .ok_or_else(|| LloyalError::Backend(format!("llama.cpp has no logits for batch row {row}")))
    }

    /// Copy the logits of batch row `row` into `out` (reusing its allocation).
    pub(crate) fn copy_logits_into(&mut self, row: i32, out: &mut Vec<f32>) -> Result<()> {
        let src = self.logits_of_row(row)?;
        out.clear();
        out.extend_from_slice(src);
        Ok(())
    }

    /// For each `(row, branch)`: copy logits row `row` of the last decode into the branch's
    /// `next_logits` (its buffer reused), summarised in the same pass (`Logits::fill_from`),
    /// the rows shared among the decode's threads (on an engine thread: `omp::parallel_for`).
    /// Each branch's snapshot also gets the log-sum-exp of its sampling distribution's scale
    /// (sampling perplexity at commit).
    pub(crate) fn fill_next_logits_rows(&mut self, rows: &[(i32, Handle)]) -> Result<()> {
        let mut jobs = Vec::with_capacity(rows.len());
        for &(_, handle) in rows {
            let b = self.branch_mut(handle)?;
            jobs.push((Some(b.sampling_scale()), Mutex::new(std::mem::take(&mut b.next_logits))));
        }
        let ids: Vec<i32> = rows.iter().map(|r| r.0).collect();
        let threads = usize::try_from(self.shape.n_threads).unwrap_or(1);
        let filled = match self.raw.logits_rows(&ids) {
            Some(srcs) => {
                crate::omp::parallel_for(jobs.len(), threads, &|i| {
                    let (scale, next) = &jobs[i];
                    next.lock().fill_from(srcs[i], *scale);
                });
                Ok(())
            }
            None => Err(LloyalError::Backend(format!(
                "llama.cpp has no logits for one of the batch rows {ids:?}"
            ))),
        };
        for (&(_, handle), (_, next)) in rows.iter().zip(jobs) {
            self.branch_mut(handle)?.next_logits = next.into_inner();
        }
        filled
    }
}
