//! One engine tick on the locked context: admit queued operations (per-operation
//! validation), plan the rows ([`super::plan`]), decode them in as few `llama_decode` calls
//! as `n_batch` allows, and publish each operation's result. A failed packed decode is
//! retried operation by operation, so one bad operation fails only its own caller, with the
//! same all-or-nothing rollback as a direct call.

use std::collections::HashSet;

use super::op::{Op, Reply, Work};
use super::plan::plan_tick;
use crate::context::ContextState;
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

/// One row of a packed batch.
#[derive(Debug, Clone, Copy)]
struct Row {
    token: i32,
    pos: i32,
    seq: i32,
    handle: Handle,
    logits: bool,
}

/// A committing branch's row, with the surprisals taken from the logits it was sampled from.
struct CommitRow {
    handle: Handle,
    token: i32,
    seq: i32,
    pos: i32,
    surprisals: Option<(f64, f64)>,
}

/// One branch's run of a prefill operation.
struct Item {
    handle: Handle,
    seq: i32,
    pos0: i32,
    tokens: Vec<i32>,
    done: usize,
}

/// A prefill operation in flight (it may span several ticks).
struct Flight {
    op: Op,
    items: Vec<Item>,
    cells: usize,
}

/// A part of a tick: one operation's rows.
enum Part {
    Commit(Op, Vec<CommitRow>),
    /// Index into the in-flight prefills, with the tokens taken per item this tick.
    Prefill(usize, Vec<usize>),
}

/// What a tick did, for the engine's statistics and replies.
#[derive(Default)]
pub(crate) struct TickOutcome {
    pub decodes: u64,
    pub rows: u64,
    /// Operations that decoded rows this tick.
    pub ops: u64,
    /// Commits among them (their callers may come straight back with the next step).
    pub commits: u64,
    pub replies: Vec<(Reply, Result<()>)>,
    /// Operations that name a branch an earlier operation is still writing: next tick.
    pub deferred: Vec<Op>,
}

impl TickOutcome {
    fn reply(&mut self, op: Op, result: Result<()>) {
        self.replies.push((op.reply, result));
    }
}

/// The scheduler's state between ticks: prefills in flight.
#[derive(Default)]
pub(crate) struct Scheduler {
    flights: Vec<Flight>,
}

impl Scheduler {
    /// Whether a prefill is still in flight (the engine ticks again without new operations).
    pub fn has_work(&self) -> bool {
        !self.flights.is_empty()
    }

    /// Prefills in flight.
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Answer every in-flight operation with `err` (the context is gone; nothing to roll back).
    pub fn fail_all(&mut self, err: &LloyalError) -> Vec<(Reply, Result<()>)> {
        self.flights.drain(..).map(|f| (f.op.reply, Err(err.clone()))).collect()
    }

    /// Run one tick over the queued `ops` (FIFO) and the prefills in flight.
    pub fn tick(&mut self, s: &mut ContextState, ops: Vec<Op>) -> TickOutcome {
        let out = self.run_tick(s, ops);
        // Tell the ledger which branches have prefill cells written ahead of their position.
        let written = self.flights.iter().flat_map(|f| f.items.iter().map(|i| (i.handle, i.done)));
        s.note_in_flight(written.collect());
        out
    }

