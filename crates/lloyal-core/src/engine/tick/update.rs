//! The update phase: each decoded part's result published (branches accept, advance and
//! publish their logits; streams get their items), finished prefills answered (a generation
//! request's prompt then queues it for its tokens, its first token yielded already when it
//! does not commit its last), failed ones rolled back.

use super::{CommitRow, Item, Part, Scheduler, TickOutcome, Waiting};
use crate::branch::score::Scored;
use crate::context::state::ContextState;
use crate::engine::gen::{Finish, GenSpec};
use crate::engine::op::Work;
use crate::error::Result;
use crate::tenancy::Handle;

/// What a tick's decodes leave for the update beside the branches' logits, in row order: the
/// rows copied out (a verify's drafts) and the rows scored (a score's).
#[derive(Default)]
pub(super) struct Copies {
    pub(super) rows: Vec<(Handle, Vec<f32>)>,
    pub(super) scores: Vec<(Handle, Scored)>,
}

impl Copies {
    pub(super) fn clear(&mut self) {
        self.rows.clear();
        self.scores.clear();
    }

    pub(super) fn append(&mut self, other: &mut Copies) {
        self.rows.append(&mut other.rows);
        self.scores.append(&mut other.scores);
    }

    /// The scores of `handle`'s rows, taken.
    fn take_scores(&mut self, handle: Handle) -> Vec<Scored> {
        let (mine, rest) = std::mem::take(&mut self.scores).into_iter().partition(|s| s.0 == handle);
        self.scores = rest;
        mine.into_iter().map(|s: (Handle, Scored)| s.1).collect()
    }
}

impl Scheduler {
    /// Publish the tick's `parts` with their decode `outcomes` (and the rows copied for them).
    pub(super) fn update(
        &mut self,
        s: &mut ContextState,
        parts: Vec<Part>,
        (outcomes, mut copies): (Vec<Result<()>>, Copies),
        ended: &mut Vec<(usize, Result<Finish>)>,
        out: &mut TickOutcome,
    ) {
        let mut flights_ended: Vec<(usize, Result<()>)> = Vec::new();
        let mut gens = Vec::new();
        let mut sampled = Vec::new();
        for (part, result) in parts.into_iter().zip(outcomes) {
            match (part, result) {
                (Part::Commit(op, rows), Ok(())) => {
                    sampled.extend(rows.iter().filter(|r| committed_its_draw(s, r)).map(|r| r.handle));
                    let r = finish_commit(s, &rows);
                    out.reply(op, r);
                }
                (Part::Commit(op, _), Err(e)) => out.reply(op, Err(e)),
                (Part::Gen(gi, row), Ok(())) => gens.push((gi, row)),
                (Part::Gen(gi, _), Err(e)) => ended.push((gi, Err(e))),
                (Part::Prefill(fi, take), Ok(())) => {
                    let f = &mut self.flights[fi];
                    for (item, t) in f.items.iter_mut().zip(take) {
                        item.done += t;
                    }
                    if let (Some(sc), Some(item)) = (f.scoring.as_mut(), f.items.first()) {
                        sc.scored.extend(copies.take_scores(item.handle));
                    }
                    if f.items.iter().all(|i| i.done == i.tokens.len()) {
                        flights_ended.push((fi, Ok(())));
                    }
                }
                (Part::Prefill(fi, _), Err(e)) => flights_ended.push((fi, Err(e))),
                (Part::Verify(op, v), Ok(())) => {
                    let h = v.work.handle;
                    let rows = copies
                        .rows
                        .iter_mut()
                        .filter(|c| c.0 == h)
                        .map(|c| std::mem::take(&mut c.1))
                        .collect();
                    self.walk_verify(s, op, v, rows, out);
                }
                (Part::Verify(op, _), Err(e)) => out.reply(op, Err(e)),
                (Part::Bonus(op, bonus, rows), result) => {
                    self.finish_bonus(s, op, *bonus, &rows, result, out)
                }
            }
        }
        if !sampled.is_empty() {
            // Their callers sample with the branch's own sampler (they committed what
            // `produce` drew): draw the next tokens now, on the decode's threads while the
            // rows are in cache, for the `produce` calls that follow (the same tokens).
            let t0 = std::time::Instant::now();
            sampled.retain(|&h| s.is_live(h));
            s.produce_ahead(&sampled);
            out.sample_secs += t0.elapsed().as_secs_f64();
        }
        self.publish_gens(s, gens, ended, out);
        self.end_flights(s, flights_ended, out);
    }

    /// Remove finished and failed flights (highest index first keeps the others' indices)
    /// and answer them; a generation request's finished prompt queues it for its tokens.
    fn end_flights(
        &mut self,
        s: &mut ContextState,
        mut ends: Vec<(usize, Result<()>)>,
        out: &mut TickOutcome,
    ) {
        ends.sort_by_key(|e| std::cmp::Reverse(e.0));
        for (fi, result) in ends {
            let mut f = self.flights.remove(fi);
            if let Err(e) = result {
                let op = super::execute::rollback_flight(s, f);
                out.reply(op, Err(e));
                continue;
            }
            let finished = finish_prefill(s, &f.items, f.cells);
            if let (Some(r), Some(item)) = (f.reseed.take(), f.items.first()) {
                s.reseed_end(item.handle, r, finished.is_ok());
            }
            match (&f.op.work, finished) {
                (Work::Generate(spec), Ok(())) => {
                    let spec = GenSpec { prompt: Vec::new(), ..(**spec).clone() };
                    let w = Waiting::new(f.op, spec);
                    let w = if w.spec.commit_last { Some(w) } else { super::step::publish_first(s, w, out) };
                    if let Some(w) = w {
                        self.waiting.push_back(w);
                        self.fresh_waiting = true;
                    }
                }
                (_, r) => {
                    if let (Some(sc), true) = (f.scoring.take(), r.is_ok()) {
                        sc.work.result.set(sc.scored);
                    }
                    if r.is_ok() {
                        out.prefilled.extend(f.items.iter().map(|i| i.handle));
                    }
                    out.reply(f.op, r)
                }
            }
        }
    }
}

/// Whether a commit row's token is the one its branch's sampler drew (`produce`) for it.
fn committed_its_draw(s: &ContextState, row: &CommitRow) -> bool {
    s.branch(row.handle).is_ok_and(|b| matches!(b.pending, Some((t, _)) if t == row.token))
}

/// Publish a decoded commit: accept, advance, publish logits, count cells.
pub(super) fn finish_commit(s: &mut ContextState, rows: &[CommitRow]) -> Result<()> {
    for r in rows {
        let b = s.branch_mut(r.handle)?;
        b.accept_with(r.token, r.surprisals);
        b.position += 1;
        b.publish_logits();
    }
    s.ledger.grow_cells(rows.len());
    Ok(())
}

/// Publish a finished prefill: advance positions, publish logits, count cells.
pub(super) fn finish_prefill(s: &mut ContextState, items: &[Item], cells: usize) -> Result<()> {
    for item in items {
        if item.tokens.is_empty() {
            continue;
        }
        let b = s.branch_mut(item.handle)?;
        b.position += item.tokens.len() as i32;
        b.publish_logits();
    }
    s.ledger.grow_cells(cells);
    Ok(())
}
