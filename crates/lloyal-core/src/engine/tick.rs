//! One engine tick on the locked context: admit queued operations (per-operation
//! validation), plan the rows ([`super::plan`]), decode them in as few `llama_decode` calls
//! as `n_batch` allows, and publish each operation's result. A failed packed decode is
//! retried operation by operation, so one bad operation fails only its own caller, with the
//! same all-or-nothing rollback as a direct call.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::gen::{logprobs, Event, Finish, GenItem, GenSpec, GenStream, StopMatcher};
use super::op::{Op, Reply, Work};
use super::pace::Pacer;
use super::plan::plan_tick;
use crate::context::ContextState;
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;
use crate::text::Utf8Stream;

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
    /// When the engine admitted it (the pacer protects only streams older than this).
    arrived: Instant,
}

/// A generation request running on its branch.
struct Gen {
    op: Op,
    spec: GenSpec,
    generated: usize,
    utf8: Utf8Stream,
    stops: StopMatcher,
}

impl Gen {
    /// Cells still reserved for this request's future tokens (0 when unbounded or not reserving).
    fn reserved(&self) -> usize {
        self.spec.reservation(self.generated)
    }
}

/// A generation request waiting for room in the cache (FIFO).
struct Waiting {
    op: Op,
    spec: GenSpec,
    since: Instant,
}

/// A generation request's token this tick, with its logprobs when asked.
struct GenRow {
    row: CommitRow,
    logprobs: Option<(f64, Vec<(i32, f64)>)>,
}

/// A part of a tick: one operation's rows.
enum Part {
    Commit(Op, Vec<CommitRow>),
    /// Index into the running generation requests.
    Gen(usize, GenRow),
    /// Index into the in-flight prefills, with the tokens taken per item this tick.
    Prefill(usize, Vec<usize>),
}

/// What a tick did, for the engine's statistics and replies.
#[derive(Default)]
pub(crate) struct TickOutcome {
    pub decodes: u64,
    /// Seconds spent in `llama_decode`.
    pub decode_secs: f64,
    /// Seconds spent sampling generation requests (produce, logprobs, stop checks).
    pub sample_secs: f64,
    pub rows: u64,
    /// The prefill cap the tick planned with (0: the batch).
    pub prefill_cap: usize,
    /// Operations that decoded rows this tick.
    pub ops: u64,
    /// Commits among them (their callers may come straight back with the next step).
    pub commits: u64,
    /// Prefills answered (their callers often come straight back to fork the new prompt).
    pub prefills_done: u64,
    pub replies: Vec<(Reply, Result<()>)>,
    /// Operations that name a branch an earlier operation is still writing: next tick.
    pub deferred: Vec<Op>,
    /// Tokens and ends for generation streams, delivered after the tick.
    pub events: Vec<(Arc<GenStream>, Event)>,
}

impl TickOutcome {
    fn reply(&mut self, op: Op, result: Result<()>) {
        self.replies.push((op.reply, result));
    }
}

/// The scheduler's state between ticks: prefills in flight, generation requests running.
#[derive(Default)]
pub(crate) struct Scheduler {
    flights: Vec<Flight>,
    gens: Vec<Gen>,
    waiting: VecDeque<Waiting>,
    /// A request just finished its prompt and waits: tick again at once to start it.
    fresh_waiting: bool,
    /// The automatic prefill cap.
    pacer: Pacer,
    /// `create` / `fork` calls waiting for a lease, oldest first.
    lease_waiting: VecDeque<Op>,
    /// Generation requests with a prompt waiting for room for it and their tokens (FIFO).
    prompt_waiting: VecDeque<Waiting>,
    /// Prompt rows of a burst prefilled since the generation requests last stepped.
    burst_rows: usize,
}

impl Scheduler {
    /// Whether a prefill is in flight, a generation request wants a token or was cancelled
    /// (the engine ticks again without new operations).
    pub fn has_work(&self) -> bool {
        !self.flights.is_empty() || self.gens.iter().any(|g| g.op.is_cancelled() || g.spec.stream.is_wanted())
    }

    /// Generation requests that want a token now.
    pub fn ready(&self) -> usize {
        self.gens.iter().filter(|g| g.spec.stream.is_wanted()).count()
    }

    /// Generation requests running.
    pub fn generating(&self) -> usize {
        self.gens.len()
    }

    /// Generation requests waiting for room in the cache (for their prompt or their tokens).
    pub fn waiting(&self) -> usize {
        self.waiting.len() + self.prompt_waiting.len()
    }

