//! Every context call that is not a decode-bearing [`super::Work`] (create, fork, prune,
//! sampler changes, the flat path, embeddings, state loads, reads): run at a point of the
//! engine's loop, never inside a tick.
//!
//! A call made while no tick runs takes its turn at once on the caller's thread (nothing
//! queued can be overtaken: queued operations start at the next tick, after it). A call made
//! while a tick runs is queued; the engine thread runs the queued calls in submission order
//! before its next tick, answers each at once, then leaves the callers a short gap
//! ([`LINGER`]) for their next calls (a server admitting a request forks, then sets a
//! sampler, a bias and a grammar: one tick's wait, not one per call), which take their turn on
//! their own threads. A call that decodes is always queued
//! ([`crate::context::Context::apply_decoding`]): the engine thread is the only one that decodes.
//!
//! So the engine decides the order of every change to a context, and the context lock is only
//! ever contended by one tick and the calls waiting for their turn.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::op::{Reply, Waiter};
use super::{Engine, Host, Shared};
use crate::context::state::{ContextState, InterruptCheck};
use crate::error::{LloyalError, Result};

/// How long the engine waits after answering queued calls, or after the last call that took
/// its turn meanwhile, before its next tick.
pub(crate) const LINGER: Duration = Duration::from_millis(1);

/// The most a run of calls holds off the next tick.
const LINGER_MAX: Duration = Duration::from_millis(5);

/// How often a waiting caller runs its interrupt check (Python's signal handlers).
const CHECK_EVERY: Duration = Duration::from_millis(50);

/// Where a call's result goes: called once, with its result or the reason it never ran.
pub type CallDone<T> = Box<dyn FnOnce(Result<T>) + Send>;

/// A queued call: its body keeps its own result; the reply says it ran (or why not).
pub(super) struct Apply {
    id: u64,
    job: Box<dyn FnOnce(&mut ContextState) + Send>,
    reply: Reply,
    cancelled: Arc<AtomicBool>,
}

/// A call taking its turn on its own thread; the engine's next tick waits for the lock.
pub(crate) struct Turn<'a> {
    shared: &'a Shared,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        q.inline -= 1;
        if q.lingering {
            self.shared.wake();
        }
    }
}

/// A queued call: cancel it while it waits (answered with `Interrupted`) or runs (stopped
/// between its decodes, rolled back).
pub struct Queued {
    id: u64,
    cancelled: Arc<AtomicBool>,
    shared: Weak<Shared>,
}

impl Queued {
    /// Cancel the call; whether it had not started (then it never will).
    pub fn cancel(&self) -> bool {
        self.cancelled.store(true, Ordering::Release);
        let Some(shared) = self.shared.upgrade() else { return false };
        let removed = {
            let mut q = shared.lock();
            let at = q.applies.iter().position(|a| a.id == self.id);
            at.and_then(|i| q.applies.remove(i))
        };
        // Answered outside the lock: the callback may wait for the GIL.
        removed.map(|a| a.reply.send(Err(LloyalError::Interrupted))).is_some()
    }
}

