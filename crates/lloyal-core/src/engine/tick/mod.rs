//! One engine tick on the locked context, in four phases:
//!
//! 1. **schedule** ([`admit`], [`step`]): answer what went stale, admit queued operations
//!    (each validated on its own), start waiting requests that now fit, grant leases, and
//!    sample the running generation requests' next tokens;
//! 2. **plan**: the prefill tokens of the operations in flight that fill the tick next to its
//!    commit rows ([`super::plan`]);
//! 3. **execute** ([`execute`]): decode the rows in as few `llama_decode` calls as `n_batch`
//!    allows; a failed packed decode is rolled back and retried operation by operation, so
//!    one bad operation fails only its own caller;
//! 4. **update** ([`update`]): publish each operation's result.
//!
//! Every decode-bearing operation runs here: commits, prefills (a reseed is one, with its
//! way back), generation requests, and verifies ([`verify`]: drafts one tick, bonus the next).

mod admit;
mod execute;
mod step;
mod update;
mod verify;

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::burst::BurstWait;
use super::gen::{Event, Finish, GenSpec, GenStream, StopMatcher};
use super::op::{Op, Reply};
use super::pace::Pacer;
use super::plan::plan_tick;
use crate::branch::reseed::Reseeding;
use crate::branch::score::{ScoreWork, Scored, SCORE_ROWS_PER_TICK};
use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;
use crate::text::Utf8Stream;
use step::GenRow;
use verify::{Bonus, Verifying};

/// A committing branch's row, with the surprisals taken from the logits it was sampled from.
struct CommitRow {
    handle: Handle,
    token: i32,
    seq: i32,
    pos: i32,
    surprisals: Option<(f64, Option<f64>)>,
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
    /// A reseed's way back, settled when the flight ends.
    reseed: Option<Reseeding>,
    /// A score's result so far: every row scores the token after it.
    scoring: Option<Scoring>,
}

/// A `Branch.score` in flight: the scores of its tokens so far, in order.
struct Scoring {
    work: Arc<ScoreWork>,
    scored: Vec<Scored>,
}

/// How far a generation request got through its tokens: the items made, and the text held
/// back (an incomplete character, the start of a stop string).
struct Progress {
    generated: usize,
    utf8: Utf8Stream,
    stops: StopMatcher,
}

impl Progress {
    fn new(spec: &GenSpec) -> Self {
        Progress {
            generated: 0,
            utf8: Utf8Stream::new(),
            stops: StopMatcher::new(spec.stop.clone(), spec.include_stop),
        }
    }

    /// Whether text is held back for the next token.
    fn holds(&self) -> bool {
        !self.utf8.pending().is_empty() || self.stops.holds()
    }
}

/// A generation request running on its branch.
struct Gen {
    op: Op,
    spec: GenSpec,
    p: Progress,
    /// The token its next commit decodes was yielded already (the first one, as its prompt's
    /// tick ended: [`step::publish_first`]).
    ahead: bool,
    /// Tokens committed on its branch.
    committed: usize,
}

impl Gen {
    fn start(w: Waiting) -> Self {
        let ahead = w.first.is_some();
        let p = w.first.unwrap_or_else(|| Progress::new(&w.spec));
        Gen { op: w.op, spec: w.spec, p, ahead, committed: 0 }
    }

    /// Whether the token being committed now is its last by `max_tokens` (one yielded ahead
    /// never is: it would have ended the request as it went out).
    fn ends_by_length_next(&self) -> bool {
        !self.ahead && self.spec.max_tokens.is_some_and(|m| self.p.generated + 1 >= m)
    }

    /// Cells still reserved for this request's future tokens (0 when unbounded or not reserving).
    fn reserved(&self) -> usize {
        self.spec.reservation(self.p.generated)
    }
}

/// A generation request waiting for room in the cache (FIFO).
struct Waiting {
    op: Op,
    spec: GenSpec,
    since: Instant,
    /// Its first token went out as its prompt's tick ended (not committed yet).
    first: Option<Progress>,
}

impl Waiting {
    fn new(op: Op, spec: GenSpec) -> Self {
        Waiting { op, spec, since: Instant::now(), first: None }
    }
}