    /// `create` / `fork` calls waiting for a lease.
    pub fn lease_waiting(&self) -> usize {
        self.lease_waiting.len()
    }

    /// Grant leases to waiters in arrival order while leases are free; answer the cancelled
    /// and the expired ones. A fork waits while its parent's prefill is in flight.
    fn serve_leases(&mut self, s: &mut ContextState, out: &mut TickOutcome) {
        let now = Instant::now();
        let busy: HashSet<Handle> =
            self.flights.iter().flat_map(|f| f.items.iter().map(|i| i.handle)).collect();
        let mut blocked = false;
        let mut keep = VecDeque::with_capacity(self.lease_waiting.len());
        for op in self.lease_waiting.drain(..) {
            let Work::Lease(w) = &op.work else {
                out.reply(
                    op,
                    Err(LloyalError::Backend("internal error: a non-lease op waited for a lease".into())),
                );
                continue;
            };
            let w = Arc::clone(w);
            if op.is_cancelled() {
                out.reply(op, Err(LloyalError::Interrupted));
            } else if !blocked && s.available() > 0 && !w.parent.is_some_and(|p| busy.contains(&p)) {
                let r = w.grant(s);
                out.reply(op, r);
            } else if w.expired(now) {
                out.reply(
                    op,
                    Err(LloyalError::LeaseWaitTimedOut { n_seq_max: s.lease_count(), waited: w.timeout }),
                );
            } else {
                blocked = true; // first come, first served: later waiters stay behind this one
                keep.push_back(op);
            }
        }
        self.lease_waiting = keep;
    }

    /// Prefills in flight.
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Answer every in-flight operation with `err` (the context is gone; nothing to roll back).
    pub fn fail_all(&mut self, err: &LloyalError) -> Vec<(Reply, Result<()>)> {
        let mut replies: Vec<_> = self.flights.drain(..).map(|f| (f.op.reply, Err(err.clone()))).collect();
        replies.extend(self.gens.drain(..).map(|g| (g.op.reply, Err(err.clone()))));
        replies.extend(self.waiting.drain(..).map(|w| (w.op.reply, Err(err.clone()))));
        replies.extend(self.lease_waiting.drain(..).map(|op| (op.reply, Err(err.clone()))));
        replies.extend(self.prompt_waiting.drain(..).map(|w| (w.op.reply, Err(err.clone()))));
        replies
    }

    /// Run one tick over the queued `ops` (FIFO) and the prefills in flight.
    /// `max_prefill`: the prefill cap (`Some(0)`: the batch; `None`: paced).
    pub fn tick(&mut self, s: &mut ContextState, ops: Vec<Op>, max_prefill: Option<usize>) -> TickOutcome {
        let out = self.run_tick(s, ops, max_prefill);
        // Tell the ledger which branches have prefill cells written ahead of their position.
        let written = self.flights.iter().flat_map(|f| f.items.iter().map(|i| (i.handle, i.done)));
        s.note_in_flight(written.collect());
        out
    }

