//! The engine: one scheduler thread per context that owns its decode loop, so independent
//! callers (threads, asyncio tasks) share one `llama_decode` per step.
//!
//! Every decode-bearing operation (`Branch.commit/prefill`, `BranchStore.commit/prefill` and
//! their `a*` forms) is submitted to the context's queue ([`op`]); each tick takes everything
//! pending, validates each operation on its own, and packs all of them into
//! `ceil(rows / n_batch)` decodes ([`plan`], [`tick`]): commit rows first, prefill chunks
//! after. Each caller gets its own result through a one-shot callback.

pub mod apply;
pub mod burst;
pub mod gen;
pub mod lease;
pub mod op;
pub mod pace;
pub mod plan;
pub mod spin;
pub mod tick;

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

pub use op::{Done, Reply, Waiter, Work};

use crate::context::state::{ContextState, InterruptCheck};
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;
use op::Op;
use tick::{Scheduler, TickOutcome};

/// How often the engine looks for room while generation requests wait for it.
const WAIT_POLL: Duration = Duration::from_millis(5);

/// How long an engine idles before it hands its decode threads back ([`crate::omp::release_pool`]):
/// an idle context's OpenMP pool would otherwise slow every other context's decodes (libgomp
/// throttles when its pools hold more threads than the CPUs). Starting them again costs its
/// next decode ~0.1 ms.
const POOL_IDLE: Duration = Duration::from_millis(100);

/// What the engine ticks on: a context's state behind its lock ([`crate::context::Context`]).
pub trait Host: Send + Sync + 'static {
    /// Run `f` on the open state under the lock (`interrupt` asked between its decodes), then
    /// release the lock; `ContextClosed` once closed.
    fn locked<T>(
        &self,
        interrupt: Option<InterruptCheck>,
        f: impl FnOnce(&mut ContextState) -> Result<T>,
    ) -> Result<T>;
}

/// Counters of a context's engine.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Ticks run (each one pass over the queue).
    pub ticks: u64,
    /// `llama_decode` calls made by the engine.
    pub decode_calls: u64,
    /// Rows (tokens) decoded.
    pub rows: u64,
    /// Operations submitted.
    pub ops_submitted: u64,
    /// Operations answered with success.
    pub ops_completed: u64,
    /// Operations answered with an error (validation, decode, cancellation, close).
    pub ops_failed: u64,
    /// Operations whose rows shared a tick with another operation's.
    pub ops_coalesced: u64,
    /// The most operations one tick decoded together.
    pub max_ops_per_tick: u64,
    /// Operations waiting for the next tick.
    pub queue_depth: usize,
    /// Prefills in flight across ticks.
    pub in_flight: usize,
    /// Generation requests running (`Branch.generate`).
    pub generating: usize,
    /// Generation requests waiting (FIFO) for room in the cache.
    pub waiting: usize,
    /// `Branch.create` / `fork` calls waiting (FIFO) for a lease.
    pub lease_waiting: usize,
    /// Seconds spent in ticks that decoded something (validation, packing, decode, sampling,
    /// publishing and waking callers).
    pub tick_seconds: f64,
    /// Seconds of those spent in `llama_decode`.
    pub decode_seconds: f64,
    /// Seconds of those spent sampling generation requests and drawing ahead for committed
    /// branches that sample.
    pub sample_seconds: f64,
    /// The prefill cap of the last tick (0: the batch; with the paced default, what the
    /// pacer allowed next to the running streams).
    pub prefill_cap: usize,
    /// Whether the engine is paused.
    pub paused: bool,
    /// Seconds a tick waits for as many commits as the previous tick decoded.
    pub gather: f64,
    /// Times an idle engine given a prompt waited for the rest of a burst ([`burst`]).
    pub burst_waits: u64,
    /// Seconds spent in those waits.
    pub burst_wait_seconds: f64,
    /// Times the engine, run dry, moved the KV cache's cells back to its front
    /// ([`crate::state::compact`]).
    pub kv_compactions: u64,
}

