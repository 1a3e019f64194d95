//! BlinkKV: rebuild a sequence from attention sinks plus a recent tail, so a stream can run
//! past `n_ctx` (`clear_and_reseed` on the flat path, `reseed` per branch).

use super::logits::Logits;
use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

impl ContextState {
    /// `clear_and_reseed(sinks, tail)`: clear the cache, decode `sinks` at position 0 and
    /// `tail` right after them on seq 0. The flat sampler's history is kept. Refused while a
    /// branch holds a sequence (branches use [`ContextState::branch_reseed`]).
    pub fn clear_and_reseed(&mut self, sinks: &[i32], tail: &[i32]) -> Result<i32> {
        let tokens: Vec<i32> = sinks.iter().chain(tail).copied().collect();
        self.model().check_tokens(&tokens)?;
        if tokens.is_empty() {
            return Err(LloyalError::invalid("clear_and_reseed needs at least one sink or tail token"));
        }
        self.kv_clear()?;
        self.decode(&tokens, 0, 0)?;
        Ok(tokens.len() as i32)
    }

    /// `Branch.reseed(sinks, tail)`: replace this branch's own sequence with `sinks + tail` at
    /// positions `0..n`; sampler history and metrics are kept. Refused while children live
    /// (they share its cells). Needs room for the new cells once the branch's own are freed.
    ///
    /// All-or-nothing when it can be: with a lease free and room for the new cells next to
    /// the old ones, the old cells are parked on that lease (a metadata copy) and restored if
    /// the decode fails. Otherwise (the usual BlinkKV case: the cache is nearly full) the old
    /// cells are freed first, and a failed decode (an interrupt, a backend error) leaves the
    /// branch empty at position 0.
    pub fn branch_reseed(&mut self, handle: Handle, sinks: &[i32], tail: &[i32]) -> Result<i32> {
        let tokens: Vec<i32> = sinks.iter().chain(tail).copied().collect();
        self.model().check_tokens(&tokens)?;
        if tokens.is_empty() {
            return Err(LloyalError::invalid("reseed needs at least one sink or tail token"));
        }
        let (seq, position, fork_head) = self.branch(handle).map(|b| (b.seq_id, b.position, b.fork_head))?;
        if !self.topology.children(handle).is_empty() {
            return Err(LloyalError::Topology(format!(
                "cannot reseed branch {handle} while it has live children (they share its cells); prune them first"
            )));
        }
        let own = (position - fork_head).max(0) as usize;
        let n_ctx = self.shape().n_ctx as usize;
        if self.ledger.cells_used() - own + tokens.len() > n_ctx {
            return Err(LloyalError::KvCacheFull {
                needed: tokens.len(),
                n_ctx: self.shape().n_ctx,
                detail: format!(
                    "branches would hold {} cells",
                    self.ledger.cells_used() - own + tokens.len()
                ),
            });
        }
        // Parking keeps the old cells occupied while the new ones are written.
        let parking = if self.ledger.cells_used() + tokens.len() <= n_ctx {
            self.ledger.take_lease(&mut self.raw).ok()
        } else {
            None
        };
        if let Some(p) = parking {
            self.copy_seq(seq, p);
        }
        self.remove_cells(seq, -1, -1);
        // Kept across the prefill below, so copied out of llama.cpp's buffer first.
        let old_logits = Logits::share(&std::mem::take(&mut self.branch_mut(handle)?.logits));
        {
            let b = self.branch_mut(handle)?;
            b.position = 0;
            b.fork_head = 0;
        }
        self.ledger.free_cells(own);
        let result = self.prefill(&[(handle, tokens.clone())]);
        if let Err(e) = result {
            self.remove_cells(seq, -1, -1);
            let b = self.branch_mut(handle)?;
            if let Some(p) = parking {
                b.position = position;
                b.fork_head = fork_head;
                b.logits = old_logits;
                self.copy_seq(p, seq);
                self.ledger.grow_cells(own);
            }
            if let Some(p) = parking {
                self.remove_cells(p, -1, -1);
                self.ledger.return_lease(p);
            }
            return Err(e);
        }
        if let Some(p) = parking {
            self.remove_cells(p, -1, -1);
            self.ledger.return_lease(p);
        }
        Ok(tokens.len() as i32)
    }

    fn copy_seq(&mut self, src: i32, dst: i32) {
        // Unified KV shares the cells: no tensor copy.
        self.raw_mut().seq_cp(src, dst, -1, -1);
    }
}
