//! Branch operations on a locked context: create/fork/prune (tenancy + topology), batched
//! commit and packed prefill. Each validates, plans, executes, then publishes — a failure
//! leaves every branch exactly as it was.

use std::sync::Arc;

use crate::branch::BranchState;
use crate::context::ContextState;
use crate::error::{LloyalError, Result};
use crate::grammar::Grammar;
use crate::metrics::{entropy, surprisal, Base};
use crate::packing::plan;
use crate::sampler::Sampler;
use crate::sampling::SamplingParams;
use crate::tenancy::Handle;

/// KV occupancy by branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPressure {
    pub n_ctx: u32,
    pub cells_used: usize,
    pub remaining: usize,
}

/// A read-only view of one branch for the glue.
#[derive(Debug, Clone, PartialEq)]
pub struct BranchInfo {
    pub seq_id: i32,
    pub position: i32,
    pub fork_head: i32,
    pub perplexity: f64,
    pub sampling_perplexity: f64,
    pub parent: Option<Handle>,
    pub children: Vec<Handle>,
}

impl ContextState {
    fn disposed(handle: Handle) -> LloyalError {
        LloyalError::BranchDisposed { handle }
    }

    /// The live branch behind `handle`.
    pub fn branch(&self, handle: Handle) -> Result<&BranchState> {
        self.branches.get(handle).ok_or_else(|| Self::disposed(handle))
    }

    /// The live branch behind `handle`, mutably.
    pub fn branch_mut(&mut self, handle: Handle) -> Result<&mut BranchState> {
        self.branches.get_mut(handle).ok_or_else(|| Self::disposed(handle))
    }

    /// Whether `handle` is a live branch.
    pub fn is_live(&self, handle: Handle) -> bool {
        self.branches.contains(handle)
    }

    /// Summary of a live branch.
    pub fn branch_info(&self, handle: Handle) -> Result<BranchInfo> {
        let b = self.branch(handle)?;
        Ok(BranchInfo {
            seq_id: b.seq_id,
            position: b.position,
            fork_head: b.fork_head,
            perplexity: b.perplexity(),
            sampling_perplexity: b.sampling_perplexity(),
            parent: self.topology.parent(handle),
            children: self.topology.children(handle).to_vec(),
        })
    }

    pub(crate) fn lease_exhausted(&self) -> LloyalError {
        LloyalError::LeaseExhausted { n_seq_max: self.leases.n_seq_max(), live: self.leases.live() }
    }

    /// Free leases.
    pub fn available(&self) -> u32 {
        self.leases.available()
    }

    /// Cells held by branches and what is left of `n_ctx`.
    pub fn kv_pressure(&self) -> KvPressure {
        let n_ctx = self.shape().n_ctx;
        KvPressure {
            n_ctx,
            cells_used: self.cells_used,
            remaining: (n_ctx as usize).saturating_sub(self.cells_used),
        }
    }

    pub(crate) fn check_room(&self, needed: usize) -> Result<()> {
        let free = (self.shape().n_ctx as usize).saturating_sub(self.cells_used);
        if needed > free {
            return Err(LloyalError::KvCacheFull {
                needed,
                n_ctx: self.shape().n_ctx,
                detail: format!("branches hold {} cells, {free} free", self.cells_used),
            });
        }
        Ok(())
    }

    /// `Branch.create`: take a lease (its sequence emptied first) and start a root at `position`.
    pub fn branch_create(&mut self, position: i32, params: SamplingParams) -> Result<Handle> {
        if position < 0 {
            return Err(LloyalError::invalid(format!("position must be >= 0, got {position}")));
        }
        let model = self.model();
        let sampler = Sampler::new(&model, params)?;
        let seq = self.leases.acquire().ok_or_else(|| self.lease_exhausted())?;
        self.remove_cells(seq, -1, -1);
        let handle = self.branches.insert(BranchState::new(seq, position, sampler));
        self.topology.add(handle, None);
        Ok(handle)
    }