struct Queue {
    ops: VecDeque<Op>,
    /// Context calls queued while a tick ran ([`apply`]).
    applies: VecDeque<apply::Apply>,
    /// A tick (or the queued calls) runs: a context call queues rather than take its turn.
    ticking: bool,
    /// An operation was cancelled after it started (an in-flight prefill, a generation): the
    /// engine settles it ([`Taken::Settle`]) before any context call takes its turn, so no call
    /// sees a prefill's cells written ahead of its branch's position.
    stale: bool,
    /// Context calls taking their turn on their own threads now.
    inline: usize,
    /// Context calls that took their turn on their own threads so far.
    inline_runs: u64,
    /// The engine waits for those calls to end before its next tick ([`apply`]).
    lingering: bool,
    /// The engine's thread, once started.
    engine_thread: Option<std::thread::ThreadId>,
    next_id: u64,
    paused: bool,
    /// `close()` began: no new operations; the engine finishes what it has, then stops.
    closing: bool,
    shutdown: bool,
    started: bool,
    /// The engine thread ended (after a shutdown): no decode of this engine is running.
    exited: bool,
    /// No tick running and no prefill in flight.
    idle: bool,
    /// Commits the previous tick decoded (the gather window waits for as many).
    last_tick_ops: usize,
    /// The branches of the prefills the previous tick answered (the gather window then runs its
    /// full length, unless an operation on one of them arrives: their caller is back).
    last_prefilled: Vec<Handle>,
    /// Most prefill tokens per tick (0: fill the tick's batch; None: paced, [`pace`]).
    prefill_chunk: Option<usize>,
    /// Look whether the KV cache is worth compacting once nothing else is left to do: set
    /// by a context call (a tick included) that left the cells in use sparse.
    compact_check: bool,
    stats: EngineStats,
}

impl Queue {
    /// Whether the caller is the engine's own thread.
    fn on_engine_thread(&self) -> bool {
        self.engine_thread == Some(std::thread::current().id())
    }
}

struct Shared {
    queue: Mutex<Queue>,
    cv: Condvar,
    /// Bumped by every change the engine waits for ([`Shared::wake`]): a spinning engine
    /// watches it.
    kicks: std::sync::atomic::AtomicU64,
    /// How long the engine thread and its sync callers spin before they sleep ([`spin`]), in
    /// microseconds.
    spin_us: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tell whoever waits on the engine's state that it changed: the sleepers on `cv` and a
    /// spinning engine thread (`kicks`).
    fn wake(&self) {
        self.kicks.fetch_add(1, Ordering::Release);
        self.cv.notify_all();
    }

    /// How long the engine thread and its sync callers spin before they sleep ([`spin`]).
    fn spin(&self) -> Duration {
        Duration::from_micros(self.spin_us.load(Ordering::Relaxed))
    }
}

/// A submitted operation: cancel it while it waits or runs.
pub struct Ticket {
    id: u64,
    cancelled: Arc<AtomicBool>,
    shared: Weak<Shared>,
}

impl Ticket {
    /// Cancel the operation: removed from the queue (answered with `Interrupted`) if it has
    /// not started; an in-flight prefill is rolled back at the next tick; a finished one is
    /// left as it is.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        let Some(shared) = self.shared.upgrade() else { return };
        let removed = {
            let mut q = shared.lock();
            let at = q.ops.iter().position(|op| op.id == self.id);
            let op = at.and_then(|i| q.ops.remove(i));
            if op.is_some() {
                q.stats.ops_failed += 1;
                q.stats.queue_depth = q.ops.len();
            } else {
                q.stale = true; // started (or done): the engine settles it before any call
            }
            // A running generation request is dropped at the next tick: wake the engine.
            shared.wake();
            op
        };
        // Answer outside the lock: the callback may wait for the GIL.
        if let Some(op) = removed {
            op.reply.send(Err(LloyalError::Interrupted));
        }
    }
}

/// The engine of one context (its thread starts on the first submission).
pub struct Engine {
    shared: Arc<Shared>,
}