/// A part of a tick: one operation's rows.
enum Part {
    Commit(Op, Vec<CommitRow>),
    /// Index into the running generation requests.
    Gen(usize, GenRow),
    /// Index into the in-flight prefills, with the tokens taken per item this tick.
    Prefill(usize, Vec<usize>),
    /// A verify's drafts, each row's logits kept.
    Verify(Op, Verifying),
    /// A verify's bonus, walked last tick.
    Bonus(Op, Box<Bonus>, Vec<CommitRow>),
}

impl Part {
    /// The branches a commit or generation part steps (none for a prefill), each with whether
    /// a generation request steps it.
    fn streams(&self) -> Vec<(Handle, bool)> {
        match self {
            Part::Commit(_, rows) | Part::Bonus(_, _, rows) => {
                rows.iter().map(|r| (r.handle, false)).collect()
            }
            Part::Gen(_, g) => vec![(g.row.handle, true)],
            Part::Verify(_, v) => vec![(v.work.handle, false)],
            Part::Prefill(..) => Vec::new(),
        }
    }

    /// Rows the part decodes.
    fn row_count(&self) -> usize {
        match self {
            Part::Commit(_, rows) | Part::Bonus(_, _, rows) => rows.len(),
            Part::Gen(..) => 1,
            Part::Verify(_, v) => v.work.drafts.len(),
            Part::Prefill(_, take) => take.iter().sum(),
        }
    }
}

/// What a tick did, for the engine's statistics and replies.
#[derive(Default)]
pub(crate) struct TickOutcome {
    pub decodes: u64,
    /// Seconds spent in `llama_decode`.
    pub decode_secs: f64,
    /// Seconds spent sampling: generation requests (produce, logprobs, stop checks) and the
    /// next tokens of committed branches that sample.
    pub sample_secs: f64,
    pub rows: u64,
    /// The prefill cap the tick planned with (0: the batch).
    pub prefill_cap: usize,
    /// Operations that decoded rows this tick.
    pub ops: u64,
    /// Commits among them (their callers may come straight back with the next step).
    pub commits: u64,
    /// The branches of the prefills answered (their callers often come straight back to fork
    /// the new prompt).
    pub prefilled: Vec<Handle>,
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

    /// End a generation stream with `result` and answer its request.
    fn end_stream(&mut self, op: Op, stream: &Arc<GenStream>, result: Result<Finish>) {
        self.events.push((Arc::clone(stream), Event::End(result.clone())));
        self.reply(op, result.map(|_| ()));
    }
}

/// What one tick has taken so far: the branches it writes and the cells it reserved.
struct Budget {
    busy: HashSet<Handle>,
    reserved: usize,
}

/// The schedule phase's result: the commit and generation parts that decode this tick (in
/// that order) and the generation requests that ended without a row.
struct Scheduled {
    parts: Vec<Part>,
    ended: Vec<(usize, Result<Finish>)>,
    /// The generation requests hold still while a burst's prompts fill the batch.
    hold: bool,
    /// When the oldest prefill with tokens left arrived.
    oldest: Option<Instant>,
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
    /// The branches the last tick with decode rows stepped (the streams the pacer protects),
    /// each with whether a generation request stepped it.
    last_streams: Vec<(Handle, bool)>,
    /// Verifies walked last tick whose bonus commits next.
    bonuses: Vec<(Op, Bonus)>,
    /// How long an idle engine waits for the rest of a burst ([`super::burst`]).
    pub(in crate::engine) burst: BurstWait,
}

/// Prompt rows a burst prefills between two steps of the running generation requests.
/// Requests that arrive together (a burst) prefill at a full `n_batch` per tick; the ones
/// whose prompts are written meanwhile start generating. Stepping them every tick put a
/// separate `llama_decode` of their rows next to every 512-row prefill (decoded apart, see
/// [`execute::split_point`]): 16 distinct prompts of ~270 tokens ran 8 such calls, ~450 ms
/// for 65 tokens, most of which the wave's tail would have decoded at ~3.5 ms a token. Like
/// llama-server (one step per 2048-token batch), they step once per 2048 prompt rows.
const BURST_STEP_ROWS: usize = 2048;

