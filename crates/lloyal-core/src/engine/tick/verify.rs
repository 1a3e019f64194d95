//! `Branch.verify` in the engine ([`crate::branch::verify`]): its drafts are decode rows of
//! one tick (their logits copied out), walked by the branch's sampler in the update phase; the
//! bonus is a commit row of the next tick. Until then the branch is busy (other operations on
//! it wait), and a cancellation or a failed bonus puts the branch back as it was.

use std::sync::Arc;

use super::admit::admit_commit;
use super::{Budget, CommitRow, Part, Scheduler, TickOutcome};
use crate::branch::verify::{Verified, VerifyUndo, VerifyWork};
use crate::context::state::ContextState;
use crate::engine::op::Op;
use crate::error::{LloyalError, Result};

/// A verify whose drafts decode this tick.
pub(super) struct Verifying {
    pub(super) work: Arc<VerifyWork>,
    /// The drafts' sequence and first position.
    pub(super) at: (i32, i32),
}

/// A walked verify whose bonus commits next: its result and how to undo it.
pub(super) struct Bonus {
    work: Arc<VerifyWork>,
    verified: Verified,
    undo: VerifyUndo,
}

impl Scheduler {
    /// Admit a queued verify: its drafts become this tick's rows, or (no drafts) its bonus is
    /// drawn now and commits this tick.
    pub(super) fn admit_verify(
        &mut self,
        s: &mut ContextState,
        op: Op,
        work: Arc<VerifyWork>,
        budget: &mut Budget,
        out: &mut TickOutcome,
    ) -> Option<Part> {
        let at = match s.verify_admit(work.handle, &work.drafts, budget.reserved) {
            Ok(at) => at,
            Err(e) => {
                out.reply(op, Err(e));
                return None;
            }
        };
        budget.busy.insert(work.handle);
        if !work.drafts.is_empty() {
            // The drafts' cells, and the bonus's, which later operations of this tick must
            // not take (the bonus goes first in the next).
            budget.reserved += work.drafts.len() + 1;
            return Some(Part::Verify(op, Verifying { work, at }));
        }
        match s.verify_walk(work.handle, &[], Vec::new(), at) {
            Ok((verified, undo)) => self.bonus_part(s, op, Bonus { work, verified, undo }, budget, out),
            Err(e) => {
                out.reply(op, Err(e));
                None
            }
        }
    }

    /// The update of a verify whose drafts decoded: walk them (`rows`: their logits) and hold
    /// the bonus for the next tick, or answer the failure (the branch put back).
    pub(super) fn walk_verify(
        &mut self,
        s: &mut ContextState,
        op: Op,
        v: Verifying,
        rows: Vec<Vec<f32>>,
        out: &mut TickOutcome,
    ) {
        match s.verify_walk(v.work.handle, &v.work.drafts, rows, v.at) {
            Ok((verified, undo)) => self.bonuses.push((op, Bonus { work: v.work, verified, undo })),
            Err(e) => out.reply(op, Err(e)),
        }
    }

    /// Admit the bonuses walked last tick as this tick's commit rows (they go first); a
    /// cancelled verify, or one whose bonus cannot commit, is put back and answered.
    pub(super) fn admit_bonuses(
        &mut self,
        s: &mut ContextState,
        budget: &mut Budget,
        out: &mut TickOutcome,
    ) -> Vec<Part> {
        let mut parts = Vec::new();
        for (op, bonus) in std::mem::take(&mut self.bonuses) {
            let h = bonus.work.handle;
            if !s.is_live(h) {
                out.reply(op, Err(LloyalError::BranchDisposed { handle: h }));
            } else if op.is_cancelled() {
                s.verify_undo(h, bonus.undo);
                out.reply(op, Err(LloyalError::Interrupted));
            } else if let Some(part) = self.bonus_part(s, op, bonus, budget, out) {
                parts.push(part);
            }
        }
        parts
    }

    /// The bonus's commit row, or its failure answered (the branch put back).
    fn bonus_part(
        &mut self,
        s: &mut ContextState,
        op: Op,
        bonus: Bonus,
        budget: &mut Budget,
        out: &mut TickOutcome,
    ) -> Option<Part> {
        let h = bonus.work.handle;
        match admit_commit(s, &[(h, bonus.verified.bonus)], budget.reserved) {
            Ok(rows) => {
                budget.reserved += rows.len();
                budget.busy.insert(h);
                Some(Part::Bonus(op, Box::new(bonus), rows))
            }
            Err(e) => {
                s.verify_undo(h, bonus.undo);
                out.reply(op, Err(e));
                None
            }
        }
    }

    /// Answer a verify whose bonus decoded (`Ok`: published, the result left for the caller)
    /// or failed (the branch put back).
    pub(super) fn finish_bonus(
        &mut self,
        s: &mut ContextState,
        op: Op,
        bonus: Bonus,
        rows: &[CommitRow],
        decoded: Result<()>,
        out: &mut TickOutcome,
    ) {
        match decoded.and_then(|()| super::update::finish_commit(s, rows)) {
            Ok(()) => {
                bonus.work.result.set(bonus.verified);
                out.reply(op, Ok(()));
            }
            Err(e) => {
                s.verify_undo(bonus.work.handle, bonus.undo);
                out.reply(op, Err(e));
            }
        }
    }
}