impl Default for Engine {
    fn default() -> Self {
        Engine {
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue {
                    ops: VecDeque::new(),
                    applies: VecDeque::new(),
                    ticking: false,
                    stale: false,
                    inline: 0,
                    inline_runs: 0,
                    lingering: false,
                    engine_thread: None,
                    next_id: 0,
                    paused: false,
                    closing: false,
                    shutdown: false,
                    started: false,
                    exited: false,
                    idle: true,
                    last_tick_ops: 0,
                    last_prefilled: Vec::new(),
                    prefill_chunk: None,
                    compact_check: false,
                    stats: EngineStats { gather: 0.002, ..EngineStats::default() },
                }),
                cv: Condvar::new(),
                kicks: std::sync::atomic::AtomicU64::new(0),
                spin_us: std::sync::atomic::AtomicU64::new(0),
            }),
        }
    }
}

/// The engines whose thread started, for [`quiesce_all`].
static STARTED: std::sync::Mutex<Vec<std::sync::Weak<Shared>>> = std::sync::Mutex::new(Vec::new());

/// Start the engine thread of `ctx` unless it runs.
fn start_thread<H: Host>(q: &mut Queue, ctx: &Arc<H>, shared: &Arc<Shared>) -> Result<()> {
    if !q.started {
        let (weak, thread_shared) = (Arc::downgrade(ctx), Arc::clone(shared));
        std::thread::Builder::new()
            .name("lloyal-engine".into())
            .spawn(move || engine_loop(weak, thread_shared))
            .map_err(|e| {
                LloyalError::Backend(format!("cannot start the engine thread: {e}; free some threads"))
            })?;
        q.started = true;
        let mut started = STARTED.lock().unwrap_or_else(|p| p.into_inner());
        started.retain(|w| w.strong_count() > 0);
        started.push(Arc::downgrade(shared));
    }
    Ok(())
}