    fn run_tick(&mut self, s: &mut ContextState, ops: Vec<Op>) -> TickOutcome {
        let mut out = TickOutcome::default();
        self.drop_stale_flights(s, &mut out);

        let mut busy: HashSet<Handle> =
            self.flights.iter().flat_map(|f| f.items.iter().map(|i| i.handle)).collect();
        let mut reserved: usize = self.flights.iter().map(|f| f.cells).sum();
        let mut commits: Vec<(Op, Vec<CommitRow>)> = Vec::new();
        for op in ops {
            if op.is_cancelled() {
                out.reply(op, Err(LloyalError::Interrupted));
                continue;
            }
            let handles = op.work.handles();
            if handles.iter().any(|h| busy.contains(h)) {
                busy.extend(handles);
                out.deferred.push(op);
                continue;
            }
            match &op.work {
                Work::Commit(pairs) => match admit_commit(s, pairs, reserved) {
                    Err(e) => out.reply(op, Err(e)),
                    Ok(rows) if rows.is_empty() => out.reply(op, Ok(())),
                    Ok(rows) => {
                        reserved += rows.len();
                        busy.extend(handles);
                        commits.push((op, rows));
                    }
                },
                Work::Prefill(items) => match admit_prefill(s, items, reserved) {
                    Err(e) => out.reply(op, Err(e)),
                    Ok((_, 0)) => out.reply(op, Ok(())),
                    Ok((items, cells)) => {
                        reserved += cells;
                        busy.extend(handles);
                        self.flights.push(Flight { op, items, cells });
                    }
                },
            }
        }

        // Plan: every commit row, then prefill tokens (FIFO) up to the budget.
        let decode_rows: usize = commits.iter().map(|c| c.1.len()).sum();
        out.commits = commits.len() as u64;
        let lefts: Vec<usize> =
            self.flights.iter().flat_map(|f| f.items.iter().map(|i| i.tokens.len() - i.done)).collect();
        let plan = plan_tick(decode_rows, &lefts, s.shape().n_batch as usize);
        let mut parts: Vec<Part> = commits.into_iter().map(|(op, rows)| Part::Commit(op, rows)).collect();
        let mut takes = plan.prefill_take.iter().copied();
        for (fi, f) in self.flights.iter().enumerate() {
            let take: Vec<usize> = f.items.iter().map(|_| takes.next().unwrap_or(0)).collect();
            if take.iter().any(|&t| t > 0) {
                parts.push(Part::Prefill(fi, take));
            }
        }
        if parts.is_empty() {
            return out;
        }
        let rows_of: Vec<Vec<Row>> = parts.iter().map(|p| self.rows(p)).collect();
        let all: Vec<Row> = rows_of.iter().flatten().copied().collect();
        out.rows = all.len() as u64;
        out.ops = parts.len() as u64;

        let (result, decodes) = execute(s, &all);
        out.decodes += decodes;
        let mut outcomes: Vec<Result<()>> = Vec::with_capacity(parts.len());
        match result {
            Ok(()) => outcomes.resize(parts.len(), Ok(())),
            Err(e) => {
                for rows in &rows_of {
                    rollback_rows(s, rows);
                }
                if parts.len() == 1 {
                    outcomes.push(Err(e));
                } else {
                    // Isolate the culprit: each operation alone.
                    for rows in &rows_of {
                        let (r, d) = execute(s, rows);
                        out.decodes += d;
                        if r.is_err() {
                            rollback_rows(s, rows);
                        }
                        outcomes.push(r);
                    }
                }
            }
        }

        let mut finished: Vec<usize> = Vec::new();
        let mut failed: Vec<(usize, LloyalError)> = Vec::new();
        for (part, result) in parts.into_iter().zip(outcomes) {
            match (part, result) {
                (Part::Commit(op, rows), Ok(())) => {
                    let r = finish_commit(s, &rows);
                    out.reply(op, r);
                }
                (Part::Commit(op, _), Err(e)) => out.reply(op, Err(e)),
                (Part::Prefill(fi, take), Ok(())) => {
                    let f = &mut self.flights[fi];
                    for (item, t) in f.items.iter_mut().zip(take) {
                        item.done += t;
                    }
                    if f.items.iter().all(|i| i.done == i.tokens.len()) {
                        finished.push(fi);
                    }
                }
                (Part::Prefill(fi, _), Err(e)) => failed.push((fi, e)),
            }
        }
        // Remove finished and failed flights (highest index first keeps the others' indices).
        let mut ends: Vec<(usize, Result<()>)> = finished.into_iter().map(|fi| (fi, Ok(()))).collect();
        ends.extend(failed.into_iter().map(|(fi, e)| (fi, Err(e))));
        ends.sort_by_key(|e| std::cmp::Reverse(e.0));
        for (fi, result) in ends {
            let f = self.flights.remove(fi);
            match result {
                Ok(()) => {
                    let r = finish_prefill(s, &f);
                    out.reply(f.op, r);
                }
                Err(e) => {
                    rollback_flight(s, &f);
                    out.reply(f.op, Err(e));
                }
            }
        }
        out
    }

    /// Fail in-flight prefills that were cancelled or whose branch was disposed meanwhile.
    fn drop_stale_flights(&mut self, s: &mut ContextState, out: &mut TickOutcome) {
        let mut keep = Vec::with_capacity(self.flights.len());
        for f in self.flights.drain(..) {
            let dead = f.items.iter().find(|i| !s.is_live(i.handle)).map(|i| i.handle);
            let err = match (f.op.is_cancelled(), dead) {
                (true, _) => LloyalError::Interrupted,
                (false, Some(handle)) => LloyalError::BranchDisposed { handle },
                (false, None) => {
                    keep.push(f);
                    continue;
                }
            };
            rollback_flight(s, &f);
            out.reply(f.op, Err(err));
        }
        self.flights = keep;
    }

    fn rows(&self, part: &Part) -> Vec<Row> {
        match part {
            Part::Commit(_, rows) => rows
                .iter()
                .map(|r| Row { token: r.token, pos: r.pos, seq: r.seq, handle: r.handle, logits: true })
                .collect(),
            Part::Prefill(fi, take) => {
                let mut rows = Vec::new();
                for (item, &t) in self.flights[*fi].items.iter().zip(take) {
                    for i in item.done..item.done + t {
                        rows.push(Row {
                            token: item.tokens[i],
                            pos: item.pos0 + i as i32,
                            seq: item.seq,
                            handle: item.handle,
                            logits: i + 1 == item.tokens.len(),
                        });
                    }
                }
                rows
            }
        }
    }
}

