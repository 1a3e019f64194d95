//! Queued operations and their one-shot replies.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

/// The decode-bearing work of one caller.
#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    /// `BranchStore.commit` / `Branch.commit`: accept and decode one token per branch.
    Commit(Vec<(Handle, i32)>),
    /// `BranchStore.prefill` / `Branch.prefill`: write each branch's tokens.
    Prefill(Vec<(Handle, Vec<i32>)>),
    /// `Branch.generate`: a generation request ([`super::gen`]), answered when it ends.
    Generate(Box<super::gen::GenSpec>),
    /// `Branch.create` / `fork` with a timeout: wait (FIFO) for a lease ([`super::lease`]).
    Lease(Arc<super::lease::LeaseWork>),
    /// `Branch.verify`: the drafts decoded in one tick, the bonus committed in the next
    /// ([`crate::branch::verify`]).
    Verify(Arc<crate::branch::verify::VerifyWork>),
    /// `Branch.reseed(sinks, tail)`: the branch's cells freed (or parked), then `sinks + tail`
    /// prefilled from position 0 ([`crate::branch::reseed`]).
    Reseed(Handle, Vec<i32>, Vec<i32>),
    /// `Branch.score`: a prefill whose rows each score the token after them
    /// ([`crate::branch::score`]).
    Score(Arc<crate::branch::score::ScoreWork>),
}

impl Work {
    /// Whether the work writes a prompt (a prefill, or a generation request with one).
    pub(crate) fn has_prompt(&self) -> bool {
        match self {
            Work::Prefill(_) | Work::Reseed(..) | Work::Score(_) => true,
            Work::Generate(spec) => !spec.prompt.is_empty(),
            Work::Commit(_) | Work::Lease(_) | Work::Verify(_) => false,
        }
    }

    /// Prompt tokens the work writes (0 without a prompt).
    pub(crate) fn prompt_len(&self) -> usize {
        match self {
            Work::Prefill(items) => items.iter().map(|i| i.1.len()).sum(),
            Work::Reseed(_, sinks, tail) => sinks.len() + tail.len(),
            Work::Score(w) => w.tokens.len(),
            Work::Generate(spec) => spec.prompt.len(),
            Work::Commit(_) | Work::Lease(_) | Work::Verify(_) => 0,
        }
    }

    /// The branches this work touches.
    pub(crate) fn handles(&self) -> Vec<Handle> {
        match self {
            Work::Commit(pairs) => pairs.iter().map(|p| p.0).collect(),
            Work::Prefill(items) => items.iter().map(|i| i.0).collect(),
            Work::Generate(spec) => vec![spec.handle],
            Work::Lease(w) => w.parent.into_iter().collect(),
            Work::Verify(w) => vec![w.handle],
            Work::Reseed(h, ..) => vec![*h],
            Work::Score(w) => vec![w.handle],
        }
    }
}

/// The callback that receives an operation's result (called once, on the engine thread).
pub type Done = Box<dyn FnOnce(Result<()>) + Send>;

/// An operation's reply: sent exactly once. Dropping an unsent reply (a bug or a panic in
/// the engine thread) still answers the caller, with an error, so no caller ever hangs.
pub struct Reply(Option<Done>);

impl Reply {
    /// Wrap a callback.
    pub fn new(done: Done) -> Self {
        Reply(Some(done))
    }

    /// Deliver the result.
    pub fn send(mut self, result: Result<()>) {
        if let Some(done) = self.0.take() {
            done(result);
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if let Some(done) = self.0.take() {
            done(Err(LloyalError::Backend(
                "internal error in lloyal's engine: an operation was dropped unanswered (please report \
                 it); the branches it named are unchanged"
                    .into(),
            )));
        }
    }
}

/// One queued operation.
pub struct Op {
    pub(crate) id: u64,
    pub(crate) work: Work,
    pub(crate) reply: Reply,
    pub(crate) cancelled: Arc<AtomicBool>,
    /// When it was submitted (the burst wait watches for prompts arriving together).
    pub(crate) queued: Instant,
}

impl Op {
    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }
}

/// Where the engine leaves the result of an operation that returns more than success (a
/// verify's, a score's): set when the operation succeeded, taken once by its caller after the
/// reply.
pub struct Answer<T>(Mutex<Option<T>>);

impl<T> Default for Answer<T> {
    fn default() -> Self {
        Answer(Mutex::new(None))
    }
}

impl<T> Answer<T> {
    pub(crate) fn set(&self, value: T) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(value);
    }

    /// The result, once the engine answered the operation with success.
    pub fn take(&self) -> Option<T> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// A blocking result slot for synchronous callers.
pub struct Waiter<T = ()> {
    slot: Arc<Slot<T>>,
}

/// A waiter's result, its condition variable, and whether the result is in (for a spin).
type Slot<T> = (Mutex<Option<Result<T>>>, Condvar, AtomicBool);

impl<T: Send + 'static> Waiter<T> {
    /// A waiter and the callback that fills it.
    #[allow(clippy::type_complexity)]
    pub fn new() -> (Waiter<T>, Box<dyn FnOnce(Result<T>) + Send>) {
        let w = Waiter { slot: Arc::new((Mutex::new(None), Condvar::new(), AtomicBool::new(false))) };
        let slot = Arc::clone(&w.slot);
        let done = Box::new(move |r| {
            let (m, cv, ready) = &*slot;
            *m.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            ready.store(true, Ordering::Release);
            cv.notify_all();
        });
        (w, done)
    }

    /// The result once it arrived within `timeout`, else `None`.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<T>> {
        let (m, cv, _) = &*self.slot;
        let guard = m.lock().unwrap_or_else(|p| p.into_inner());
        let (mut guard, _) =
            cv.wait_timeout_while(guard, timeout, |r| r.is_none()).unwrap_or_else(|p| p.into_inner());
        guard.take()
    }

    /// Spin up to `budget` for the result before a wait sleeps ([`super::spin`]).
    pub fn spin(&self, budget: Duration) {
        let ready = &self.slot.2;
        super::spin::until(budget, || ready.load(Ordering::Acquire));
    }

    /// Block until the result arrives.
    pub fn wait(&self) -> Result<T> {
        loop {
            if let Some(r) = self.wait_timeout(Duration::from_secs(3600)) {
                return r;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_reply_answers_with_an_error() {
        let (w, done) = Waiter::new();
        drop(Reply::new(done));
        assert!(matches!(w.wait(), Err(LloyalError::Backend(_))));
        let (w, done) = Waiter::new();
        Reply::new(done).send(Ok(()));
        assert_eq!(w.wait_timeout(Duration::from_millis(1)), Some(Ok(())));
        assert_eq!(w.wait_timeout(Duration::from_millis(1)), None, "a result is taken once");
    }
}
