//! BlinkKV: rebuild a sequence from attention sinks plus a recent tail, so a stream can run
//! past `n_ctx` (`clear_and_reseed` on the flat path, `reseed` per branch).
//!
//! A branch's reseed is engine work ([`crate::engine`]): [`ContextState::reseed_begin`] frees
//! (or parks) the branch's cells and leaves it empty at position 0, the engine prefills the new
//! tokens like any prefill (chunked, beside other callers' rows), and
//! [`ContextState::reseed_end`] then releases the parked cells, or puts them back when the
//! prefill failed.

use std::sync::Arc;

use super::logits::Logits;
use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

/// A reseed in progress: its branch's sequence and how to undo it.
pub(crate) struct Reseeding {
    /// The branch's sequence, which the prefill writes from position 0.
    pub(crate) seq: i32,
    /// The lease the old cells are parked on, when one was free and there was room for both.
    parking: Option<i32>,
    position: i32,
    fork_head: i32,
    /// The old snapshot, copied out of llama.cpp's buffer (kept across the prefill).
    logits: Arc<Logits>,
}

impl ContextState {
    /// `clear_and_reseed(sinks, tail)`: clear the cache, decode `sinks` at position 0 and
    /// `tail` right after them on seq 0. The flat sampler's history is kept. Refused while a
    /// branch holds a sequence (branches use `Branch.reseed`).
    pub fn clear_and_reseed(&mut self, sinks: &[i32], tail: &[i32]) -> Result<i32> {
        let tokens: Vec<i32> = sinks.iter().chain(tail).copied().collect();
        self.model().check_tokens(&tokens)?;
        if tokens.is_empty() {
            return Err(LloyalError::invalid("clear_and_reseed needs at least one sink or tail token"));
        }
        if tokens.len() > self.shape().n_ctx as usize {
            // before the clear: a call that cannot succeed changes nothing
            return Err(LloyalError::KvCacheFull {
                needed: tokens.len(),
                n_ctx: self.shape().n_ctx,
                detail: "more sink and tail tokens than the whole cache holds".into(),
            });
        }
        self.kv_clear()?;
        self.decode(&tokens, 0, 0)?;
        Ok(tokens.len() as i32)
    }

    /// Start `Branch.reseed(sinks, tail)`: this branch's own sequence is to hold `sinks + tail`
    /// at positions `0..n`; sampler history and metrics are kept. Refused while children live
    /// (they share its cells), and without room for the new cells once the branch's own are
    /// freed (next to `reserved` cells promised to operations in progress).
    ///
    /// All-or-nothing when it can be: with a lease free and room for the new cells next to the
    /// old ones, the old cells are parked on that lease (a metadata copy) and restored if the
    /// prefill fails. Otherwise (the usual BlinkKV case: the cache is nearly full) the old cells
    /// are freed here, and a failed prefill (an interrupt, a backend error) leaves the branch
    /// empty at position 0.
    /// Returns `sinks + tail` (what the prefill writes) and the reseed in progress.
    pub(crate) fn reseed_begin(
        &mut self,
        handle: Handle,
        sinks: &[i32],
        tail: &[i32],
        reserved: usize,
    ) -> Result<(Vec<i32>, Reseeding)> {
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
        let held = self.ledger.cells_used() + self.flat_cells + reserved;
        if held - own + tokens.len() > n_ctx {
            return Err(LloyalError::KvCacheFull {
                needed: tokens.len(),
                n_ctx: self.shape().n_ctx,
                detail: format!(
                    "branches{} (and operations in progress) would hold {} cells",
                    if self.flat_cells > 0 { ", sequences no branch holds" } else { "" },
                    held - own + tokens.len()
                ),
            });
        }
        // Parking keeps the old cells occupied while the new ones are written.
        let parking =
            if held + tokens.len() <= n_ctx { self.ledger.take_lease(&mut self.raw).ok() } else { None };
        match parking {
            Some(p) => {
                self.copy_seq(seq, p);
                self.ledger.park(p, own); // still counted: other operations cannot take them
            }
            None => self.ledger.free_cells(own),
        }
        self.remove_cells(seq, -1, -1);
        let logits = Logits::share(&std::mem::take(&mut self.branch_mut(handle)?.logits));
        let b = self.branch_mut(handle)?;
        b.position = 0;
        b.fork_head = 0;
        Ok((tokens, Reseeding { seq, parking, position, fork_head, logits }))
    }

    /// Finish a reseed whose prefill `succeeded` (the branch holds the new tokens) or failed
    /// (its written cells are already removed: `rollback_flight`): the parked cells released,
    /// or put back. A branch disposed meanwhile only gives its parking lease back.
    pub(crate) fn reseed_end(&mut self, handle: Handle, r: Reseeding, succeeded: bool) {
        if succeeded {
            // decoded afresh: every sliding-window cell is there
            crate::cache::lock(&self.cache).set_exact_from(handle, 0);
        }
        let Some(p) = r.parking else { return };
        // None: the ledger was reset meanwhile (`retain_only`), which dropped the parked cells.
        let Some(parked) = self.ledger.unpark(p) else { return };
        match self.branch_mut(handle) {
            Ok(b) if !succeeded => {
                // The old cells go back to the branch (still counted).
                b.position = r.position;
                b.fork_head = r.fork_head;
                b.logits = r.logits;
                self.copy_seq(p, r.seq);
            }
            _ => self.ledger.free_cells(parked),
        }
        self.remove_cells(p, -1, -1);
        self.ledger.return_lease(p);
    }

    fn copy_seq(&mut self, src: i32, dst: i32) {
        // Unified KV shares the cells: no tensor copy.
        self.raw_mut().seq_cp(src, dst, -1, -1);
    }
}
