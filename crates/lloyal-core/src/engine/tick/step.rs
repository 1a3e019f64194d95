//! Generation requests' steps: the schedule phase samples each ready request's next token
//! (ending it on a stop) and admits its commit row; the update phase turns a decoded token
//! into the stream's item (text past stop strings, logprobs).

use std::sync::Arc;
use std::time::Instant;

use super::admit::admit_commit;
use super::{Budget, CommitRow, Gen, Part, Scheduler, TickOutcome};
use crate::context::state::ContextState;
use crate::engine::gen::{logprobs, Event, Finish, GenItem};
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

/// A generation request's token this tick, with its logprobs when asked.
pub(super) struct GenRow {
    pub(super) row: CommitRow,
    logprobs: Logprobs,
}

/// What a generation request does this tick.
enum Step {
    Row(GenRow),
    /// Its last token by `max_tokens`, yielded uncommitted (`GenSpec::commit_last` off).
    Last(i32, Logprobs),
    End(Finish),
}

/// A sampled token's logprob and top logprobs, when asked.
type Logprobs = Option<(f64, Vec<(i32, f64)>)>;

impl Scheduler {
    /// Sample the generation requests that want a token, oldest first: their rows join
    /// `parts`, the ones that end (a stop, their length, an error) join `ended`.
    pub(super) fn step_gens(
        &mut self,
        s: &mut ContextState,
        budget: &mut Budget,
        parts: &mut Vec<Part>,
        ended: &mut Vec<(usize, Result<Finish>)>,
        out: &mut TickOutcome,
    ) {
        for (gi, g) in self.gens.iter_mut().enumerate() {
            if budget.busy.contains(&g.spec.handle) || !g.spec.stream.take_wanted() {
                continue;
            }
            // A bounded request's row takes one of the cells it reserved.
            let own = g.reserved();
            let t0 = Instant::now();
            let step = step_gen(s, g, budget.reserved - own);
            out.sample_secs += t0.elapsed().as_secs_f64();
            match step {
                Ok(Step::Row(row)) => {
                    budget.reserved += usize::from(own == 0);
                    budget.busy.insert(g.spec.handle);
                    parts.push(Part::Gen(gi, row));
                }
                Ok(Step::Last(token, logprobs)) => {
                    let (item, end) = gen_item(s, g, token, logprobs);
                    out.events.push((Arc::clone(&g.spec.stream), Event::Item(item)));
                    ended.push((gi, Ok(end.unwrap_or(Finish::Length))));
                }
                Ok(Step::End(finish)) => ended.push((gi, Ok(finish))),
                Err(e) => ended.push((gi, Err(e))),
            }
        }
    }

    /// Publish the generation requests' decoded tokens: each stream's item, and its end when
    /// the token ends it. Their branches' next tokens are drawn first, on the decode's threads
    /// (each item peeks at its next token).
    pub(super) fn publish_gens(
        &mut self,
        s: &mut ContextState,
        rows: Vec<(usize, GenRow)>,
        ended: &mut Vec<(usize, Result<Finish>)>,
        out: &mut TickOutcome,
    ) {
        let mut published = Vec::with_capacity(rows.len());
        for (gi, row) in rows {
            match super::update::finish_commit(s, std::slice::from_ref(&row.row)) {
                Ok(()) => published.push((gi, row)),
                Err(e) => ended.push((gi, Err(e))),
            }
        }
        let t0 = Instant::now();
        let going_on = published.iter().filter(|(gi, _)| !self.gens[*gi].ends_by_length_next());
        let handles: Vec<Handle> = going_on.map(|(_, row)| row.row.handle).collect();
        s.produce_ahead(&handles);
        for (gi, row) in published {
            let g = &mut self.gens[gi];
            let (item, end) = gen_item(s, g, row.row.token, row.logprobs);
            out.events.push((Arc::clone(&g.spec.stream), Event::Item(item)));
            if let Some(finish) = end {
                ended.push((gi, Ok(finish)));
            }
        }
        out.sample_secs += t0.elapsed().as_secs_f64();
    }

    /// Remove ended generation requests (highest index first) and answer them, each with its
    /// branch's perplexity (its caller ranks choices without a context call).
    pub(super) fn end_gens(
        &mut self,
        s: &ContextState,
        mut ended: Vec<(usize, Result<Finish>)>,
        out: &mut TickOutcome,
    ) {
        ended.sort_by_key(|e| std::cmp::Reverse(e.0));
        for (gi, result) in ended {
            let g = self.gens.remove(gi);
            if let Ok(b) = s.branch(g.spec.handle) {
                g.spec.stream.set_perplexity(b.perplexity());
            }
            out.end_stream(g.op, &g.spec.stream, result);
        }
    }
}

/// Sample a generation request's next token; end it on a stop, else admit its commit row.
fn step_gen(s: &mut ContextState, g: &Gen, reserved: usize) -> Result<Step> {
    let h = g.spec.handle;
    if g.spec.max_tokens.is_some_and(|m| g.generated >= m) {
        return Ok(Step::End(Finish::Length));
    }
    let token = s.branch_produce(h)?;
    if s.model().is_eog(token) {
        return Ok(Step::End(Finish::Eog));
    }
    if g.spec.stop_tokens.contains(&token) {
        return Ok(Step::End(Finish::Stop));
    }
    let logprobs = if g.spec.logprobs || g.spec.top_logprobs > 0 {
        let b = s.branch(h)?;
        Some(logprobs(b.logits()?, b.logits.stats().lse, token, g.spec.top_logprobs))
    } else {
        None
    };
    if !g.spec.commit_last && g.ends_by_length_next() {
        return Ok(Step::Last(token, logprobs));
    }
    let mut rows = admit_commit(s, &[(h, token)], reserved)?;
    let row = rows.pop().ok_or_else(|| LloyalError::Backend("a commit admitted no row".into()))?;
    Ok(Step::Row(GenRow { row, logprobs }))
}

/// The item for a generation token (committed, or the last one uncommitted), and the
/// request's end if it ends with it. Peeks at the next token (a cached `produce`, reused by
/// the next step) so text held back for a stop string is released with the last token.
fn gen_item(s: &mut ContextState, g: &mut Gen, token: i32, logprobs: Logprobs) -> (GenItem, Option<Finish>) {
    g.generated += 1;
    let bytes = s.model().token_bytes(token, false).unwrap_or_default();
    let piece = g.utf8.push(&bytes);
    let (mut text, matched) = g.stops.push(&piece);
    let mut end = if matched {
        Some(Finish::Stop)
    } else if g.spec.max_tokens.is_some_and(|m| g.generated >= m) {
        Some(Finish::Length)
    } else {
        None
    };
    let last = end.is_some()
        || s.branch_produce(g.spec.handle)
            .is_ok_and(|t| s.model().is_eog(t) || g.spec.stop_tokens.contains(&t));
    if last && !matched {
        let (tail, matched) = g.stops.push(&g.utf8.flush());
        text.push_str(&tail);
        if matched {
            end = Some(Finish::Stop);
        } else {
            text.push_str(&g.stops.flush());
        }
    }
    let (logprob, top_logprobs) = match logprobs {
        Some((lp, top)) => (g.spec.logprobs.then_some(lp), (g.spec.top_logprobs > 0).then_some(top)),
        None => (None, None),
    };
    (GenItem { token, text, logprob, top_logprobs }, end)
}
