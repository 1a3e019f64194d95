//! The schedule phase's admission: what went stale is answered, queued operations are
//! validated one by one (an invalid one fails only its caller), waiting generation requests
//! start in arrival order when the cache has room for them, and lease waiters are served.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use super::{Budget, CommitRow, Flight, Gen, Item, Part, Scheduler, Scoring, TickOutcome, Waiting};
use crate::branch::score::ScoreWork;
use crate::context::state::ContextState;
use crate::engine::gen::GenSpec;
use crate::engine::op::{Op, Work};
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

/// Why an operation on `handle` can no longer run: its caller cancelled it or the branch
/// was disposed meanwhile.
fn gone(s: &ContextState, op: &Op, handle: Handle) -> Option<LloyalError> {
    if op.is_cancelled() {
        Some(LloyalError::Interrupted)
    } else if !s.is_live(handle) {
        Some(LloyalError::BranchDisposed { handle })
    } else {
        None
    }
}

/// End a waiting generation request with `err`.
fn fail_waiting(out: &mut TickOutcome, w: Waiting, err: LloyalError) {
    w.spec.stream.set_committed(0);
    out.end_stream(w.op, &w.spec.stream, Err(err));
}

/// The error of a request that waited its whole timeout for `need` cells of room for `what`.
fn waited_too_long(s: &ContextState, w: &Waiting, need: usize, what: &str, budget: &Budget) -> LloyalError {
    let n_ctx = s.shape().n_ctx;
    LloyalError::KvCacheFull {
        needed: need,
        n_ctx,
        detail: format!(
            "the generation request waited {:.3} s (its timeout) for room{what}: branches hold {} \
             cells and running requests reserve {} more, {} free",
            w.since.elapsed().as_secs_f64(),
            s.ledger.cells_used(),
            budget.reserved,
            s.room(budget.reserved),
        ),
    }
}

/// A FIFO of waiting generation requests and how to admit from it.
struct Fifo {
    /// Cells a request needs before it starts.
    need: fn(&Waiting) -> usize,
    /// What it waits room for, for the timeout's message.
    what: fn(&Waiting) -> String,
    /// It starts only while no other operation of the tick writes its branch.
    needs_idle: bool,
}

impl Fifo {
    /// Walk `queue` oldest first: answer the cancelled and the gone, `start` each request
    /// while the cache has room for it (a blocked one holds back the later ones), fail those
    /// whose timeout passed, keep the rest.
    fn admit(
        &self,
        queue: &mut VecDeque<Waiting>,
        s: &mut ContextState,
        budget: &mut Budget,
        out: &mut TickOutcome,
        mut start: impl FnMut(Waiting, &mut ContextState, &mut Budget, &mut TickOutcome),
    ) {
        let mut keep = VecDeque::with_capacity(queue.len());
        let mut blocked = false;
        for w in queue.drain(..) {
            if let Some(err) = gone(s, &w.op, w.spec.handle) {
                fail_waiting(out, w, err);
                continue;
            }
            let need = (self.need)(&w);
            let idle = !self.needs_idle || !budget.busy.contains(&w.spec.handle);
            if !blocked && idle {
                s.cache_make_room(0, need, budget.reserved, &[w.spec.handle]);
            }
            if !blocked && need <= s.room(budget.reserved) && idle {
                start(w, s, budget, out);
                continue;
            }
            blocked = true;
            if w.spec.timeout.is_some_and(|t| w.since.elapsed() >= t) {
                let err = waited_too_long(s, &w, need, &(self.what)(&w), budget);
                fail_waiting(out, w, err);
                continue;
            }
            keep.push_back(w);
        }
        *queue = keep;
    }
}

