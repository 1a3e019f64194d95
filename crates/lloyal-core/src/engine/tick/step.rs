//! Generation requests' steps: the schedule phase samples each ready request's next token
//! (ending it on a stop) and admits its commit row; the update phase turns a decoded token
//! into the stream's item (text past stop strings, logprobs). A request with
//! `commit_last` off gets its first token as its prompt's tick ends ([`publish_first`]).

use std::sync::Arc;
use std::time::Instant;

use super::admit::admit_commit;
use super::{Budget, CommitRow, Gen, Part, Progress, Scheduler, TickOutcome, Waiting};
use crate::branch::GenBan;
use crate::context::state::ContextState;
use crate::engine::gen::{logprobs, Event, Finish, GenItem, GenSpec};
use crate::engine::op::Op;
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
            // A token yielded ahead is committed once its consumer wants another, the want
            // left for that next token.
            // (A busy branch keeps its consumer's want for a later tick.)
            if budget.busy.contains(&g.spec.handle) {
                continue;
            }
            let wants = if g.ahead { g.spec.stream.is_wanted() } else { g.spec.stream.take_wanted() };
            if !wants {
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
                    let (item, end) = gen_item(s, &g.spec, &mut g.p, token, logprobs);
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
        if rows.is_empty() {
            return;
        }
        let mut published = Vec::with_capacity(rows.len());
        for (gi, row) in rows {
            match super::update::finish_commit(s, std::slice::from_ref(&row.row)) {
                Ok(()) => {
                    self.gens[gi].committed += 1;
                    published.push((gi, row));
                }
                Err(e) => ended.push((gi, Err(e))),
            }
        }
        let t0 = Instant::now();
        let going_on = published.iter().filter(|(gi, _)| !self.gens[*gi].ends_by_length_next());
        let handles: Vec<Handle> = going_on.map(|(_, row)| row.row.handle).collect();
        s.produce_ahead(&handles);
        for (gi, row) in published {
            let g = &mut self.gens[gi];
            if std::mem::take(&mut g.ahead) {
                continue; // its item went out before its commit
            }
            let (item, end) = gen_item(s, &g.spec, &mut g.p, row.row.token, row.logprobs);
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
            end_gen(s, g.op, &g.spec, g.committed, result, out);
        }
    }
}

/// End a generation request with `result`, its branch's perplexity and the count of yielded
/// tokens it committed going with the end (its caller ranks and caches without a context call).
fn end_gen(
    s: &ContextState,
    op: Op,
    spec: &GenSpec,
    committed: usize,
    result: Result<Finish>,
    out: &mut TickOutcome,
) {
    if let Ok(b) = s.branch(spec.handle) {
        spec.stream.set_perplexity(b.perplexity());
    }
    spec.stream.set_committed(committed);
    out.end_stream(op, &spec.stream, result);
}

/// Sample a generation request's next token; end it on a stop, else admit its commit row.
fn step_gen(s: &mut ContextState, g: &Gen, reserved: usize) -> Result<Step> {
    let h = g.spec.handle;
    if g.ahead {
        // yielded as its prompt's tick ended (a cached `produce`: the same token)
        let token = s.branch_produce(h)?;
        return commit_row(s, h, token, None, reserved);
    }
    if g.spec.max_tokens.is_some_and(|m| g.p.generated >= m) {
        return Ok(Step::End(Finish::Length));
    }
    let token = s.branch_produce(h)?;
    if ends_at(s, &g.spec, token) {
        return Ok(Step::End(if s.model().is_eog(token) { Finish::Eog } else { Finish::Stop }));
    }
    let logprobs = token_logprobs(s, &g.spec, token)?;
    if !g.spec.commit_last && g.ends_by_length_next() {
        return Ok(Step::Last(token, logprobs));
    }
    commit_row(s, h, token, logprobs, reserved)
}

/// Admit the commit row of `token` on `h`'s branch.
fn commit_row(
    s: &mut ContextState,
    h: Handle,
    token: i32,
    logprobs: Logprobs,
    reserved: usize,
) -> Result<Step> {
    let mut rows = admit_commit(s, &[(h, token)], reserved)?;
    let row = rows.pop().ok_or_else(|| LloyalError::Backend("a commit admitted no row".into()))?;
    Ok(Step::Row(GenRow { row, logprobs }))
}

/// Whether `token` ends the request without being yielded (the model's EOG, a stop token).
fn ends_at(s: &ContextState, spec: &GenSpec, token: i32) -> bool {
    s.model().is_eog(token) || spec.stop_tokens.contains(&token)
}

