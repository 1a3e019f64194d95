//! `Branch.verify(drafts)`: speculative decoding's check step, run by the engine
//! ([`crate::engine`]) in two ticks. The drafts are decoded in one tick with logits on every
//! row (beside other callers' rows); the branch's own sampler then walks them, keeping the
//! longest prefix it agrees with; the cells of the rejected rest are removed, and the token the
//! sampler chose instead (the bonus) is committed in the next tick. A failure at any step (a
//! decode, a cancellation, a grammar that allows no token part-way) leaves the branch exactly
//! as before.

use std::fmt;

use crate::branch::{BranchState, Logits};
use crate::context::state::ContextState;
use crate::engine::op::Answer;
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

/// What `verify` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// How many draft tokens were accepted.
    pub accepted: usize,
    /// The token committed after them (the sampler's own choice).
    pub bonus: i32,
}

/// A queued `verify`: the branch, its drafts, and where the engine leaves the result.
pub struct VerifyWork {
    /// The branch to verify on.
    pub handle: Handle,
    /// The draft tokens.
    pub drafts: Vec<i32>,
    /// What the walk accepted, once the bonus is committed.
    pub result: Answer<Verified>,
}

impl VerifyWork {
    /// A verify of `drafts` on `handle`.
    pub fn new(handle: Handle, drafts: Vec<i32>) -> Self {
        VerifyWork { handle, drafts, result: Answer::default() }
    }
}

impl fmt::Debug for VerifyWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerifyWork")
            .field("handle", &self.handle)
            .field("drafts", &self.drafts.len())
            .finish()
    }
}

impl PartialEq for VerifyWork {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

/// How to put a branch back as it was before its verify (kept from the walk until the bonus
/// is committed).
pub(crate) struct VerifyUndo {
    saved: BranchState,
    cells_before: usize,
    seq: i32,
    pos: i32,
}

impl ContextState {
    /// Check a verify of `drafts` on `handle` before its drafts are decoded: the tokens, their
    /// count (under `n_batch`), the branch's logits and room for the drafts and the bonus
    /// next to `reserved` cells. The drafts' sequence and first position.
    pub(crate) fn verify_admit(
        &mut self,
        handle: Handle,
        drafts: &[i32],
        reserved: usize,
    ) -> Result<(i32, i32)> {
        self.model().check_tokens(drafts)?;
        let k = drafts.len();
        let n_batch = self.shape().n_batch as usize;
        if k >= n_batch {
            return Err(LloyalError::invalid(format!(
                "verify takes at most n_batch - 1 = {} draft tokens, got {k}",
                n_batch - 1
            )));
        }
        let (seq, pos) = self.branch(handle).map(|b| (b.seq_id, b.position))?;
        self.branch(handle)?.logits()?;
        self.check_room_reserved(k + 1, reserved)?;
        Ok((seq, pos))
    }

    /// Accept the drafts the sampler agrees with (`rows`: the logits of each draft's row, the
    /// drafts' cells written from `pos` on), drop the cells of the rest, and draw the bonus.
    /// Returns the result and the undo point; on failure the branch is already restored.
    pub(crate) fn verify_walk(
        &mut self,
        handle: Handle,
        drafts: &[i32],
        rows: Vec<Vec<f32>>,
        (seq, pos): (i32, i32),
    ) -> Result<(Verified, VerifyUndo)> {
        let undo = VerifyUndo {
            saved: self.branch(handle)?.snapshot()?,
            cells_before: self.ledger.cells_used(),
            seq,
            pos,
        };
        match self.walk_drafts(handle, drafts, rows, seq, pos) {
            Ok(v) => Ok((v, undo)),
            Err(e) => {
                self.verify_undo(handle, undo);
                Err(e)
            }
        }
    }

    /// Put the branch back as it was before its verify: its cells from the drafts on removed,
    /// the accepted drafts uncounted, its state restored.
    pub(crate) fn verify_undo(&mut self, handle: Handle, undo: VerifyUndo) {
        self.remove_cells(undo.seq, undo.pos, -1);
        // The walk may have counted accepted drafts.
        self.ledger.free_cells(self.ledger.cells_used().saturating_sub(undo.cells_before));
        if let Ok(b) = self.branch_mut(handle) {
            *b = undo.saved;
        }
    }

    /// The walk itself; leaves partial state behind on failure.
    fn walk_drafts(
        &mut self,
        handle: Handle,
        drafts: &[i32],
        mut rows: Vec<Vec<f32>>,
        seq: i32,
        pos: i32,
    ) -> Result<Verified> {
        let k = drafts.len();
        if rows.len() != k {
            return Err(LloyalError::Backend(format!("verify decoded {} rows for {k} drafts", rows.len())));
        }
        let mut accepted = 0;
        let model = self.model();
        let bonus = loop {
            let b = self.branch_mut(handle)?;
            let token = b.produce()?;
            // An end of generation ends the walk as the bonus, drafted or not: no draft after
            // it is accepted (plain decoding stops there).
            if accepted == k || token != drafts[accepted] || model.is_eog(token) {
                break token;
            }
            let s = b.surprisals(token);
            b.accept_with(token, s);
            b.position += 1;
            b.next_logits = Logits::new(std::mem::take(&mut rows[accepted]));
            b.publish_logits();
            accepted += 1;
        };
        self.ledger.grow_cells(accepted);
        self.remove_cells(seq, pos + accepted as i32, -1);
        Ok(Verified { accepted, bonus })
    }
}
