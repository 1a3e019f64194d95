//! `Branch.verify(drafts)`: speculative decoding's check step. The drafts are decoded in ONE
//! batch with logits on every row; the branch's own sampler then walks them, keeping the
//! longest prefix it agrees with; the cells of the rejected rest are removed and the token the
//! sampler chose instead (the bonus) is committed.

use crate::context::ContextState;
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
    /// `produce` + `commit` would have. A decode failure leaves the branch as before.
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
        if k > 0 {
            self.batch_mut().clear();
            for (i, &t) in drafts.iter().enumerate() {
                self.batch_mut().push(t, pos + i as i32, seq, true);
            }
            let decoded = self.run_batch().and_then(|()| {
                for row in 0..k {
                    let mut out = Vec::new();
                    self.copy_logits_into(row as i32, &mut out)?;
                    rows.push(out);
                }
                Ok(())
            });
            if let Err(e) = decoded {
                self.remove_cells(seq, pos, -1);
                return Err(e);
            }
        }

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
            b.next_logits = std::mem::take(&mut rows[accepted]);
            b.publish_logits();
            accepted += 1;
        };
        self.cells_used += accepted;
        self.remove_cells(seq, pos + accepted as i32, -1);
        self.commit(&[(handle, bonus)])?;
        Ok(Verified { accepted, bonus })
    }
}