impl Scheduler {
    /// Whether a prefill is in flight, a generation request wants a token or was cancelled
    /// (the engine ticks again without new operations).
    pub fn has_work(&self) -> bool {
        !self.flights.is_empty()
            || !self.bonuses.is_empty()
            || self.gens.iter().any(|g| g.op.is_cancelled() || g.spec.stream.is_wanted())
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

    /// Prefills in flight.
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Answer every in-flight operation with `err` (the context is gone; nothing to roll back).
    pub fn fail_all(&mut self, err: &LloyalError) -> Vec<(Reply, Result<()>)> {
        let mut replies: Vec<_> = self.flights.drain(..).map(|f| (f.op.reply, Err(err.clone()))).collect();
        replies.extend(self.end_generations(err));
        replies.extend(self.lease_waiting.drain(..).map(|op| (op.reply, Err(err.clone()))));
        replies.extend(self.bonuses.drain(..).map(|(op, _)| (op.reply, Err(err.clone()))));
        replies
    }

    /// End every generation request, running or waiting, with `err` (for a closing context:
    /// a request may run for as long as the cache lasts, where `close()` waits for the other
    /// operations it was given). Prefills in flight go on.
    pub fn end_generations(&mut self, err: &LloyalError) -> Vec<(Reply, Result<()>)> {
        let mut replies: Vec<_> = self.gens.drain(..).map(|g| (g.op.reply, Err(err.clone()))).collect();
        replies.extend(self.waiting.drain(..).map(|w| (w.op.reply, Err(err.clone()))));
        replies.extend(self.prompt_waiting.drain(..).map(|w| (w.op.reply, Err(err.clone()))));
        replies
    }

    /// Run one tick over the queued `ops` (FIFO) and the prefills in flight.
    /// `max_prefill`: the prefill cap (`Some(0)`: the batch; `None`: paced).
    pub fn tick(&mut self, s: &mut ContextState, ops: Vec<Op>, max_prefill: Option<usize>) -> TickOutcome {
        let mut out = TickOutcome::default();
        s.note_flat_cells(); // flat-path calls since the last tick may have written cells
        let mut sched = self.schedule(s, ops, max_prefill, &mut out);
        let decode_rows: usize = sched.parts.iter().map(Part::row_count).sum();
        let prefill_rows = self.plan(s, &mut sched, decode_rows, max_prefill, &mut out);
        if !sched.parts.is_empty() {
            let (outcomes, copies) =
                self.execute(s, &sched.parts, (decode_rows, prefill_rows), max_prefill, &mut out);
            self.update(s, sched.parts, (outcomes, copies), &mut sched.ended, &mut out);
        }
        self.end_gens(s, sched.ended, &mut out);
        self.note_flights(s);
        // Released branches swept, the prefix cache kept within its budget.
        s.cache_tidy();
        out
    }

    /// Roll back the prefills in flight and end the generation requests that were cancelled
    /// (or whose branch went) since the last tick, as the next tick would first.
    pub fn settle(&mut self, s: &mut ContextState) -> TickOutcome {
        let mut out = TickOutcome::default();
        self.drop_stale(s, &mut out);
        self.note_flights(s);
        out
    }

    /// Roll back the cancelled prefills in flight and end the cancelled generation requests (or
    /// those whose branch went).
    fn drop_stale(&mut self, s: &mut ContextState, out: &mut TickOutcome) {
        self.drop_stale_flights(s, out);
        self.drop_stale_gens(s, out);
    }

    /// Tell the ledger which branches have prefill cells written ahead of their position, and
    /// the prefix cache which branches the engine's requests use.
    fn note_flights(&self, s: &mut ContextState) {
        let written = self.flights.iter().flat_map(|f| f.items.iter().map(|i| (i.handle, i.done)));
        s.ledger.note_in_flight(written.collect());
        self.note_in_engine(s);
    }

    /// Tell the prefix cache which branches the engine's requests use (generating, prefilling,
    /// waiting): it never evicts them, also between ticks.
    fn note_in_engine(&self, s: &mut ContextState) {
        let gens = self.gens.iter().map(|g| g.spec.handle);
        let waiting = self.waiting.iter().chain(&self.prompt_waiting).map(|w| w.spec.handle);
        let flights = self.flights.iter().flat_map(|f| f.items.iter().map(|i| i.handle));
        s.cache_keep(gens.chain(waiting).chain(flights).collect());
    }

    /// Phase 1: admit what can run and sample the generation requests' rows.
    fn schedule(
        &mut self,
        s: &mut ContextState,
        ops: Vec<Op>,
        max_prefill: Option<usize>,
        out: &mut TickOutcome,
    ) -> Scheduled {
        self.fresh_waiting = false;
        self.drop_stale(s, out);
        self.note_in_engine(s);
        let mut budget = Budget {
            busy: self.flights.iter().flat_map(|f| f.items.iter().map(|i| i.handle)).collect(),
            reserved: self.flights.iter().map(|f| f.cells).sum::<usize>()
                + self.gens.iter().map(Gen::reserved).sum::<usize>(),
        };
        let mut parts = self.admit_bonuses(s, &mut budget, out);
        self.admit_waiting(s, &mut budget, out);
        self.admit_prompts(s, &mut budget, out);
        parts.extend(ops.into_iter().filter_map(|op| self.admit_op(s, op, &mut budget, out)));
        self.serve_leases(s, out);

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
            && self.burst_rows + s.shape().n_batch as usize <= BURST_STEP_ROWS
            && oldest.is_some_and(|t| self.pacer.goes_first(t));
        let mut ended = Vec::new();
        if !hold {
            self.step_gens(s, &mut budget, &mut parts, &mut ended, out);
        }
        Scheduled { parts, ended, hold, oldest }
    }

    /// Whether a branch that the last decode rows stepped may step again in a moment: one that
    /// commits by hand while it lives (its next commit is usually milliseconds away), one that
    /// a generation request stepped only while the request runs (a finished request's branch,
    /// kept by a prefix cache, say, is not a stream: the next prompt need not wait for it).
    fn comes_back(&self, s: &ContextState, handle: Handle, gen: bool) -> bool {
        if gen {
            self.gens.iter().any(|g| g.spec.handle == handle)
        } else {
            s.is_live(handle)
        }
    }

    /// Phase 2: every commit row, then prefill tokens (FIFO) up to the budget; adds the
    /// prefill parts and returns their row count.
    fn plan(
        &mut self,
        s: &ContextState,
        sched: &mut Scheduled,
        decode_rows: usize,
        max_prefill: Option<usize>,
        out: &mut TickOutcome,
    ) -> usize {
        let n_batch = s.shape().n_batch as usize;
        out.commits = sched.parts.len() as u64;
        // A score's rows keep their logits: a few a tick (llama.cpp's output buffer holds them).
        let cap_of = |f: &Flight| if f.scoring.is_some() { SCORE_ROWS_PER_TICK } else { usize::MAX };
        let lefts: Vec<usize> = self
            .flights
            .iter()
            .flat_map(|f| f.items.iter().map(move |i| (i.tokens.len() - i.done).min(cap_of(f))))
            .collect();
        let cap = match max_prefill {
            Some(cap) => cap,
            None => {
                if decode_rows > 0 {
                    self.last_streams = sched.parts.iter().flat_map(Part::streams).collect();
                } else if !self.last_streams.iter().any(|&(h, gen)| self.comes_back(s, h, gen)) {
                    self.pacer.streams_gone();
                }
                self.pacer.plan(Instant::now(), decode_rows, sched.oldest, n_batch)
            }
        };
        out.prefill_cap = cap;
        let plan = plan_tick(decode_rows, &lefts, n_batch, cap);
        let prefill_rows: usize = plan.prefill_take.iter().sum();
        let full = if cap == 0 { prefill_rows } else { 0 };
        self.burst_rows = if sched.hold || decode_rows == 0 { self.burst_rows + full } else { full };
        let mut takes = plan.prefill_take.iter().copied();
        for (fi, f) in self.flights.iter().enumerate() {
            let take: Vec<usize> = f.items.iter().map(|_| takes.next().unwrap_or(0)).collect();
            if take.iter().any(|&t| t > 0) {
                sched.parts.push(Part::Prefill(fi, take));
            }
        }
        prefill_rows
    }
}