    /// `Branch.fork`: a child sharing the parent's KV prefix (metadata copy, 0 new cells).
    pub fn branch_fork(&mut self, parent: Handle, clone_logits: bool) -> Result<Handle> {
        self.branch(parent)?;
        let seq = self.leases.acquire().ok_or_else(|| self.lease_exhausted())?;
        let child = match self.branch(parent).and_then(|p| p.fork(seq, clone_logits)) {
            Ok(c) => c,
            Err(e) => {
                self.leases.release(seq);
                return Err(e);
            }
        };
        let parent_seq = self.branch(parent)?.seq_id;
        self.remove_cells(seq, -1, -1);
        let mem = self.raw_mut().memory();
        // SAFETY: valid memory; both seq ids are leases (< n_seq_max); unified KV shares cells.
        unsafe { llama_cpp_sys_2::llama_memory_seq_cp(mem, parent_seq, seq, -1, -1) };
        let handle = self.branches.insert(child);
        self.topology.add(handle, Some(parent));
        Ok(handle)
    }

    fn dispose(&mut self, handle: Handle) {
        if let Some(b) = self.branches.remove(handle) {
            self.remove_cells(b.seq_id, -1, -1);
            self.cells_used = self.cells_used.saturating_sub((b.position - b.fork_head).max(0) as usize);
            self.leases.release(b.seq_id);
            self.topology.remove(handle);
        }
    }

    /// `prune()` (RESTRICT): refuse while children live; idempotent on a disposed handle.
    pub fn branch_prune(&mut self, handle: Handle) -> Result<()> {
        if !self.is_live(handle) {
            return Ok(());
        }
        let children = self.topology.children(handle);
        if !children.is_empty() {
            let names: Vec<String> = children.iter().map(|c| c.to_string()).collect();
            return Err(LloyalError::Topology(format!(
                "cannot prune branch {handle}: it has {} live children (handles {}); prune them first \
                 or use prune_subtree()",
                names.len(),
                names.join(", ")
            )));
        }
        self.dispose(handle);
        Ok(())
    }

    /// `prune_subtree()` (CASCADE): children before parents; idempotent.
    pub fn branch_prune_subtree(&mut self, handle: Handle) -> Result<()> {
        if !self.is_live(handle) {
            return Ok(());
        }
        for h in self.topology.post_order(handle) {
            self.dispose(h);
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
        self.leases.rebuild(&[]);
        self.cells_used = 0;
    }

    /// `retain_only(winner)`: one `seq_keep`; every other branch disposed; winner becomes a root.
    /// In a batch-invariant context the winner's cells are then rewritten in position order
    /// (one copy of its KV) so its next tokens do not land in freed cells ahead of its own.
    pub fn retain_only(&mut self, winner: Handle) -> Result<()> {
        let seq = self.branch(winner)?.seq_id;
        let mem = self.raw_mut().memory();
        // SAFETY: valid memory; seq is a lease id.
        let (p_min, p_max) = unsafe {
            llama_cpp_sys_2::llama_memory_seq_keep(mem, seq);
            (
                llama_cpp_sys_2::llama_memory_seq_pos_min(mem, seq),
                llama_cpp_sys_2::llama_memory_seq_pos_max(mem, seq),
            )
        };
        for h in self.branches.handles() {
            if h != winner {
                self.branches.remove(h);
            }
        }
        self.topology.retain_only(winner);
        self.leases.rebuild(&[seq]);
        let b = self.branch_mut(winner)?;
        b.fork_head = if p_max >= 0 { p_min } else { b.position };
        self.cells_used = if p_max >= 0 { (p_max - p_min + 1) as usize } else { 0 };
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

    /// `produce()`: the token this branch would sample now (no state change; idempotent).
    pub fn branch_produce(&mut self, handle: Handle) -> Result<i32> {
        self.branch_mut(handle)?.produce()
    }

    /// `produce_all`: produce for every handle in one call.
    pub fn produce_all(&mut self, handles: &[Handle]) -> Result<Vec<i32>> {
        for &h in handles {
            self.branch(h)?.logits()?;
        }
        handles.iter().map(|&h| self.branch_produce(h)).collect()
    }

    /// `accept(token)`: update sampler history and metrics without decoding.
    pub fn branch_accept(&mut self, handle: Handle, token: i32) -> Result<()> {
        self.model().check_token(i64::from(token))?;
        let b = self.branch_mut(handle)?;
        b.check_grammar(token)?;
        let s = b.surprisals(token);
        b.accept_with(token, s);
        Ok(())
    }

    fn check_unique(handles: impl Iterator<Item = Handle>) -> Result<()> {
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
                let mut next = std::mem::take(&mut self.branch_mut(h)?.next_logits);
                let copied = self.copy_logits_into(row as i32, &mut next);
                self.branch_mut(h)?.next_logits = next;
                copied?;
            }
        }
        for (&(h, t), s) in pairs.iter().zip(surprisals) {
            let b = self.branch_mut(h)?;
            b.accept_with(t, s);
            b.position += 1;
            b.publish_logits();
        }
        self.cells_used += pairs.len();
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
                    let mut next = std::mem::take(&mut self.branch_mut(h)?.next_logits);
                    let copied = self.copy_logits_into(row, &mut next);
                    self.branch_mut(h)?.next_logits = next;
                    copied?;
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
        self.cells_used += total;
        Ok(())
    }