impl Scheduler {
    /// Admit one queued operation: a commit becomes this tick's part, a prefill a flight, a
    /// generation request and a lease call wait in their queues; an invalid one is answered.
    pub(super) fn admit_op(
        &mut self,
        s: &mut ContextState,
        op: Op,
        budget: &mut Budget,
        out: &mut TickOutcome,
    ) -> Option<Part> {
        if op.is_cancelled() {
            out.reply(op, Err(LloyalError::Interrupted));
            return None;
        }
        let handles = op.work.handles();
        let writes = !matches!(op.work, Work::Lease(_) | Work::Generate(_));
        if let Some(h) = handles.iter().find(|&&h| writes && self.is_generating(h)) {
            let err = LloyalError::invalid(format!(
                "branch {h} is generating (a generate() iterator of it is open): close that iterator \
                 or let it finish before committing, prefilling, verifying, scoring or reseeding it"
            ));
            out.reply(op, Err(err));
            return None;
        }
        if handles.iter().any(|h| budget.busy.contains(h)) {
            budget.busy.extend(handles);
            out.deferred.push(op);
            return None;
        }
        match &op.work {
            Work::Commit(pairs) => match admit_commit(s, pairs, budget.reserved) {
                Err(e) => out.reply(op, Err(e)),
                Ok(rows) if rows.is_empty() => out.reply(op, Ok(())),
                Ok(rows) => {
                    budget.reserved += rows.len();
                    budget.busy.extend(handles);
                    return Some(Part::Commit(op, rows));
                }
            },
            Work::Prefill(items) => match admit_prefill(s, items, budget.reserved) {
                Err(e) => out.reply(op, Err(e)),
                Ok((_, 0)) => out.reply(op, Ok(())),
                Ok((items, cells)) => {
                    budget.reserved += cells;
                    budget.busy.extend(handles);
                    self.flights.push(Flight {
                        op,
                        items,
                        cells,
                        arrived: Instant::now(),
                        reseed: None,
                        scoring: None,
                    });
                }
            },
            Work::Lease(_) => self.lease_waiting.push_back(op),
            Work::Score(w) => {
                let w = Arc::clone(w);
                match admit_score(s, &w, budget.reserved) {
                    Err(e) => out.reply(op, Err(e)),
                    Ok(None) => out.reply(op, Ok(())),
                    Ok(Some((items, scoring))) => {
                        budget.reserved += w.tokens.len();
                        budget.busy.extend(handles);
                        let arrived = Instant::now();
                        let scoring = Some(scoring);
                        let cells = w.tokens.len();
                        self.flights.push(Flight { op, items, cells, arrived, reseed: None, scoring });
                    }
                }
            }
            Work::Verify(w) => {
                let w = Arc::clone(w);
                return self.admit_verify(s, op, w, budget, out);
            }
            Work::Reseed(h, sinks, tail) => match s.reseed_begin(*h, sinks, tail, budget.reserved) {
                Err(e) => out.reply(op, Err(e)),
                Ok((tokens, r)) => {
                    let cells = tokens.len();
                    budget.reserved += cells;
                    budget.busy.insert(*h);
                    let items = vec![Item { handle: *h, seq: r.seq, pos0: 0, tokens, done: 0 }];
                    let arrived = Instant::now();
                    self.flights.push(Flight { op, items, cells, arrived, reseed: Some(r), scoring: None });
                }
            },
            Work::Generate(spec) => {
                // A request with a prompt waits (FIFO) for room for the prompt and its tokens,
                // then prefills it (a flight) and queues for its tokens when it is written.
                let spec = (**spec).clone();
                match self.admit_gen(s, &spec).and_then(|()| super::step::ban_until_min_tokens(s, &spec)) {
                    Err(e) => out.reply(op, Err(e)),
                    Ok(()) if spec.prompt.is_empty() => {
                        self.waiting.push_back(Waiting::new(op, spec));
                        self.admit_waiting(s, budget, out);
                    }
                    Ok(()) => {
                        self.prompt_waiting.push_back(Waiting::new(op, spec));
                        self.admit_prompts(s, budget, out);
                    }
                }
            }
        }
        None
    }

    /// Start waiting generation requests, oldest first, while the cache has room for the
    /// head's reservation (FIFO: a later request never overtakes an earlier one); fail those
    /// whose timeout passed or whose branch went away.
    pub(super) fn admit_waiting(&mut self, s: &mut ContextState, budget: &mut Budget, out: &mut TickOutcome) {
        let gens = &mut self.gens;
        let queue = Fifo { need: |w| w.spec.cells(), what: |_| String::new(), needs_idle: false };
        queue.admit(&mut self.waiting, s, budget, out, |w, _, budget, _| {
            budget.reserved += w.spec.reservation(0);
            gens.push(Gen::start(w));
        });
    }

    /// Start the prompts of waiting generation requests, oldest first, while the cache has
    /// room for a prompt and its request's tokens; answer the cancelled, the gone and the
    /// timed out.
    pub(super) fn admit_prompts(&mut self, s: &mut ContextState, budget: &mut Budget, out: &mut TickOutcome) {
        let flights = &mut self.flights;
        let queue = Fifo {
            need: |w| w.spec.prompt.len() + w.spec.cells(),
            what: |w| format!(" for its {}-token prompt and its tokens", w.spec.prompt.len()),
            needs_idle: true,
        };
        queue.admit(&mut self.prompt_waiting, s, budget, out, |w, s, budget, out| {
            match admit_prefill(s, &[(w.spec.handle, w.spec.prompt.clone())], budget.reserved) {
                Ok((items, cells)) => {
                    budget.reserved += cells;
                    budget.busy.insert(w.spec.handle);
                    let arrived = w.spec.arrived.unwrap_or_else(Instant::now);
                    flights.push(Flight { op: w.op, items, cells, arrived, reseed: None, scoring: None });
                }
                Err(e) => fail_waiting(out, w, e),
            }
        });
    }

    /// Validate a new generation request: its branch is live and has logits to sample from,
    /// no other request is generating on it, and its reservation could ever fit the cache.
    fn admit_gen(&self, s: &mut ContextState, spec: &GenSpec) -> Result<()> {
        if spec.prompt.is_empty() {
            s.branch(spec.handle)?.logits()?;
        }
        let n_ctx = s.shape().n_ctx as usize;
        let held = s.branch(spec.handle)?.position.max(0) as usize + spec.prompt.len();
        if spec.cells() > n_ctx.saturating_sub(held) {
            return Err(LloyalError::KvCacheFull {
                needed: spec.cells(),
                n_ctx: n_ctx as u32,
                detail: format!(
                    "max_tokens={} can never fit: the branch holds {held} positions (its prompt \
                     included) of n_ctx={n_ctx}; lower max_tokens or shorten the prompt",
                    spec.cells()
                ),
            });
        }
        if self.is_generating(spec.handle) {
            return Err(LloyalError::invalid(format!(
                "branch {} is already generating (another iterator of it is open); finish or \
                 close that iterator first",
                spec.handle
            )));
        }
        Ok(())
    }