/// The logprobs of `token` on the request's branch, when it asks for them.
fn token_logprobs(s: &ContextState, spec: &GenSpec, token: i32) -> Result<Logprobs> {
    if !spec.logprobs && spec.top_logprobs == 0 {
        return Ok(None);
    }
    let b = s.branch(spec.handle)?;
    Ok(Some(logprobs(b.logits()?, b.logits.maxima(), b.logits.stats().lse, token, spec.top_logprobs)))
}

/// As a request's prompt finishes (`commit_last` off): yield its first token now, a tick before
/// the tick that commits it, as llama-server sends a token once it is sampled. Returns the
/// request to wait for room for its tokens, or `None` when that token ended it (a stop string,
/// `max_tokens` of 1: never committed). A token that ends it unyielded (EOG, a stop token) or
/// leaves text held back for the next one goes the usual way, untouched, and so does a request
/// for no tokens (`max_tokens` 0: its prompt only).
pub(super) fn publish_first(s: &mut ContextState, mut w: Waiting, out: &mut TickOutcome) -> Option<Waiting> {
    if w.spec.max_tokens == Some(0) {
        return Some(w);
    }
    let Ok(token) = s.branch_produce(w.spec.handle) else { return Some(w) };
    if ends_at(s, &w.spec, token) {
        return Some(w);
    }
    let Ok(logprobs) = token_logprobs(s, &w.spec, token) else { return Some(w) };
    let mut p = Progress::new(&w.spec);
    let (item, end) = gen_item(s, &w.spec, &mut p, token, logprobs);
    if end.is_none() && p.holds() {
        return Some(w);
    }
    out.events.push((Arc::clone(&w.spec.stream), Event::Item(item)));
    let Some(finish) = end else {
        w.first = Some(p);
        return Some(w);
    };
    end_gen(s, w.op, &w.spec, 0, Ok(finish), out);
    None
}

/// Ban, on `spec`'s branch, the tokens that could end the request before its `min_tokens`
/// (the model's end-of-generation tokens and its stop tokens), for as long as it runs
/// ([`crate::branch::GenBan`]); lifted in [`gen_item`] when it has made them.
pub(super) fn ban_until_min_tokens(s: &mut ContextState, spec: &GenSpec) -> Result<()> {
    if spec.min_tokens == 0 {
        return Ok(());
    }
    let mut tokens = (*s.model().eog_tokens()).clone();
    tokens.extend(spec.stop_tokens.iter().filter(|t| !tokens.contains(t)).copied().collect::<Vec<_>>());
    let ban = GenBan { tokens: Arc::new(tokens), stream: Arc::downgrade(&spec.stream) };
    s.branch_mut(spec.handle)?.gen_ban = Some(ban);
    Ok(())
}

/// The item for a generation token (committed, or yielded before its commit), and the
/// request's end if it ends with it. Peeks at the next token (a cached `produce`, reused by
/// the next step) so text held back for a stop string is released with the last token.
fn gen_item(
    s: &mut ContextState,
    spec: &GenSpec,
    p: &mut Progress,
    token: i32,
    logprobs: Logprobs,
) -> (GenItem, Option<Finish>) {
    p.generated += 1;
    if p.generated == spec.min_tokens {
        if let Ok(b) = s.branch_mut(spec.handle) {
            b.gen_ban = None; // its next token may end it: drawn again without the ban
        }
    }
    let bytes = s.model().token_bytes(token, false).unwrap_or_default();
    let piece = p.utf8.push(&bytes);
    let (mut text, matched) =
        if p.generated < spec.min_tokens { (p.stops.hold(&piece), false) } else { p.stops.push(&piece) };
    let mut end = if matched {
        Some(Finish::Stop)
    } else if spec.max_tokens.is_some_and(|m| p.generated >= m) {
        Some(Finish::Length)
    } else {
        None
    };
    let last = end.is_some() || s.branch_produce(spec.handle).is_ok_and(|t| ends_at(s, spec, t));
    if last && !matched {
        let (tail, matched) = p.stops.push(&p.utf8.flush());
        text.push_str(&tail);
        if matched {
            end = Some(Finish::Stop);
        } else {
            text.push_str(&p.stops.flush());
        }
    }
    let (logprob, top_logprobs) = match logprobs {
        Some((lp, top)) => (spec.logprobs.then_some(lp), (spec.top_logprobs > 0).then_some(top)),
        None => (None, None),
    };
    (GenItem { token, text, logprob, top_logprobs }, end)
}