    /// Replace a branch's sampler parameters (history kept; no-op if unchanged).
    /// A branch's current sampling parameters.
    pub fn branch_params(&self, handle: Handle) -> Result<SamplingParams> {
        Ok(self.branch(handle)?.sampler.params().clone())
    }

    pub fn branch_set_params(&mut self, handle: Handle, params: SamplingParams) -> Result<()> {
        let model = self.model();
        let b = self.branch_mut(handle)?;
        b.sampler.set_params(&model, params)?;
        b.invalidate();
        Ok(())
    }

    /// Restart a branch's RNG with `seed`.
    pub fn branch_reseed_sampler(&mut self, handle: Handle, seed: u32) -> Result<()> {
        let model = self.model();
        let b = self.branch_mut(handle)?;
        b.sampler.reseed(&model, seed)?;
        b.invalidate();
        Ok(())
    }

    fn check_bias(&self, bias: &[(i32, f32)]) -> Result<()> {
        let model = self.model();
        for &(t, b) in bias {
            model.check_token(i64::from(t))?;
            if b.is_nan() || b == f32::INFINITY {
                return Err(LloyalError::invalid(format!(
                    "bias for token {t} must be finite or -inf, got {b}"
                )));
            }
        }
        Ok(())
    }

    /// Set the inherited logit bias (replaces the previous one).
    pub fn branch_set_logit_bias(&mut self, handle: Handle, bias: Vec<(i32, f32)>) -> Result<()> {
        self.check_bias(&bias)?;
        let b = self.branch_mut(handle)?;
        b.logit_bias = bias;
        b.invalidate();
        Ok(())
    }

    /// Set per-branch steering (not inherited by forks).
    pub fn branch_steer(&mut self, handle: Handle, bias: Vec<(i32, f32)>) -> Result<()> {
        self.check_bias(&bias)?;
        let b = self.branch_mut(handle)?;
        b.steer = bias;
        b.invalidate();
        Ok(())
    }

    /// Replace the logits snapshot.
    pub fn branch_set_logits(&mut self, handle: Handle, logits: Vec<f32>) -> Result<()> {
        let n_vocab = self.shape().n_vocab as usize;
        if logits.len() != n_vocab {
            return Err(LloyalError::invalid(format!(
                "logits must have shape ({n_vocab},), got ({},)",
                logits.len()
            )));
        }
        if logits.iter().any(|x| x.is_nan()) {
            return Err(LloyalError::invalid("logits must not contain NaN"));
        }
        let b = self.branch_mut(handle)?;
        b.logits = Arc::new(logits);
        b.invalidate();
        Ok(())
    }

    /// Entropy of a branch's next-token distribution.
    pub fn branch_entropy(&self, handle: Handle, base: Base) -> Result<f64> {
        Ok(entropy(self.branch(handle)?.logits()?, base))
    }

    /// Surprisal of `token` under a branch's logits.
    pub fn branch_surprisal(&self, handle: Handle, token: i32, base: Base) -> Result<f64> {
        self.model().check_token(i64::from(token))?;
        Ok(surprisal(self.branch(handle)?.logits()?, token as usize, base))
    }

    /// `set_grammar`: replace (or with `None` remove) the branch's grammar.
    pub fn branch_set_grammar(&mut self, handle: Handle, grammar: Option<Grammar>) -> Result<()> {
        let b = self.branch_mut(handle)?;
        b.grammar = grammar;
        b.invalidate();
        Ok(())
    }

    /// How many sampled tokens the branch's grammar rejected (each needed a full mask).
    pub fn branch_grammar_resamples(&self, handle: Handle) -> Result<u64> {
        Ok(self.branch(handle)?.grammar_resamples)
    }

    /// The branch's most recently accepted token (`None` before any).
    pub fn branch_last_token(&self, handle: Handle) -> Result<Option<i32>> {
        Ok(self.branch(handle)?.sampler.history().last().copied())
    }
}