    /// Whether a generation request holds `handle` (running, or waiting to start).
    fn is_generating(&self, handle: Handle) -> bool {
        self.gens.iter().map(|g| g.spec.handle).any(|h| h == handle)
            || self.waiting.iter().chain(self.prompt_waiting.iter()).any(|w| w.spec.handle == handle)
    }

    /// Grant leases to waiters in arrival order while leases are free; answer the cancelled
    /// and the expired ones. A fork waits while its parent's prefill is in flight.
    pub(super) fn serve_leases(&mut self, s: &mut ContextState, out: &mut TickOutcome) {
        let now = Instant::now();
        let in_flight = |h: Handle| self.flights.iter().any(|f| f.items.iter().any(|i| i.handle == h));
        let mut blocked = false;
        let mut keep = VecDeque::with_capacity(self.lease_waiting.len());
        for op in std::mem::take(&mut self.lease_waiting) {
            let Work::Lease(w) = &op.work else {
                let err = LloyalError::Backend("internal error: a non-lease op waited for a lease".into());
                out.reply(op, Err(err));
                continue;
            };
            let w = Arc::clone(w);
            if op.is_cancelled() {
                out.reply(op, Err(LloyalError::Interrupted));
            } else if !blocked
                && !w.parent.is_some_and(in_flight)
                && s.cache_make_room(1, 0, 0, w.parent.as_slice())
            {
                let r = w.grant(s);
                out.reply(op, r);
            } else if w.expired(now) {
                let err = LloyalError::LeaseWaitTimedOut { n_seq_max: s.lease_count(), waited: w.timeout };
                out.reply(op, Err(err));
            } else {
                blocked = true; // first come, first served: later waiters stay behind this one
                keep.push_back(op);
            }
        }
        self.lease_waiting = keep;
    }

    /// End generation requests that were cancelled or whose branch was disposed meanwhile
    /// (the branch stays at its last committed token).
    pub(super) fn drop_stale_gens(&mut self, s: &mut ContextState, out: &mut TickOutcome) {
        let mut keep = Vec::with_capacity(self.gens.len());
        for g in self.gens.drain(..) {
            match gone(s, &g.op, g.spec.handle) {
                Some(err) => {
                    g.spec.stream.set_committed(g.committed);
                    out.end_stream(g.op, &g.spec.stream, Err(err));
                }
                None => keep.push(g),
            }
        }
        self.gens = keep;
    }

    /// Fail in-flight prefills that were cancelled or whose branch was disposed meanwhile.
    pub(super) fn drop_stale_flights(&mut self, s: &mut ContextState, out: &mut TickOutcome) {
        let mut keep = Vec::with_capacity(self.flights.len());
        for f in self.flights.drain(..) {
            let Some(err) = f.items.iter().find_map(|i| gone(s, &f.op, i.handle)) else {
                keep.push(f);
                continue;
            };
            let op = super::execute::rollback_flight(s, f);
            out.reply(op, Err(err));
        }
        self.flights = keep;
    }
}

/// Validate a commit against the current state; its rows, or the error for its caller.
pub(super) fn admit_commit(
    s: &mut ContextState,
    pairs: &[(Handle, i32)],
    reserved: usize,
) -> Result<Vec<CommitRow>> {
    let model = s.model();
    for &(h, t) in pairs {
        s.branch(h)?;
        model.check_token(i64::from(t))?;
    }
    ContextState::check_unique(pairs.iter().map(|p| p.0))?;
    for &(h, t) in pairs {
        s.branch_mut(h)?.check_grammar(t)?;
    }
    if s.room(reserved) < pairs.len() {
        let handles: Vec<Handle> = pairs.iter().map(|p| p.0).collect();
        s.cache_make_room(0, pairs.len(), reserved, &handles);
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
pub(super) fn admit_prefill(
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
    if s.room(reserved) < total {
        let handles: Vec<Handle> = items.iter().map(|i| i.0).collect();
        s.cache_make_room(0, total, reserved, &handles);
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

/// Check a score and start it: its prefill item, and the first token's score (from the
/// branch's logits). `None` for no tokens (answered at once, with an empty result).
fn admit_score(
    s: &mut ContextState,
    w: &Arc<ScoreWork>,
    reserved: usize,
) -> Result<Option<(Vec<Item>, Scoring)>> {
    let Some(&first) = w.tokens.first() else {
        w.result.set(Vec::new());
        return Ok(None);
    };
    let (items, _) = admit_prefill(s, &[(w.handle, w.tokens.clone())], reserved)?;
    let scored = vec![s.score_first(w.handle, first, w.top)?];
    Ok(Some((items, Scoring { work: Arc::clone(w), scored })))
}
