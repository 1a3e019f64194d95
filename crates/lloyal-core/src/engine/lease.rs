//! Lease requests: `Branch.create` / `fork` with a `timeout` wait in the engine, first come
//! first served, for a sequence id to come free.
//!
//! The branch is made on the engine thread under the context lock when a lease is free and
//! every earlier waiter has been served. The caller collects it from a [`LeaseSlot`]; a caller
//! that gives up (timeout, Ctrl-C, a cancelled task) withdraws the slot, and a branch granted
//! in the same instant comes back from [`LeaseSlot::withdraw`] to be pruned, so no lease leaks.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

/// What makes the branch once a lease is free (`branch_create` or `branch_fork_at`).
pub type MakeBranch = Box<dyn FnOnce(&mut ContextState) -> Result<Handle> + Send>;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    #[default]
    Waiting,
    Granted(Handle),
    Withdrawn,
    Taken,
}

/// Where a granted branch waits for its caller.
#[derive(Debug, Default)]
pub struct LeaseSlot(Mutex<SlotState>);

impl LeaseSlot {
    fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run `make` and keep its branch, unless the caller withdrew (`Interrupted`). The slot
    /// stays locked while `make` runs, so a withdrawal either comes first or sees the branch.
    pub(crate) fn grant(&self, make: impl FnOnce() -> Result<Handle>) -> Result<()> {
        let mut st = self.state();
        if *st != SlotState::Waiting {
            return Err(LloyalError::Interrupted);
        }
        let h = make()?;
        *st = SlotState::Granted(h);
        Ok(())
    }

    /// The caller gives up: no branch will be granted after this; a branch granted already
    /// is returned for the caller to prune.
    pub fn withdraw(&self) -> Option<Handle> {
        let mut st = self.state();
        let granted = match *st {
            SlotState::Granted(h) => Some(h),
            _ => None,
        };
        if *st != SlotState::Taken {
            *st = SlotState::Withdrawn;
        }
        granted
    }

    /// The granted branch (once).
    pub fn take(&self) -> Option<Handle> {
        let mut st = self.state();
        match *st {
            SlotState::Granted(h) => {
                *st = SlotState::Taken;
                Some(h)
            }
            _ => None,
        }
    }
}

/// A queued lease request.
pub struct LeaseWork {
    /// The branch a fork copies (its in-flight prefill, if any, finishes first).
    pub parent: Option<Handle>,
    /// When to give up (None: never).
    pub deadline: Option<Instant>,
    /// The timeout, for the error message.
    pub timeout: f64,
    /// Where the branch goes.
    pub slot: Arc<LeaseSlot>,
    make: Mutex<Option<MakeBranch>>,
}

impl LeaseWork {
    /// A request that runs `make` once a lease is free, giving up after `timeout` seconds
    /// (None: never).
    pub fn new(parent: Option<Handle>, timeout: Option<f64>, make: MakeBranch) -> (Self, Arc<LeaseSlot>) {
        let slot = Arc::new(LeaseSlot::default());
        // (a timeout past what the clock can count, inf included, is no deadline)
        let deadline = timeout.and_then(|t| {
            let wait = std::time::Duration::try_from_secs_f64(t.max(0.0)).ok()?;
            Instant::now().checked_add(wait)
        });
        let work = LeaseWork {
            parent,
            deadline,
            timeout: timeout.unwrap_or(f64::INFINITY),
            slot: Arc::clone(&slot),
            make: Mutex::new(Some(make)),
        };
        (work, slot)
    }

    /// Make the branch now (a lease is free) into the slot.
    pub(crate) fn grant(&self, s: &mut ContextState) -> Result<()> {
        let make = self.make.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(make) = make else { return Err(LloyalError::Interrupted) };
        self.slot.grant(|| make(s))
    }

    /// Whether the deadline passed at `now`.
    pub(crate) fn expired(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }
}

impl fmt::Debug for LeaseWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseWork").field("parent", &self.parent).field("timeout", &self.timeout).finish()
    }
}

impl PartialEq for LeaseWork {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_withdrawal_before_the_grant_stops_it() {
        let slot = LeaseSlot::default();
        assert_eq!(slot.withdraw(), None);
        let mut made = false;
        let r = slot.grant(|| {
            made = true;
            Ok(7)
        });
        assert_eq!(r, Err(LloyalError::Interrupted));
        assert!(!made, "nothing is made for a caller that left");
        assert_eq!(slot.take(), None);
    }

    #[test]
    fn a_withdrawal_after_the_grant_returns_the_branch_to_prune() {
        let slot = LeaseSlot::default();
        slot.grant(|| Ok(3)).unwrap();
        assert_eq!(slot.withdraw(), Some(3));
        assert_eq!(slot.take(), None, "withdrawn: the caller never takes it");
        assert_eq!(slot.withdraw(), None);
    }

    #[test]
    fn a_taken_branch_is_the_callers() {
        let slot = LeaseSlot::default();
        slot.grant(|| Ok(5)).unwrap();
        assert_eq!(slot.take(), Some(5));
        assert_eq!(slot.take(), None);
        assert_eq!(slot.withdraw(), None, "a taken branch is never pruned by a late withdrawal");
    }

    #[test]
    fn a_failed_make_leaves_the_slot_empty() {
        let slot = LeaseSlot::default();
        let r = slot.grant(|| Err(LloyalError::BranchDisposed { handle: 1 }));
        assert!(matches!(r, Err(LloyalError::BranchDisposed { .. })));
        assert_eq!(slot.take(), None);
    }

    #[test]
    fn deadlines() {
        let (w, _) = LeaseWork::new(None, Some(0.0), Box::new(|_| Ok(1)));
        assert!(w.expired(Instant::now()));
        let (w, _) = LeaseWork::new(None, None, Box::new(|_| Ok(1)));
        assert!(!w.expired(Instant::now() + std::time::Duration::from_secs(3600)));
        assert!(format!("{w:?}").contains("LeaseWork"));
    }
}
