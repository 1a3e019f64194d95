//! `Branch.verify(drafts)`: speculative decoding's check step. The drafts are decoded in ONE
//! batch with logits on every row; the branch's own sampler then walks them, keeping the
//! longest prefix it agrees with; the cells of the rejected rest are removed and the token the
//! sampler chose instead (the bonus) is committed.

use crate::branch::Logits;
use crate::context::batches::BatchRow;
use crate::context::state::ContextState;
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

impl ContextState {
    /// Verify `drafts` on `handle` (see the module docs). Afterwards the branch holds
    /// `drafts[..accepted] + [bonus]`, each accepted into its sampler and metrics exactly as
    /// `produce` + `commit` would have. Any failure (a decode, Ctrl-C, a grammar that allows
    /// no token part-way) leaves the branch exactly as before.
    pub fn branch_verify(&mut self, handle: Handle, drafts: &[i32]) -> Result<Verified> {
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
        self.check_room(k + 1)?;

        let mut rows: Vec<Vec<f32>> = Vec::with_capacity(k);
        let batch: Vec<BatchRow> =
            (0..k).map(|i| BatchRow { token: drafts[i], pos: pos + i as i32, seq, output: true }).collect();
        self.decode_all(&batch, |s, chunk| {
            for row in 0..chunk.len() {
                rows.push(s.copy_logits_row(row as i32)?);
            }
            Ok(())
        })?;

        // Walking the drafts and committing the bonus can still fail (a grammar that allows
        // no token, Ctrl-C before the bonus decode): then restore the branch exactly.
        let saved = self.branch(handle)?.snapshot()?;
        let cells_before = self.ledger.cells_used();
        match self.verify_walk(handle, drafts, rows, seq, pos) {
            Ok(v) => Ok(v),
            Err(e) => {
                self.remove_cells(seq, pos, -1);
                // The walk may have counted accepted drafts before failing.
                self.ledger.free_cells(self.ledger.cells_used() - cells_before);
                *self.branch_mut(handle)? = saved;
                Err(e)
            }
        }
    }

    /// Accept the drafts the sampler agrees with (their logits rows in `rows`), drop the
    /// cells of the rest and commit the bonus. Leaves partial state behind on failure.
    fn verify_walk(
        &mut self,
        handle: Handle,
        drafts: &[i32],
        mut rows: Vec<Vec<f32>>,
        seq: i32,
        pos: i32,
    ) -> Result<Verified> {
        let k = drafts.len();
        let mut accepted = 0;
        let bonus = loop {
            let b = self.branch_mut(handle)?;
            let token = b.produce()?;
            if accepted == k || token != drafts[accepted] {
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
        self.commit(&[(handle, bonus)])?;
        Ok(Verified { accepted, bonus })
    }
}