/// Validate a commit against the current state; its rows, or the error for its caller.
fn admit_commit(s: &mut ContextState, pairs: &[(Handle, i32)], reserved: usize) -> Result<Vec<CommitRow>> {
    let model = s.model();
    for &(h, t) in pairs {
        s.branch(h)?;
        model.check_token(i64::from(t))?;
    }
    ContextState::check_unique(pairs.iter().map(|p| p.0))?;
    for &(h, t) in pairs {
        s.branch_mut(h)?.check_grammar(t)?;
    }
    s.check_room_reserved(pairs.len(), reserved)?;
    pairs
        .iter()
        .map(|&(handle, token)| {
            let b = s.branch(handle)?;
            Ok(CommitRow { handle, token, seq: b.seq_id, pos: b.position, surprisals: b.surprisals(token) })
        })
        .collect()
}

/// Validate a prefill; its items and cell count, or the error for its caller.
fn admit_prefill(
    s: &mut ContextState,
    items: &[(Handle, Vec<i32>)],
    reserved: usize,
) -> Result<(Vec<Item>, usize)> {
    let model = s.model();
    for (h, tokens) in items {
        s.branch(*h)?;
        model.check_tokens(tokens)?;
    }
    ContextState::check_unique(items.iter().map(|i| i.0))?;
    let total: usize = items.iter().map(|i| i.1.len()).sum();
    if total == 0 {
        return Ok((Vec::new(), 0));
    }
    s.check_room_reserved(total, reserved)?;
    let items = items
        .iter()
        .map(|(handle, tokens)| {
            let b = s.branch(*handle)?;
            Ok(Item { handle: *handle, seq: b.seq_id, pos0: b.position, tokens: tokens.clone(), done: 0 })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((items, total))
}

/// Decode `rows` in n_batch chunks, copying each logits row into its branch's `next_logits`.
/// Returns the result and the number of `llama_decode` calls made.
fn execute(s: &mut ContextState, rows: &[Row]) -> (Result<()>, u64) {
    let n_batch = s.shape().n_batch as usize;
    let mut decodes = 0;
    for chunk in rows.chunks(n_batch.max(1)) {
        s.batch_mut().clear();
        for r in chunk {
            s.batch_mut().push(r.token, r.pos, r.seq, r.logits);
        }
        decodes += 1;
        let result = s.run_batch().and_then(|()| {
            for (i, r) in chunk.iter().enumerate().filter(|(_, r)| r.logits) {
                let mut next = std::mem::take(&mut s.branch_mut(r.handle)?.next_logits);
                let copied = s.copy_logits_into(i as i32, &mut next);
                s.branch_mut(r.handle)?.next_logits = next;
                copied?;
            }
            Ok(())
        });
        if let Err(e) = result {
            return (Err(e), decodes);
        }
    }
    (Ok(()), decodes)
}

/// Remove the cells `rows` wrote (each sequence from its first row's position on).
fn rollback_rows(s: &mut ContextState, rows: &[Row]) {
    let mut seen: Vec<i32> = Vec::new();
    for r in rows {
        if !seen.contains(&r.seq) {
            seen.push(r.seq);
            s.remove_cells(r.seq, r.pos, -1);
        }
    }
}

/// Remove every cell an in-flight prefill wrote (branches still live only: a disposed
/// branch's cells went with it, and its sequence may have a new owner).
fn rollback_flight(s: &mut ContextState, f: &Flight) {
    for item in &f.items {
        if s.is_live(item.handle) {
            s.remove_cells(item.seq, item.pos0, -1);
        }
    }
}

/// Publish a decoded commit: accept, advance, publish logits, count cells.
fn finish_commit(s: &mut ContextState, rows: &[CommitRow]) -> Result<()> {
    for r in rows {
        let b = s.branch_mut(r.handle)?;
        b.accept_with(r.token, r.surprisals);
        b.position += 1;
        b.publish_logits();
    }
    s.grow_cells(rows.len());
    Ok(())
}

/// Publish a finished prefill: advance positions, publish logits, count cells.
fn finish_prefill(s: &mut ContextState, f: &Flight) -> Result<()> {
    for item in &f.items {
        if item.tokens.is_empty() {
            continue;
        }
        let b = s.branch_mut(item.handle)?;
        b.position += item.tokens.len() as i32;
        b.publish_logits();
    }
    s.grow_cells(f.cells);
    Ok(())
}