    fn run_tick(&mut self, s: &mut ContextState, ops: Vec<Op>, max_prefill: Option<usize>) -> TickOutcome {
        let mut out = TickOutcome::default();
        self.fresh_waiting = false;
        self.drop_stale_flights(s, &mut out);
        self.drop_stale_gens(s, &mut out);

        let mut busy: HashSet<Handle> =
            self.flights.iter().flat_map(|f| f.items.iter().map(|i| i.handle)).collect();
        let mut reserved: usize = self.flights.iter().map(|f| f.cells).sum::<usize>()
            + self.gens.iter().map(Gen::reserved).sum::<usize>();
        self.admit_waiting(s, &mut reserved, &mut out);
        self.admit_prompts(s, &mut reserved, &mut busy, &mut out);
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
                        self.flights.push(Flight { op, items, cells, arrived: Instant::now() });
                    }
                },
                Work::Generate(spec) if !spec.prompt.is_empty() => {
                    // Wait (FIFO) for room for the prompt and its tokens, then prefill the
                    // prompt (a flight); the request queues for its tokens when it is written.
                    let spec = (**spec).clone();
                    match self.admit_gen(s, &spec) {
                        Err(e) => out.reply(op, Err(e)),
                        Ok(()) => {
                            self.prompt_waiting.push_back(Waiting { op, spec, since: Instant::now() });
                            self.admit_prompts(s, &mut reserved, &mut busy, &mut out);
                        }
                    }
                }
                Work::Lease(_) => self.lease_waiting.push_back(op),
                Work::Generate(spec) => {
                    let spec = (**spec).clone();
                    match self.admit_gen(s, &spec) {
                        Err(e) => out.reply(op, Err(e)),
                        Ok(()) => {
                            self.waiting.push_back(Waiting { op, spec, since: Instant::now() });
                            self.admit_waiting(s, &mut reserved, &mut out);
                        }
                    }
                }
            }
        }

        self.serve_leases(s, &mut out);

        let n_batch = s.shape().n_batch as usize;
        let oldest = self
            .flights
            .iter()
            .filter(|f| f.items.iter().any(|i| i.done < i.tokens.len()))
            .map(|f| f.arrived)
            .min();
        // While a burst's prompts fill the batch, the generation requests step once per
        // [`BURST_STEP_ROWS`] prompt rows rather than every tick.
        let hold = max_prefill.is_none()
            && self.burst_rows > 0
            && self.burst_rows + n_batch <= BURST_STEP_ROWS
            && oldest.is_some_and(|t| self.pacer.goes_first(t));

        // Generation requests that want a token, oldest first: sample, check stops, admit.
        let mut ended: Vec<(usize, Result<Finish>)> = Vec::new();
        let mut gen_parts: Vec<Part> = Vec::new();
        for (gi, g) in self.gens.iter_mut().enumerate() {
            if hold || busy.contains(&g.spec.handle) || !g.spec.stream.take_wanted() {
                continue;
            }
            // A bounded request's row takes one of the cells it reserved.
            let own = g.reserved();
            let t0 = Instant::now();
            let step = step_gen(s, g, reserved - own);
            out.sample_secs += t0.elapsed().as_secs_f64();
            match step {
                Ok(Step::Row(row)) => {
                    reserved += usize::from(own == 0);
                    busy.insert(g.spec.handle);
                    gen_parts.push(Part::Gen(gi, row));
                }
                Ok(Step::End(finish)) => ended.push((gi, Ok(finish))),
                Err(e) => ended.push((gi, Err(e))),
            }
        }

        // Plan: every commit row, then prefill tokens (FIFO) up to the budget.
        let decode_rows: usize = commits.iter().map(|c| c.1.len()).sum::<usize>() + gen_parts.len();
        out.commits = (commits.len() + gen_parts.len()) as u64;
        let lefts: Vec<usize> =
            self.flights.iter().flat_map(|f| f.items.iter().map(|i| i.tokens.len() - i.done)).collect();
        let cap = match max_prefill {
            Some(cap) => cap,
            None => self.pacer.plan(Instant::now(), decode_rows, oldest, n_batch),
        };
        out.prefill_cap = cap;
        let plan = plan_tick(decode_rows, &lefts, n_batch, cap);
        let prefill_rows: usize = plan.prefill_take.iter().sum();
        let full = if cap == 0 { prefill_rows } else { 0 };
        self.burst_rows = if hold || decode_rows == 0 { self.burst_rows + full } else { full };
        let mut parts: Vec<Part> = commits.into_iter().map(|(op, rows)| Part::Commit(op, rows)).collect();
        parts.extend(gen_parts);
        let mut takes = plan.prefill_take.iter().copied();
        for (fi, f) in self.flights.iter().enumerate() {
            let take: Vec<usize> = f.items.iter().map(|_| takes.next().unwrap_or(0)).collect();
            if take.iter().any(|&t| t > 0) {
                parts.push(Part::Prefill(fi, take));
            }
        }
        if parts.is_empty() {
            self.end_gens(ended, &mut out);
            return out;
        }
        let rows_of: Vec<Vec<Row>> = parts.iter().map(|p| self.rows(p)).collect();
        let all: Vec<Row> = rows_of.iter().flatten().copied().collect();
        out.rows = all.len() as u64;
        out.ops = parts.len() as u64;

        let split = split_point(s.split_mixed_ticks, decode_rows, prefill_rows);
        let (result, decodes) = execute(s, &all, split, &mut out.decode_secs);
        out.decodes += decodes;
        let mut outcomes: Vec<Result<()>> = Vec::with_capacity(parts.len());
        match result {
            Ok(()) => {
                if max_prefill.is_none() {
                    self.pacer.observe(decode_rows, prefill_rows, out.decode_secs);
                    self.pacer.ticked(Instant::now(), decode_rows);
                }
                outcomes.resize(parts.len(), Ok(()));
            }
            Err(e) => {
                for rows in &rows_of {
                    rollback_rows(s, rows);
                }
                if parts.len() == 1 {
                    outcomes.push(Err(e));
                } else {
                    // Isolate the culprit: each operation alone.
                    for rows in &rows_of {
                        let (r, d) = execute(s, rows, None, &mut out.decode_secs);
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
                (Part::Gen(gi, row), Ok(())) => {
                    let g = &mut self.gens[gi];
                    match finish_commit(s, std::slice::from_ref(&row.row)) {
                        Ok(()) => {
                            let t0 = Instant::now();
                            let (item, end) = gen_item(s, g, row);
                            out.sample_secs += t0.elapsed().as_secs_f64();
                            out.events.push((Arc::clone(&g.spec.stream), Event::Item(item)));
                            if let Some(finish) = end {
                                ended.push((gi, Ok(finish)));
                            }
                        }
                        Err(e) => ended.push((gi, Err(e))),
                    }
                }
                (Part::Gen(gi, _), Err(e)) => ended.push((gi, Err(e))),
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
                    match (&f.op.work, r) {
                        (Work::Generate(spec), Ok(())) => {
                            let spec = GenSpec { prompt: Vec::new(), ..(**spec).clone() };
                            self.waiting.push_back(Waiting { op: f.op, spec, since: Instant::now() });
                            self.fresh_waiting = true;
                        }
                        (_, r) => {
                            out.prefills_done += u64::from(r.is_ok());
                            out.reply(f.op, r)
                        }
                    }
                }
                Err(e) => {
                    rollback_flight(s, &f);
                    out.reply(f.op, Err(e));
                }
            }
        }
        self.end_gens(ended, &mut out);
        out
    }

    /// Start waiting generation requests, oldest first, while the cache has room for the
    /// head's reservation (FIFO: a later request never overtakes an earlier one); fail those
    /// whose timeout passed or whose branch went away.
    fn admit_waiting(&mut self, s: &mut ContextState, reserved: &mut usize, out: &mut TickOutcome) {
        let n_ctx = s.shape().n_ctx as usize;
        let mut keep = VecDeque::with_capacity(self.waiting.len());
        let mut blocked = false;
        for w in self.waiting.drain(..) {
            let need = w.spec.cells();
            let err = if w.op.is_cancelled() {
                Some(LloyalError::Interrupted)
            } else if !s.is_live(w.spec.handle) {
                Some(LloyalError::BranchDisposed { handle: w.spec.handle })
            } else {
                None
            };
            if let Some(err) = err {
                out.events.push((Arc::clone(&w.spec.stream), Event::End(Err(err.clone()))));
                out.reply(w.op, Err(err));
                continue;
            }
            let free = n_ctx.saturating_sub(s.ledger.cells_used() + *reserved);
            if !blocked && need <= free {
                *reserved += w.spec.reservation(0);
                let stops = StopMatcher::new(w.spec.stop.clone());
                self.gens.push(Gen { op: w.op, spec: w.spec, generated: 0, utf8: Utf8Stream::new(), stops });
                continue;
            }
            blocked = true;
            if w.spec.timeout.is_some_and(|t| w.since.elapsed() >= t) {
                let err = LloyalError::KvCacheFull {
                    needed: need,
                    n_ctx: n_ctx as u32,
                    detail: format!(
                        "the generation request waited {:.3} s (its timeout) for room: branches hold {} \
                         cells and running requests reserve {} more, {free} free",
                        w.since.elapsed().as_secs_f64(),
                        s.ledger.cells_used(),
                        *reserved
                    ),
                };
                out.events.push((Arc::clone(&w.spec.stream), Event::End(Err(err.clone()))));
                out.reply(w.op, Err(err));
                continue;
            }
            keep.push_back(w);
        }
        self.waiting = keep;
    }

    /// Start the prompts of waiting generation requests, oldest first, while the cache has
    /// room for a prompt and its request's tokens; answer the cancelled, the gone and the
    /// timed out.
    fn admit_prompts(
        &mut self,
        s: &mut ContextState,
        reserved: &mut usize,
        busy: &mut HashSet<Handle>,
        out: &mut TickOutcome,
    ) {
        let n_ctx = s.shape().n_ctx as usize;
        let mut keep = VecDeque::with_capacity(self.prompt_waiting.len());
        let mut blocked = false;
        for w in self.prompt_waiting.drain(..) {
            let fail = |out: &mut TickOutcome, w: Waiting, err: LloyalError| {
                out.events.push((Arc::clone(&w.spec.stream), Event::End(Err(err.clone()))));
                out.reply(w.op, Err(err));
            };
            if w.op.is_cancelled() {
                fail(out, w, LloyalError::Interrupted);
                continue;
            }
            if !s.is_live(w.spec.handle) {
                let handle = w.spec.handle;
                fail(out, w, LloyalError::BranchDisposed { handle });
                continue;
            }
            let need = w.spec.prompt.len() + w.spec.cells();
            let free = n_ctx.saturating_sub(s.ledger.cells_used() + *reserved);
            if !blocked && need <= free && !busy.contains(&w.spec.handle) {
                match admit_prefill(s, &[(w.spec.handle, w.spec.prompt.clone())], *reserved) {
                    Ok((items, cells)) => {
                        *reserved += cells;
                        busy.insert(w.spec.handle);
                        self.flights.push(Flight { op: w.op, items, cells, arrived: Instant::now() });
                    }
                    Err(e) => fail(out, w, e),
                }
                continue;
            }
            blocked = true;
            if w.spec.timeout.is_some_and(|t| w.since.elapsed() >= t) {
                let err = LloyalError::KvCacheFull {
                    needed: need,
                    n_ctx: n_ctx as u32,
                    detail: format!(
                        "the generation request waited {:.3} s (its timeout) for room for its {}-token \
                         prompt and its tokens: branches hold {} cells and running requests reserve {} \
                         more, {free} free",
                        w.since.elapsed().as_secs_f64(),
                        w.spec.prompt.len(),
                        s.ledger.cells_used(),
                        *reserved
                    ),
                };
                fail(out, w, err);
                continue;
            }
            keep.push_back(w);
        }
        self.prompt_waiting = keep;
    }

    /// Validate a new generation request: its branch is live and has logits to sample from,
    /// no other request is generating on it, and its reservation could ever fit the cache.
    fn admit_gen(&self, s: &mut ContextState, spec: &GenSpec) -> Result<()> {
        if spec.prompt.is_empty() {
            s.branch(spec.handle)?.logits()?;
        }
        let n_ctx = s.shape().n_ctx as usize;
        let held = s.branch(spec.handle)?.position.max(0) as usize + spec.prompt.len();
        let could = n_ctx.saturating_sub(held);
        if spec.cells() > could {
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
        let generating = self
            .gens
            .iter()
            .map(|g| g.spec.handle)
            .chain(self.waiting.iter().chain(self.prompt_waiting.iter()).map(|w| w.spec.handle));
        if generating.into_iter().any(|h| h == spec.handle) {
            return Err(LloyalError::invalid(format!(
                "branch {} is already generating (another iterator of it is open); finish or \
                 close that iterator first",
                spec.handle
            )));
        }
        Ok(())
    }

    /// Remove ended generation requests (highest index first) and answer them.
    fn end_gens(&mut self, mut ended: Vec<(usize, Result<Finish>)>, out: &mut TickOutcome) {
        ended.sort_by_key(|e| std::cmp::Reverse(e.0));
        for (gi, result) in ended {
            let g = self.gens.remove(gi);
            out.events.push((Arc::clone(&g.spec.stream), Event::End(result.clone())));
            out.reply(g.op, result.map(|_| ()));
        }
    }

    /// End generation requests that were cancelled or whose branch was disposed meanwhile
    /// (the branch stays at its last committed token).
    fn drop_stale_gens(&mut self, s: &mut ContextState, out: &mut TickOutcome) {
        let mut keep = Vec::with_capacity(self.gens.len());
        for g in self.gens.drain(..) {
            let err = if g.op.is_cancelled() {
                LloyalError::Interrupted
            } else if !s.is_live(g.spec.handle) {
                LloyalError::BranchDisposed { handle: g.spec.handle }
            } else {
                keep.push(g);
                continue;
            };
            out.events.push((Arc::clone(&g.spec.stream), Event::End(Err(err.clone()))));
            out.reply(g.op, Err(err));
        }
        self.gens = keep;
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
            Part::Gen(_, g) => {
                let r = &g.row;
                vec![Row { token: r.token, pos: r.pos, seq: r.seq, handle: r.handle, logits: true }]
            }
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

/// What a generation request does this tick.
enum Step {
    Row(GenRow),
    End(Finish),
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
    let mut rows = admit_commit(s, &[(h, token)], reserved)?;
    let row = rows.pop().ok_or_else(|| LloyalError::Backend("a commit admitted no row".into()))?;
    let logprobs = if g.spec.logprobs || g.spec.top_logprobs > 0 {
        let b = s.branch(h)?;
        Some(logprobs(b.logits()?, b.logits.stats().lse, token, g.spec.top_logprobs))
    } else {
        None
    };
    Ok(Step::Row(GenRow { row, logprobs }))
}

/// The item for a committed generation token, and the request's end if it ends with it.
/// Peeks at the next token (a cached `produce`, reused by the next step) so text held back
/// for a stop string is released with the last token.
fn gen_item(s: &mut ContextState, g: &mut Gen, row: GenRow) -> (GenItem, Option<Finish>) {
    let token = row.row.token;
    g.generated += 1;
    let bytes = s.model().token_bytes(token, false).unwrap_or_default();
    let piece = g.utf8.push(&bytes);
    let (mut text, matched) = g.stops.push(&piece);
    let end = if matched {
        Some(Finish::Stop)
    } else if g.spec.max_tokens.is_some_and(|m| g.generated >= m) {
        Some(Finish::Length)
    } else {
        None
    };
    let last = end.is_some()
        || s.branch_produce(g.spec.handle)
            .is_ok_and(|t| s.model().is_eog(t) || g.spec.stop_tokens.contains(&t));
    let mut end = end;
    if last && !matched {
        let (tail, matched) = g.stops.push(&g.utf8.flush());
        text.push_str(&tail);
        if matched {
            end = Some(Finish::Stop);
        } else {
            text.push_str(&g.stops.flush());
        }
    }
    let (logprob, top_logprobs) = match row.logprobs {
        Some((lp, top)) => (g.spec.logprobs.then_some(lp), (g.spec.top_logprobs > 0).then_some(top)),
        None => (None, None),
    };
    (GenItem { token, text, logprob, top_logprobs }, end)
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

/// Prompt rows a burst prefills between two steps of the running generation requests.
/// Requests that arrive together (a burst) prefill at a full `n_batch` per tick; the ones
/// whose prompts are written meanwhile start generating. Stepping them every tick put a
/// separate `llama_decode` of their rows next to every 512-row prefill (decoded apart, see
/// [`split_point`]): 16 distinct prompts of ~270 tokens ran 8 such calls, ~450 ms for 65
/// tokens, most of which the wave's tail would have decoded at ~3.5 ms a token. Like
/// llama-server (one step per 2048-token batch), they step once per 2048 prompt rows.
const BURST_STEP_ROWS: usize = 2048;

/// Rows of one flash-attention query tile in ggml's CPU kernel (`GGML_FA_TILE_Q`).
const FA_QUERY_TILE: usize = 64;

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
fn split_point(split: bool, decode_rows: usize, prefill_rows: usize) -> Option<usize> {
    let mixed = decode_rows >= 2 && prefill_rows > 0 && decode_rows + prefill_rows >= FA_QUERY_TILE;
    (split && mixed).then_some(decode_rows)
}

/// Decode `rows` in calls of at most `n_batch` rows, a call ending at row `split` too,
/// copying each logits row into its branch's `next_logits`. Returns the result and the
/// number of `llama_decode` calls made.
fn execute(s: &mut ContextState, rows: &[Row], split: Option<usize>, secs: &mut f64) -> (Result<()>, u64) {
    let n_batch = s.shape().n_batch as usize;
    let mut decodes = 0;
    let (head, tail) = rows.split_at(split.unwrap_or(0).min(rows.len()));
    for chunk in head.chunks(n_batch.max(1)).chain(tail.chunks(n_batch.max(1))) {
        s.batch_mut().clear();
        for r in chunk {
            s.batch_mut().push(r.token, r.pos, r.seq, r.logits);
        }
        decodes += 1;
        let t0 = Instant::now();
        let ran = s.run_batch();
        *secs += t0.elapsed().as_secs_f64();
        let result = ran.and_then(|()| {
            let rows: Vec<(i32, Handle)> = chunk
                .iter()
                .enumerate()
                .filter(|(_, r)| r.logits)
                .map(|(i, r)| (i as i32, r.handle))
                .collect();
            s.fill_next_logits_rows(&rows)
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
