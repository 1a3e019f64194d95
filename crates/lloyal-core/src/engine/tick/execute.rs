//! The execute phase: a tick's rows decoded in as few `llama_decode` calls as `n_batch`
//! allows, each logits row read into its branch (a verify's drafts copied out); a failed
//! packed decode rolled back and retried operation by operation, so one bad operation fails
//! only its own caller.

use std::time::Instant;

use super::update::Copies;
use super::{CommitRow, Flight, Item, Part, Scheduler, TickOutcome};
use crate::context::batches::{AsBatchRow, BatchRow};
use crate::context::state::ContextState;
use crate::engine::op::Op;
use crate::error::Result;
use crate::tenancy::Handle;

/// One row of a packed batch.
#[derive(Debug, Clone, Copy)]
pub(super) struct Row {
    token: i32,
    pos: i32,
    seq: i32,
    handle: Handle,
    out: Out,
    /// The token after this one (a scored row's target).
    next: i32,
}

/// What becomes of a row's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    /// None are kept (a prefill row before its last).
    No,
    /// The branch's next snapshot (a prefill's last row).
    Next,
    /// The branch's next snapshot, replacing the current one (a commit's row).
    Commit,
    /// Copied out (a verify's draft row).
    Copy,
    /// Scored against the next token, with this many alternatives (a score's row before its
    /// last).
    Score(u8),
}

/// Rows of one flash-attention query tile in ggml's CPU kernel (`GGML_FA_TILE_Q`).
const FA_QUERY_TILE: usize = 64;

impl Scheduler {
    /// Decode the tick's `parts` (`rows`: its commit and prefill row counts); each part's
    /// result, with a failed part's cells removed, and the logits rows copied out for them.
    pub(super) fn execute(
        &mut self,
        s: &mut ContextState,
        parts: &[Part],
        (decode_rows, prefill_rows): (usize, usize),
        max_prefill: Option<usize>,
        out: &mut TickOutcome,
    ) -> (Vec<Result<()>>, Copies) {
        let rows_of: Vec<Vec<Row>> = parts.iter().map(|p| self.rows(p)).collect();
        let all: Vec<Row> = rows_of.iter().flatten().copied().collect();
        out.rows = all.len() as u64;
        out.ops = parts.len() as u64;
        let split = split_point(s.split_mixed_ticks, decode_rows, prefill_rows);
        let mut copies = Copies::default();
        let (result, decodes) = decode(s, &all, split, &mut out.decode_secs, &mut copies);
        out.decodes += decodes;
        let e = match result {
            Ok(()) => {
                self.burst.observe(decode_rows, prefill_rows, out.decode_secs, s.shape().n_batch as usize);
                if max_prefill.is_none() {
                    self.pacer.observe(decode_rows, prefill_rows, out.decode_secs);
                    self.pacer.ticked(Instant::now(), decode_rows);
                }
                return (vec![Ok(()); parts.len()], copies);
            }
            Err(e) => e,
        };
        for rows in &rows_of {
            s.remove_rows_cells(rows);
        }
        copies.clear();
        if parts.len() == 1 {
            return (vec![Err(e)], copies);
        }
        // Isolate the culprit: each operation alone.
        let mut outcomes = Vec::with_capacity(parts.len());
        for rows in &rows_of {
            let mut mine = Copies::default();
            let (r, d) = decode(s, rows, None, &mut out.decode_secs, &mut mine);
            out.decodes += d;
            if r.is_err() {
                s.remove_rows_cells(rows);
            } else {
                copies.append(&mut mine);
            }
            outcomes.push(r);
        }
        (outcomes, copies)
    }

    fn rows(&self, part: &Part) -> Vec<Row> {
        match part {
            Part::Gen(_, g) => vec![Row::commit(&g.row)],
            Part::Commit(_, rows) | Part::Bonus(_, _, rows) => commit_rows(rows),
            Part::Verify(_, v) => Row::drafts(v),
            Part::Prefill(fi, take) => {
                let f = &self.flights[*fi];
                let top = f.scoring.as_ref().map(|sc| sc.work.top as u8);
                let items = f.items.iter().zip(take);
                items.flat_map(|(item, &t)| Row::prefill(item, item.done..item.done + t, top)).collect()
            }
        }
    }
}

impl AsBatchRow for Row {
    fn batch_row(&self) -> BatchRow {
        BatchRow { token: self.token, pos: self.pos, seq: self.seq, output: self.out != Out::No }
    }

    fn replaces_snapshot(&self) -> bool {
        self.out == Out::Commit
    }
}

impl Row {
    /// A commit's row (logits kept).
    fn commit(r: &CommitRow) -> Row {
        Row { token: r.token, pos: r.pos, seq: r.seq, handle: r.handle, out: Out::Commit, next: -1 }
    }

    /// A verify's draft rows (every row's logits copied out).
    fn drafts(v: &super::verify::Verifying) -> Vec<Row> {
        let (seq, pos) = v.at;
        let handle = v.work.handle;
        let rows = v.work.drafts.iter().enumerate();
        rows.map(|(i, &token)| Row { token, pos: pos + i as i32, seq, handle, out: Out::Copy, next: -1 })
            .collect()
    }

