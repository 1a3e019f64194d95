//! Filling the decode batch and running it: the one loop every decode path uses (the engine's
//! ticks, the flat path, embeddings), and the one rollback of what a failed decode wrote.

use super::state::ContextState;
use crate::error::Result;

/// One row of a decode: `token` at `pos` of sequence `seq`, with its outputs (logits, or the
/// embedding of an embeddings context) kept when `output`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchRow {
    pub token: i32,
    pub pos: i32,
    pub seq: i32,
    pub output: bool,
}

/// What the decode loop reads of a caller's row type.
pub(crate) trait AsBatchRow {
    fn batch_row(&self) -> BatchRow;

    /// Whether this row's logits become its branch's snapshot as soon as its decode succeeds
    /// (a commit's row; the snapshot it replaces need not be copied out first).
    fn replaces_snapshot(&self) -> bool {
        false
    }
}

impl AsBatchRow for BatchRow {
    fn batch_row(&self) -> BatchRow {
        *self
    }
}

impl ContextState {
    /// Decode `rows` in calls of at most `n_batch` rows (a call also ends before row `split`),
    /// running `after(self, chunk)` after each call, while its outputs are readable (the
    /// chunk's row `i` is batch row `i`). Stops at the first failure. Returns the result and
    /// the calls made; `secs` gains the time spent in `llama_decode`. The cells of the rows are
    /// not removed on failure: see [`Self::remove_rows_cells`].
    pub(crate) fn decode_batches<R: AsBatchRow>(
        &mut self,
        rows: &[R],
        split: Option<usize>,
        secs: &mut f64,
        mut after: impl FnMut(&mut Self, &[R]) -> Result<()>,
    ) -> (Result<()>, u64) {
        let n_batch = (self.shape().n_batch as usize).max(1);
        let mut calls = 0;
        let (head, tail) = rows.split_at(split.unwrap_or(0).min(rows.len()));
        // A snapshot replaced by a call's logits stays in place only when that call is the
        // last: a failure of a later one would need it back.
        let one_call = head.len().div_ceil(n_batch) + tail.len().div_ceil(n_batch) == 1;
        for chunk in head.chunks(n_batch).chain(tail.chunks(n_batch)) {
            self.batch_mut().clear();
            for r in chunk {
                let r = r.batch_row();
                self.batch_mut().push(r.token, r.pos, r.seq, r.output);
            }
            calls += 1;
            let replacing: Vec<i32> = match one_call {
                true => chunk.iter().filter(|r| r.replaces_snapshot()).map(|r| r.batch_row().seq).collect(),
                false => Vec::new(),
            };
            let t0 = std::time::Instant::now();
            let ran = self.run_batch(&replacing);
            *secs += t0.elapsed().as_secs_f64();
            if let Err(e) = ran.and_then(|()| after(self, chunk)) {
                return (Err(e), calls);
            }
        }
        (Ok(()), calls)
    }

    /// [`Self::decode_batches`] that removes the cells `rows` wrote when it fails.
    pub(crate) fn decode_all<R: AsBatchRow>(
        &mut self,
        rows: &[R],
        after: impl FnMut(&mut Self, &[R]) -> Result<()>,
    ) -> Result<()> {
        let (result, _) = self.decode_batches(rows, None, &mut 0.0, after);
        if result.is_err() {
            self.remove_rows_cells(rows);
        }
        result
    }

    /// Remove the cells `rows` wrote: each sequence's from its first row's position on.
    pub(crate) fn remove_rows_cells<R: AsBatchRow>(&mut self, rows: &[R]) {
        let mut seen: Vec<i32> = Vec::new();
        for r in rows.iter().map(AsBatchRow::batch_row) {
            if !seen.contains(&r.seq) {
                seen.push(r.seq);
                self.remove_cells(r.seq, r.pos, -1);
            }
        }
    }
}