/// Shut every running engine down (what they hold fails with `ContextClosed`) and wait, up to
/// `wait` in all, for their threads to end: for the process's exit, which must not find an
/// engine thread inside `llama_decode` while it tears the process down (a segfault in
/// ggml's CPU backend, seen when an asyncio program exited with a cancelled prefill still
/// decoding). Later calls on those contexts raise `ContextClosedError`.
pub fn quiesce_all(wait: Duration) {
    let engines: Vec<Arc<Shared>> = {
        let started = STARTED.lock().unwrap_or_else(|p| p.into_inner());
        started.iter().filter_map(std::sync::Weak::upgrade).collect()
    };
    let deadline = Instant::now() + wait;
    for shared in engines {
        let mut q = shared.lock();
        q.shutdown = true;
        shared.wake();
        while q.started && !q.exited {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            q = shared.cv.wait_timeout(q, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// Marks the engine thread's end (however it ends) for [`quiesce_all`].
struct Exited(Arc<Shared>);

impl Drop for Exited {
    fn drop(&mut self) {
        self.0.lock().exited = true;
        self.0.wake();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Engine {
    /// Queue `work` for `ctx`; `done` receives its result on the engine thread.
    pub(crate) fn submit<H: Host>(&self, ctx: &Arc<H>, work: Work, done: Done) -> Result<Ticket> {
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut q = self.shared.lock();
        if q.shutdown || q.closing {
            return Err(LloyalError::ContextClosed);
        }
        start_thread(&mut q, ctx, &self.shared)?;
        let id = q.next_id;
        q.next_id += 1;
        let queued = Instant::now();
        q.ops.push_back(Op { id, work, reply: Reply::new(done), cancelled: Arc::clone(&cancelled), queued });
        q.stats.ops_submitted += 1;
        q.stats.queue_depth = q.ops.len();
        self.shared.wake();
        Ok(Ticket { id, cancelled, shared: Arc::downgrade(&self.shared) })
    }

    /// Whether the caller is this engine's thread.
    pub(crate) fn is_engine_thread(&self) -> bool {
        self.shared.lock().on_engine_thread()
    }

    /// Start the engine thread of `ctx` (for a call queued with [`Engine::call`]).
    pub(crate) fn start<H: Host>(&self, ctx: &Arc<H>) -> Result<()> {
        let mut q = self.shared.lock();
        if q.shutdown || q.closing {
            return Err(LloyalError::ContextClosed);
        }
        start_thread(&mut q, ctx, &self.shared)
    }

    /// Ask the engine to compact the KV cache once it has nothing else to do (it looks again
    /// then). An engine that has not started has decoded nothing to compact.
    pub(crate) fn check_compaction(&self) {
        let mut q = self.shared.lock();
        if q.started {
            q.compact_check = true;
            self.shared.wake();
        }
    }

    /// Wake the engine thread (a generation stream asked for a token).
    pub(crate) fn notify(&self) {
        let _q = self.shared.lock();
        self.shared.wake();
    }

    /// Let the engine thread, after a tick, and its sync callers spin up to `budget` before
    /// they sleep ([`spin`]).
    pub fn set_spin(&self, budget: Duration) {
        let us = u64::try_from(budget.as_micros()).unwrap_or(u64::MAX);
        self.shared.spin_us.store(us, Ordering::Relaxed);
    }

    /// How long this engine's waiters spin before they sleep ([`spin`]).
    pub fn spin(&self) -> Duration {
        self.shared.spin()
    }

    /// Current counters.
    pub fn stats(&self) -> EngineStats {
        self.shared.lock().stats
    }

    /// Stop ticking (queued operations wait) until [`Engine::resume`].
    pub fn pause(&self) {
        let mut q = self.shared.lock();
        q.paused = true;
        q.stats.paused = true;
    }

    /// Tick again.
    pub fn resume(&self) {
        let mut q = self.shared.lock();
        q.paused = false;
        q.stats.paused = false;
        self.shared.wake();
    }

    /// Set the gather window (seconds, `0 <= gather <= 1`).
    pub fn set_gather(&self, seconds: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&seconds) {
            return Err(LloyalError::invalid(format!(
                "engine_gather must be between 0 and 1 second, got {seconds}"
            )));
        }
        self.shared.lock().stats.gather = seconds;
        Ok(())
    }

    /// Cap the prefill tokens of one tick: `Some(0)` fills the tick's batch, `Some(n)` caps
    /// at `n`, `None` (the default) paces them so running streams slow by at most about
    /// [`pace::STRETCH`] times ([`pace`]).
    pub fn set_prefill_chunk(&self, tokens: Option<usize>) {
        self.shared.lock().prefill_chunk = tokens;
    }

    /// The prefill cap of one tick (`Some(0)`: none; `None`: paced).
    pub fn prefill_chunk(&self) -> Option<usize> {
        self.shared.lock().prefill_chunk
    }

    /// Refuse new operations and wait until the ones already submitted are answered (a
    /// paused engine's queue is not waited for: it fails with `ContextClosed`), then stop.
    pub(crate) fn close(&self) {
        let mut q = self.shared.lock();
        q.closing = true;
        let dry = |q: &Queue| {
            !q.started || q.shutdown || (q.applies.is_empty() && (q.paused || (q.idle && q.ops.is_empty())))
        };
        while !dry(&q) {
            q = self.shared.cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        q.shutdown = true;
        self.shared.wake();
    }

    /// Fail everything queued with `ContextClosed` and let the thread end.
    pub(crate) fn shutdown(&self) {
        let mut q = self.shared.lock();
        q.shutdown = true;
        self.shared.wake();
    }
}

/// Send replies and count them.
fn answer(shared: &Shared, replies: Vec<(Reply, Result<()>)>) {
    if replies.is_empty() {
        return;
    }
    {
        let mut q = shared.lock();
        for (_, r) in &replies {
            if r.is_ok() {
                q.stats.ops_completed += 1;
            } else {
                q.stats.ops_failed += 1;
            }
        }
    }
    for (reply, result) in replies {
        reply.send(result);
    }
}

fn set_idle(shared: &Shared) {
    let mut q = shared.lock();
    q.idle = true;
    q.ticking = false;
    drop(q);
    shared.wake();
}

fn engine_loop<H: Host>(ctx: Weak<H>, shared: Arc<Shared>) {
    let _exited = Exited(Arc::clone(&shared));
    // The decodes run here: this thread's OpenMP pool also takes the rows' host work.
    crate::omp::mark_engine_thread();
    shared.lock().engine_thread = Some(std::thread::current().id());
    let mut sched = Scheduler::default();
    let mut pool_held = false;
    loop {
        let Some(taken) = take_ops(&shared, &mut sched, pool_held) else {
            return;
        };
        pool_held = !matches!(taken, Taken::Idle);
        let started = Instant::now();
        let Some(context) = ctx.upgrade() else {
            shared.lock().shutdown = true;
            if let Taken::Calls(applies) = taken {
                apply::fail(applies, &LloyalError::ContextClosed);
            }
            continue;
        };
        let (ops, max_prefill) = match taken {
            Taken::Calls(applies) => {
                apply::run(&*context, &shared, applies);
                continue;
            }
            Taken::Settle => {
                settle(&*context, &shared, &mut sched);
                continue;
            }
            Taken::Compact => {
                compact_if_sparse(&*context, &shared);
                continue;
            }
            Taken::Idle => {
                crate::omp::release_pool();
                continue;
            }
            Taken::Tick(ops, max_prefill) => (ops, max_prefill),
        };
        let Some(mut outcome) = run_tick(&*context, &shared, &mut sched, ops, max_prefill) else {
            set_idle(&shared);
            continue;
        };
        sched.burst.tick_ended(Instant::now()); // before its callers are answered
        drop(context);
        record(&shared, &sched, &mut outcome, started);
        let decoded = outcome.ops > 0;
        let recorded = Instant::now();
        hand_out(&shared, outcome);
        let mut q = shared.lock();
        if decoded {
            // The tick's time up to `record` was counted there, with its decode time, so a
            // caller woken above reads the two together; waking the callers comes after.
            q.stats.tick_seconds += recorded.elapsed().as_secs_f64();
        }
        q.idle = !sched.has_work();
        if q.idle {
            // `close()` may be waiting for the engine to run dry.
            shared.wake();
        }
    }
}

/// Deliver an outcome's events to their streams, then answer its operations.
fn hand_out(shared: &Shared, outcome: TickOutcome) {
    for (stream, event) in outcome.events {
        stream.deliver(event);
    }
    answer(shared, outcome.replies);
}

/// Roll back the in-flight prefills and end the generation requests cancelled since the last
/// tick (what a tick does first) now, before the context calls waiting behind them: a
/// cancelled `aprefill` has written cells ahead of its branch's position, which a fork, a
/// saved state or `retain_only` would otherwise take for the branch's.
fn settle<H: Host>(context: &H, shared: &Shared, sched: &mut Scheduler) {
    let ran = catch_unwind(AssertUnwindSafe(|| context.locked(None, |s| Ok(sched.settle(s)))));
    {
        let mut q = shared.lock();
        q.ticking = false;
        q.idle = !sched.has_work(); // `close()` may be waiting for the engine to run dry
        q.stats.in_flight = sched.in_flight();
        q.stats.generating = sched.generating();
    }
    shared.wake();
    if let Ok(Ok(outcome)) = ran {
        hand_out(shared, outcome);
    }
}

/// The engine has nothing else to do: move the KV cache's cells back to its front when cells
/// left high by a busy stretch would slow what comes next ([`crate::state::compact`]).
fn compact_if_sparse<H: Host>(context: &H, shared: &Shared) {
    // A failure (a llama.cpp fault) disposed every branch; their callers meet that on their
    // next call, which is all there is to tell. A panic (a bug) must not end the engine.
    let ran = catch_unwind(AssertUnwindSafe(|| context.locked(None, ContextState::compact_if_sparse)));
    if let Ok(Ok(true)) = ran {
        shared.lock().stats.kv_compactions += 1;
    }
}

/// What the engine runs next.
enum Taken {
    /// Operations cancelled after they started, rolled back or ended before anything else.
    Settle,
    /// Context calls queued while a tick ran ([`apply`]).
    Calls(Vec<apply::Apply>),
    /// A tick's operations and its prefill cap.
    Tick(Vec<Op>, Option<usize>),
    /// A look at whether the KV cache is worth compacting (nothing else to do).
    Compact,
    /// Nothing to do for [`POOL_IDLE`]: time to release the decode threads.
    Idle,
}

/// Wait for work: the queued context calls if any (a paused engine runs them too), else
/// gather the tick's operations and take them with the prefill cap; `Idle` after [`POOL_IDLE`]
/// without work while the engine holds decode threads (`pool_held`); `None` when the engine
/// shut down (everything it held is answered).
fn take_ops(shared: &Shared, sched: &mut Scheduler, pool_held: bool) -> Option<Taken> {
    let mut spun = false;
    loop {
        let mut q = shared.lock();
        loop {
            if q.shutdown {
                let ops: Vec<Op> = q.ops.drain(..).collect();
                let applies: Vec<apply::Apply> = q.applies.drain(..).collect();
                q.stats.queue_depth = 0;
                drop(q);
                let mut replies = sched.fail_all(&LloyalError::ContextClosed);
                replies.extend(ops.into_iter().map(|op| (op.reply, Err(LloyalError::ContextClosed))));
                answer(shared, replies);
                apply::fail(applies, &LloyalError::ContextClosed);
                return None;
            }
            if q.closing && sched.generating() + sched.waiting() > 0 {
                // `close()` waits for what was submitted, but not for generation requests (a
                // stream reading ahead never lets the engine run dry): they end now.
                drop(q);
                answer(shared, sched.end_generations(&LloyalError::ContextClosed));
                q = shared.lock();
                q.idle = !sched.has_work();
                q.stats.generating = 0;
                shared.wake();
                continue;
            }
            if q.stale {
                q.stale = false;
                q.ticking = true;
                return Some(Taken::Settle);
            }
            if !q.applies.is_empty() {
                q.ticking = true;
                return Some(Taken::Calls(q.applies.drain(..).collect()));
            }
            if !q.paused && (!q.ops.is_empty() || sched.has_work()) {
                break;
            }
            if !q.paused && sched.waiting() + sched.lease_waiting() > 0 {
                // Generation requests wait for room that a prune (not an engine call) may
                // free: look again every few milliseconds.
                q = shared.cv.wait_timeout(q, WAIT_POLL).unwrap_or_else(|p| p.into_inner()).0;
                if !q.paused && !q.shutdown {
                    break;
                }
                continue;
            }
            if q.compact_check && !q.paused && !q.closing {
                q.compact_check = false;
                return Some(Taken::Compact);
            }
            let spin = shared.spin();
            if pool_held && !spun && !spin.is_zero() {
                // Right after a tick: the next call is usually on its way (a spare core spins
                // for it rather than wake from a sleep, [`spin`]).
                spun = true;
                let k = shared.kicks.load(Ordering::Acquire);
                drop(q);
                spin::until(spin, || shared.kicks.load(Ordering::Acquire) != k);
                q = shared.lock();
                continue;
            }
            if pool_held {
                let (guard, waited) = shared.cv.wait_timeout(q, POOL_IDLE).unwrap_or_else(|p| p.into_inner());
                q = guard;
                if waited.timed_out() {
                    return Some(Taken::Idle);
                }
                continue;
            }
            q = shared.cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        q = gather(shared, q, sched);
        if q.shutdown || q.paused || !q.applies.is_empty() {
            continue;
        }
        q.stats.queue_depth = 0;
        q.idle = false;
        q.ticking = true;
        return Some(Taken::Tick(q.ops.drain(..).collect(), q.prefill_chunk));
    }
}

/// Gather: give the previous tick's callers a moment to come back, so they share this tick
/// instead of splitting into a one-caller tick and the rest. A caller whose prefill just
/// finished usually forks it next, with a direct call that needs the context lock: the whole
/// window leaves it room to do so before this tick takes the lock (else it waited a whole
/// tick, ~0.8 s for a 512-token chunk); an operation on the prefilled branch says the caller is
/// back, and the window ends.
fn gather<'a>(
    shared: &'a Shared,
    mut q: MutexGuard<'a, Queue>,
    sched: &mut Scheduler,
) -> MutexGuard<'a, Queue> {
    let prompts = |q: &Queue| prompt_ops(q).count();
    let start = Instant::now();
    sched.burst.arrived(start, prompt_ops(&q).map(|op| op.queued));
    let burst = q.idle && sched.generating() == 0 && prompts(&q) > 0;
    let burst_wait = burst && q.stats.gather > 0.0;
    let gather = if burst_wait {
        // The first tick after idling, with a prompt: the rest of a burst (a server's
        // concurrent clients) is a few milliseconds behind, and a tick that started without
        // them would make them wait for all of it; none for a caller alone at its last wait
        // ([`burst`]).
        sched.burst.begin(start, prompts(&q), q.ops.iter().map(|op| op.work.prompt_len()).sum())
    } else {
        Duration::from_secs_f64(q.stats.gather)
    };
    let burst_wait = burst_wait && !gather.is_zero();
    let deadline = start + gather;
    let settle = |q: &Queue| {
        burst
            || !q.last_prefilled.is_empty()
                && !q.ops.iter().any(|op| op.work.handles().iter().any(|h| q.last_prefilled.contains(h)))
    };
    while (settle(&q) || q.ops.len() + sched.ready() < q.last_tick_ops) && !q.shutdown && !q.paused {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        q = shared.cv.wait_timeout(q, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
    }
    if burst_wait {
        q.stats.burst_wait_seconds += start.elapsed().as_secs_f64();
        if !q.shutdown && !q.paused && q.applies.is_empty() {
            // (A wait that context calls cut short is taken again after them, and judged then.)
            sched.burst.ended(prompts(&q));
            q.stats.burst_waits += 1;
        }
    }
    q
}

/// The queued operations that write a prompt.
fn prompt_ops(q: &Queue) -> impl Iterator<Item = &Op> {
    q.ops.iter().filter(|op| op.work.has_prompt())
}

/// Run one tick on the locked context; `None` when it failed as a whole (the context was
/// closed, or a panic), with every operation answered.
fn run_tick<H: Host>(
    context: &H,
    shared: &Shared,
    sched: &mut Scheduler,
    ops: Vec<Op>,
    max_prefill: Option<usize>,
) -> Option<TickOutcome> {
    let mut pending = Some(ops);
    let ran = catch_unwind(AssertUnwindSafe(|| {
        context.locked(None, |s| Ok(sched.tick(s, pending.take().unwrap_or_default(), max_prefill)))
    }));
    match ran {
        Ok(Ok(outcome)) => Some(outcome),
        Ok(Err(e)) => {
            // The context was closed: answer everything.
            let mut replies = sched.fail_all(&e);
            replies
                .extend(pending.take().unwrap_or_default().into_iter().map(|op| (op.reply, Err(e.clone()))));
            answer(shared, replies);
            None
        }
        Err(_) => {
            // A panic (a bug): the dropped replies of the tick answered their callers;
            // fail the prefills in flight too rather than resume from an unknown state.
            let err = LloyalError::Backend(
                "internal error in lloyal's engine (please report it); the operation failed".into(),
            );
            answer(shared, sched.fail_all(&err));
            None
        }
    }
}

/// Count a tick (begun at `started`) in the engine's statistics and queue its deferred
/// operations again.
fn record(shared: &Shared, sched: &Scheduler, outcome: &mut TickOutcome, started: Instant) {
    let mut q = shared.lock();
    q.ticking = false;
    let st = &mut q.stats;
    if outcome.ops > 0 {
        st.ticks += 1;
        st.tick_seconds += started.elapsed().as_secs_f64();
        st.decode_calls += outcome.decodes;
        st.rows += outcome.rows;
        if outcome.ops > 1 {
            st.ops_coalesced += outcome.ops;
        }
        st.max_ops_per_tick = st.max_ops_per_tick.max(outcome.ops);
        st.decode_seconds += outcome.decode_secs;
        st.sample_seconds += outcome.sample_secs;
        st.prefill_cap = outcome.prefill_cap;
    }
    st.in_flight = sched.in_flight();
    st.generating = sched.generating();
    st.waiting = sched.waiting();
    st.lease_waiting = sched.lease_waiting();
    q.last_tick_ops = outcome.commits as usize;
    q.last_prefilled = std::mem::take(&mut outcome.prefilled);
    for op in std::mem::take(&mut outcome.deferred).into_iter().rev() {
        q.ops.push_front(op);
    }
    q.stats.queue_depth = q.ops.len();
}