    /// The rows of `item`'s tokens `range`: logits kept for its last token, and with
    /// `score` (a score's alternatives) every other row scored against the token after it.
    fn prefill(
        item: &Item,
        range: std::ops::Range<usize>,
        score: Option<u8>,
    ) -> impl Iterator<Item = Row> + '_ {
        range.map(move |i| {
            let last = i + 1 == item.tokens.len();
            let out = match (last, score) {
                (true, _) => Out::Next,
                (false, Some(top)) => Out::Score(top),
                (false, None) => Out::No,
            };
            let next = if last { -1 } else { item.tokens[i + 1] };
            Row {
                token: item.tokens[i],
                pos: item.pos0 + i as i32,
                seq: item.seq,
                handle: item.handle,
                out,
                next,
            }
        })
    }
}

/// The rows of a whole commit.
fn commit_rows(rows: &[CommitRow]) -> Vec<Row> {
    rows.iter().map(Row::commit).collect()
}

/// Where a tick's rows are cut into separate `llama_decode` calls: after the `decode_rows`
/// commit rows, when `split` (the fast CPU kernels with flash attention), there are at least
/// two of them (one sequence alone skips like a prefill) and the tick also carries prefill
/// rows, together reaching a query tile.
///
/// ggml's CPU flash attention takes 64 query rows at a time and skips a 64-cell block of
/// the cache only when it is masked for every row of the tile. Prefill rows of one sequence
/// skip every other sequence's cells; a tile holding commit rows of N sequences (one row
/// each) skips almost nothing and runs dense over the whole cache. Decoded apart, the commit
/// rows (under 64) take the row-by-row kernel, which skips masked cells one by one, and every
/// prefill tile skips again. Next to 16 streams (~4,300 cells), 16 commit rows with 48 / 128 /
/// 496 prefill rows took a median 0.51 / 0.74 / 1.57 s in one call and 0.20 / 0.39 / 1.28 s
/// in two; 4 + 252: 0.61 vs 0.55 s; 1 + 200: the same (docs/performance.md).
pub(super) fn split_point(split: bool, decode_rows: usize, prefill_rows: usize) -> Option<usize> {
    let mixed = decode_rows >= 2 && prefill_rows > 0 && decode_rows + prefill_rows >= FA_QUERY_TILE;
    (split && mixed).then_some(decode_rows)
}

/// Decode `rows` (a call ending at row `split` too), copying each logits row into its
/// branch's `next_logits` (a draft's into `copies`). Returns the result and the number of
/// `llama_decode` calls made.
fn decode(
    s: &mut ContextState,
    rows: &[Row],
    split: Option<usize>,
    secs: &mut f64,
    copies: &mut Copies,
) -> (Result<()>, u64) {
    s.decode_batches(rows, split, secs, |s, chunk| fill_logits(s, chunk, copies))
}

/// Copy each logits row of a decoded `chunk` into its branch's `next_logits`, a verify
/// draft's into `copies`.
fn fill_logits(s: &mut ContextState, chunk: &[Row], copies: &mut Copies) -> Result<()> {
    let mut rows: Vec<(i32, Handle)> = Vec::new();
    let mut scored: Vec<(i32, i32, usize)> = Vec::new();
    for (i, r) in chunk.iter().enumerate() {
        match r.out {
            Out::No => {}
            Out::Next | Out::Commit => rows.push((i as i32, r.handle)),
            Out::Copy => copies.rows.push((r.handle, s.copy_logits_row(i as i32)?)),
            Out::Score(top) => scored.push((i as i32, r.next, usize::from(top))),
        }
    }
    if !scored.is_empty() {
        let scores = s.score_rows(&scored)?;
        let handles = scored.iter().map(|&(i, ..)| chunk[i as usize].handle);
        copies.scores.extend(handles.zip(scores));
    }
    s.fill_next_logits_rows(&rows)
}

/// Remove every cell an in-flight prefill wrote (branches still live only: a disposed
/// branch's cells went with it, and its sequence may have a new owner), and undo a reseed's
/// start. Returns the operation, to answer.
pub(super) fn rollback_flight(s: &mut ContextState, f: Flight) -> Op {
    for item in &f.items {
        if s.is_live(item.handle) {
            s.remove_cells(item.seq, item.pos0, -1);
        }
    }
    if let (Some(r), Some(item)) = (f.reseed, f.items.first()) {
        s.reseed_end(item.handle, r, false);
    }
    f.op
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_rows_of_several_branches_are_cut_from_prefill_rows_on_fast_kernels() {
        assert_eq!(split_point(true, 16, 496), Some(16));
        assert_eq!(split_point(true, 2, 62), Some(2));
        // One sequence alone skips like a prefill; under one query tile nothing is tiled.
        assert_eq!(split_point(true, 1, 511), None);
        assert_eq!(split_point(true, 16, 47), None);
        // Nothing to cut, or batch-invariant kernels (row by row).
        assert_eq!(split_point(true, 16, 0), None);
        assert_eq!(split_point(true, 0, 512), None);
        assert_eq!(split_point(false, 16, 496), None);
    }
}