impl Engine {
    /// The caller's turn now (no tick running, no call queued before it), or `None`: queue the
    /// call ([`Engine::queue`]). The engine thread itself always has its turn: it calls back
    /// into Python only outside its ticks (a finalizer there may prune a branch).
    pub(crate) fn turn(&self) -> Option<Turn<'_>> {
        let mut q = self.shared.lock();
        let engine = q.on_engine_thread();
        if (q.ticking || q.stale || !q.applies.is_empty()) && !engine {
            return None;
        }
        q.inline += 1;
        q.inline_runs += 1;
        Some(Turn { shared: &self.shared })
    }

    /// Queue `f` for the engine thread, which runs it before its next tick and hands `done`
    /// its result (or the reason it never ran: the context closed, the call was cancelled).
    pub(crate) fn queue<T, F>(&self, f: F, done: CallDone<T>) -> Result<Queued>
    where
        T: Send + 'static,
        F: FnOnce(&mut ContextState) -> Result<T> + Send + 'static,
    {
        let slot: Arc<Mutex<Option<Result<T>>>> = Arc::default();
        let out = Arc::clone(&slot);
        let job = Box::new(move |s: &mut ContextState| {
            let r = f(s);
            *out.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        });
        let reply = Reply::new(Box::new(move |ran: Result<()>| {
            let result = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
            done(ran.and_then(|()| {
                result.unwrap_or_else(|| {
                    Err(LloyalError::Backend(
                        "internal error in lloyal's engine: a call ran without a result".into(),
                    ))
                })
            }))
        }));
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut q = self.shared.lock();
        if q.shutdown {
            return Err(LloyalError::ContextClosed);
        }
        let id = q.next_id;
        q.next_id += 1;
        q.applies.push_back(Apply { id, job, reply, cancelled: Arc::clone(&cancelled) });
        self.shared.wake();
        Ok(Queued { id, cancelled, shared: Arc::downgrade(&self.shared) })
    }

    /// Queue `f` and wait for it. `interrupt` runs every [`CHECK_EVERY`] while waiting:
    /// `true` cancels the call ([`Queued::cancel`]) and waits for it to be answered (a call
    /// that finished first keeps its result).
    pub(crate) fn call<T, F>(&self, interrupt: Option<InterruptCheck>, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut ContextState) -> Result<T> + Send + 'static,
    {
        let (waiter, done) = Waiter::new();
        let queued = self.queue(f, done)?;
        loop {
            if let Some(r) = waiter.wait_timeout(CHECK_EVERY) {
                return r;
            }
            if interrupt.as_ref().is_some_and(|check| check()) {
                queued.cancel();
                return waiter.wait();
            }
        }
    }
}

/// Run the queued `applies` in order on the engine thread, answering each as it ends, then
/// linger while their callers' next calls take their turns.
pub(super) fn run<H: Host>(context: &H, shared: &Shared, applies: Vec<Apply>) {
    for a in applies {
        if a.cancelled.load(Ordering::Acquire) {
            a.reply.send(Err(LloyalError::Interrupted));
            continue;
        }
        let flag = Arc::clone(&a.cancelled);
        let check: InterruptCheck = Box::new(move || flag.load(Ordering::Acquire));
        let job = a.job;
        let ran = catch_unwind(AssertUnwindSafe(|| {
            context.locked(Some(check), |s| {
                job(s);
                Ok(())
            })
        }));
        match ran {
            Ok(r) => a.reply.send(r),
            // A panic (a bug): the dropped reply answers the caller with an error.
            Err(_) => drop(a.reply),
        }
    }
    linger(shared);
}

/// Answer calls the engine will not run.
pub(super) fn fail(applies: Vec<Apply>, err: &LloyalError) {
    for a in applies {
        a.reply.send(Err(err.clone()));
    }
}

/// Hold off the next tick while calls keep taking their turns: until none is running and none
/// began for [`LINGER`], at most [`LINGER_MAX`] in all.
fn linger(shared: &Shared) {
    let mut q = shared.lock();
    q.ticking = false;
    q.lingering = true;
    let start = Instant::now();
    let (mut quiet_since, mut seen) = (start, q.inline_runs);
    loop {
        let now = Instant::now();
        if q.shutdown || !q.applies.is_empty() || now >= start + LINGER_MAX {
            break;
        }
        if q.inline > 0 || q.inline_runs != seen {
            (quiet_since, seen) = (now, q.inline_runs);
        } else if now >= quiet_since + LINGER {
            break;
        }
        let wait = (quiet_since + LINGER).saturating_duration_since(now).max(Duration::from_micros(50));
        q = shared.cv.wait_timeout(q, wait).unwrap_or_else(|p| p.into_inner()).0;
    }
    q.lingering = false;
    // `close()` may be waiting for the queued calls to be answered.
    shared.wake();
}
