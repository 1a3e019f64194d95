//! `BranchStore`'s operations over many branches of a locked context — produce_all,
//! retain_only, dispose_all — and room in the cache. Commit and prefill run on the engine's
//! path (`engine::tick`). Each validates first: a failure leaves every branch as it was.

use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::ledger::KvPressure;
use crate::tenancy::Handle;

impl ContextState {
    /// Free leases.
    pub fn available(&self) -> u32 {
        self.ledger.leases().available()
    }

    /// Leases in all (the context's `n_seq_max`).
    pub fn lease_count(&self) -> u32 {
        self.ledger.leases().n_seq_max()
    }

    /// Cells held by branches and what is left of `n_ctx`.
    pub fn kv_pressure(&self) -> KvPressure {
        self.ledger.pressure(self.shape().n_ctx, self.parked)
    }

    /// Cells of `n_ctx` left after what branches hold, what sequences no branch holds keep
    /// ([`Self::note_flat_cells`]) and `reserved` more.
    pub(crate) fn room(&self, reserved: usize) -> usize {
        (self.shape().n_ctx as usize).saturating_sub(self.ledger.cells_used() + self.flat_cells + reserved)
    }

    /// Count again the cells sequences no branch holds keep: flat-path decodes, copies and
    /// loaded states on free leases, which a check of room against the branches' cells alone
    /// missed (a reseed then freed its branch's cells and failed to write the new ones). Each
    /// sequence counts its span of positions: copies among such sequences count twice.
    pub(crate) fn note_flat_cells(&mut self) {
        if !self.count_flat {
            self.flat_cells = 0;
            return;
        }
        let free: Vec<i32> = self.ledger.leases().free_ids().to_vec();
        self.flat_cells = free
            .into_iter()
            .map(|seq| match self.raw.seq_pos_max(seq) {
                max if max < 0 => 0,
                max => (max - self.raw.seq_pos_min(seq).max(0) + 1) as usize,
            })
            .sum();
    }

    /// What holds the cache, for a `KvCacheFull` message.
    fn holders(&self) -> String {
        match self.flat_cells {
            0 => format!("branches hold {} cells", self.ledger.cells_used()),
            flat => format!(
                "branches hold {} cells and sequences no branch holds (flat-path decodes, copies) {flat}",
                self.ledger.cells_used()
            ),
        }
    }

    pub(crate) fn check_room(&self, needed: usize) -> Result<()> {
        let free = self.room(0);
        if needed > free {
            return Err(LloyalError::KvCacheFull {
                needed,
                n_ctx: self.shape().n_ctx,
                detail: format!("{}, {free} free", self.holders()),
            });
        }
        Ok(())
    }

    /// Like `check_room`, with `reserved` cells promised to operations the engine is running.
    pub(crate) fn check_room_reserved(&self, needed: usize, reserved: usize) -> Result<()> {
        if reserved == 0 {
            return self.check_room(needed);
        }
        let free = self.room(reserved);
        if needed > free {
            return Err(LloyalError::KvCacheFull {
                needed,
                n_ctx: self.shape().n_ctx,
                detail: format!("{}, operations in progress {reserved} more, {free} free", self.holders()),
            });
        }
        Ok(())
    }

    /// Dispose every branch (used by close and by `retain_only`'s losers), and the cells a
    /// reseed in flight parked.
    pub fn dispose_all(&mut self) {
        for h in self.branches.handles() {
            if let Some(b) = self.branches.remove(h) {
                self.remove_cells(b.seq_id, -1, -1);
            }
        }
        for p in self.ledger.parked_seqs() {
            self.remove_cells(p, -1, -1);
        }
        self.topology = Default::default();
        crate::cache::lock(self.prefix_index()).take_all();
        self.ledger.reset(&[], 0);
        self.reclaim_parked();
    }

    /// `retain_only(winner)`: one `seq_keep`; every other branch disposed; winner becomes a root.
    /// In a batch-invariant context the winner's cells are then rewritten in position order
    /// (one copy of its KV) so its next tokens do not land in freed cells ahead of its own.
    pub fn retain_only(&mut self, winner: Handle) -> Result<()> {
        let seq = self.branch(winner)?.seq_id;
        // Where the winner's sequence starts: its tree's root's first cell (not
        // seq_pos_min, which answers from the sliding-window cache: state::window).
        let mut root = winner;
        while let Some(p) = self.topology.parent(root) {
            root = p;
        }
        let start = self.branch(root)?.fork_head;
        let exact_from = self.fork_exact_from(winner);
        let raw = self.raw_mut();
        raw.seq_keep(seq);
        let p_max = raw.seq_pos_max(seq);
        let p_min = start.min(p_max.max(0));
        self.forget_parked();
        for h in self.branches.handles() {
            if h != winner {
                self.branches.remove(h);
            }
        }
        self.topology.retain_only(winner);
        self.ledger.reset(&[seq], if p_max >= 0 { (p_max - p_min + 1) as usize } else { 0 });
        let b = self.branch_mut(winner)?;
        b.fork_head = if p_max >= 0 { p_min } else { b.position };
        crate::cache::lock(&self.cache).retain_exact_from(winner, exact_from);
        if p_max >= 0 && self.batch_invariant {
            if let Err(e) = self.compact_seq(seq) {
                // Cannot happen short of a llama.cpp fault (the cache is empty when the cells
                // are written back); leave no branch whose KV no longer matches it.
                self.dispose_all();
                return Err(e);
            }
            self.note_window(winner, seq, p_min); // rewritten from its state
        }
        Ok(())
    }

    /// `produce_all`: produce for every handle in one call.
    pub fn produce_all(&mut self, handles: &[Handle]) -> Result<Vec<i32>> {
        for &h in handles {
            self.branch(h)?.logits()?;
        }
        handles.iter().map(|&h| self.branch_produce(h)).collect()
    }

    pub(crate) fn check_unique(handles: impl Iterator<Item = Handle>) -> Result<()> {
        let mut seen: Vec<Handle> = handles.collect();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(LloyalError::invalid(format!(
                "branch {} appears twice in one call; give each branch at most one entry",
                w[0]
            )));
        }
        Ok(())
    }
}
