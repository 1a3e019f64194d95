//! `BranchStore`: operations over many branches of a locked context — batched commit, packed
//! prefill, produce_all, retain_only, dispose_all — and KV pressure. Each validates, plans,
//! executes, then publishes — a failure leaves every branch exactly as it was.

use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::ledger::KvPressure;
use crate::packing::plan;
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

    pub(crate) fn check_room(&self, needed: usize) -> Result<()> {
        let free = (self.shape().n_ctx as usize).saturating_sub(self.ledger.cells_used());
        if needed > free {
            return Err(LloyalError::KvCacheFull {
                needed,
                n_ctx: self.shape().n_ctx,
                detail: format!("branches hold {} cells, {free} free", self.ledger.cells_used()),
            });
        }
        Ok(())
    }

    /// Like `check_room`, with `reserved` cells promised to operations the engine is running.
    pub(crate) fn check_room_reserved(&self, needed: usize, reserved: usize) -> Result<()> {
        if reserved == 0 {
            return self.check_room(needed);
        }
        let free = (self.shape().n_ctx as usize).saturating_sub(self.ledger.cells_used() + reserved);
        if needed > free {
            return Err(LloyalError::KvCacheFull {
                needed,
                n_ctx: self.shape().n_ctx,
                detail: format!(
                    "branches hold {} cells and operations in progress {reserved} more, {free} free",
                    self.ledger.cells_used()
                ),
            });
        }
        Ok(())
    }

    /// Dispose every branch (used by close and by `retain_only`'s losers).
    pub fn dispose_all(&mut self) {
        for h in self.branches.handles() {
            if let Some(b) = self.branches.remove(h) {
                self.remove_cells(b.seq_id, -1, -1);
            }
        }
        self.topology = Default::default();
        self.ledger.reset(&[], 0);
        self.reclaim_parked();
    }

    /// `retain_only(winner)`: one `seq_keep`; every other branch disposed; winner becomes a root.
    /// In a batch-invariant context the winner's cells are then rewritten in position order
    /// (one copy of its KV) so its next tokens do not land in freed cells ahead of its own.
    pub fn retain_only(&mut self, winner: Handle) -> Result<()> {
        let seq = self.branch(winner)?.seq_id;
        let raw = self.raw_mut();
        raw.seq_keep(seq);
        let (p_min, p_max) = (raw.seq_pos_min(seq), raw.seq_pos_max(seq));
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
        if p_max >= 0 && self.batch_invariant {
            if let Err(e) = self.compact_seq(seq) {
                // Cannot happen short of a llama.cpp fault (the cache is empty when the cells
                // are written back); leave no branch whose KV no longer matches it.
                self.dispose_all();
                return Err(e);
            }
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

    /// `BranchStore.commit`: accept + decode one token per branch in one `llama_decode`
    /// (more only when N > n_batch), capturing each branch's logits. All-or-nothing.
    pub fn commit(&mut self, pairs: &[(Handle, i32)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let model = self.model();
        for &(h, t) in pairs {
            self.branch(h)?;
            model.check_token(i64::from(t))?;
        }
        Self::check_unique(pairs.iter().map(|p| p.0))?;
        for &(h, t) in pairs {
            self.branch_mut(h)?.check_grammar(t)?;
        }
        self.check_room(pairs.len())?;

        let n_batch = self.shape().n_batch as usize;
        let mut surprisals = Vec::with_capacity(pairs.len());
        for (c, chunk) in pairs.chunks(n_batch).enumerate() {
            self.batch_mut().clear();
            for &(h, t) in chunk {
                let b = self.branch(h)?;
                let (seq, pos) = (b.seq_id, b.position);
                self.batch_mut().push(t, pos, seq, true);
            }
            if let Err(e) = self.run_batch() {
                for &(h, _) in &pairs[..c * n_batch] {
                    let (seq, pos) = self.branch(h).map(|b| (b.seq_id, b.position))?;
                    self.remove_cells(seq, pos, -1);
                }
                return Err(e);
            }
            for (row, &(h, t)) in chunk.iter().enumerate() {
                surprisals.push(self.branch(h)?.surprisals(t));
                self.fill_next_logits(row as i32, h)?;
            }
        }
        for (&(h, t), s) in pairs.iter().zip(surprisals) {
            let b = self.branch_mut(h)?;
            b.accept_with(t, s);
            b.position += 1;
            b.publish_logits();
        }
        self.ledger.grow_cells(pairs.len());
        Ok(())
    }

    /// `BranchStore.prefill`: write each branch's tokens (no accept), packed into
    /// `ceil(total / n_batch)` decodes, logits kept for each branch's last token. All-or-nothing.
    pub fn prefill(&mut self, items: &[(Handle, Vec<i32>)]) -> Result<()> {
        let model = self.model();
        for (h, tokens) in items {
            self.branch(*h)?;
            model.check_tokens(tokens)?;
        }
        Self::check_unique(items.iter().map(|i| i.0))?;
        let lens: Vec<usize> = items.iter().map(|(_, t)| t.len()).collect();
        let total: usize = lens.iter().sum();
        if total == 0 {
            return Ok(());
        }
        self.check_room(total)?;
        let starts: Vec<(i32, i32)> = items
            .iter()
            .map(|(h, _)| self.branch(*h).map(|b| (b.seq_id, b.position)))
            .collect::<Result<_>>()?;

        for chunk in plan(&lens, self.shape().n_batch as usize) {
            self.batch_mut().clear();
            let mut logit_rows = Vec::new();
            for piece in &chunk {
                let (seq, pos0) = starts[piece.item];
                let tokens = &items[piece.item].1;
                for i in piece.start..piece.end {
                    let last = i + 1 == tokens.len();
                    if last {
                        logit_rows.push((self.batch_mut().len() as i32, items[piece.item].0));
                    }
                    self.batch_mut().push(tokens[i], pos0 + i as i32, seq, last);
                }
            }
            let result = self.run_batch().and_then(|()| {
                for &(row, h) in &logit_rows {
                    self.fill_next_logits(row, h)?;
                }
                Ok(())
            });
            if let Err(e) = result {
                for &(seq, pos0) in &starts {
                    self.remove_cells(seq, pos0, -1);
                }
                return Err(e);
            }
        }
        for ((h, tokens), _) in items.iter().zip(&starts) {
            if tokens.is_empty() {
                continue;
            }
            let b = self.branch_mut(*h)?;
            b.position += tokens.len() as i32;
            b.publish_logits();
        }
        self.ledger.grow_cells(total);
        Ok(())
    }
}
