//! Single-branch operations on a locked context: create, fork, prune, produce, accept, the
//! `set_*` setters and per-branch reads. Multi-branch work (commit, prefill, retain_only)
//! lives in [`crate::store`].

use std::sync::Arc;

use parking_lot::Mutex;

use crate::branch::{BranchState, Logits};
use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::grammar::Grammar;
use crate::metrics::{entropy, Base};
use crate::model::Model;
use crate::sampler::Sampler;
use crate::sampling::SamplingParams;

/// The furthest position a branch may start at (`Branch.create`): far beyond any context's
/// cells, and far enough below `i32::MAX` that positions, which grow by a cell a token, never
/// wrap round.
pub const MAX_START: i32 = 1 << 30;
use crate::tenancy::Handle;

/// A read-only view of one branch for the glue.
#[derive(Debug, Clone, PartialEq)]
pub struct BranchInfo {
    pub seq_id: i32,
    pub position: i32,
    pub fork_head: i32,
    pub perplexity: f64,
    /// `None` when the context does not track it.
    pub sampling_perplexity: Option<f64>,
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
            sampling_perplexity: b.sampling_perplexity().ok(),
            parent: self.topology.parent(handle),
            children: self.topology.children(handle).to_vec(),
        })
    }

    /// `Branch.create`: take a lease (an empty sequence; ids holding flat-path cells are
    /// skipped, see [`ContextState::take_lease`]) and start a root at `position`.
    pub fn branch_create(&mut self, position: i32, params: SamplingParams) -> Result<Handle> {
        if !(0..=MAX_START).contains(&position) {
            return Err(LloyalError::invalid(format!(
                "position must be in [0, {MAX_START}], got {position}: a branch starts where its \
                 sequence's cells end (0 for a new one)"
            )));
        }
        let model = self.model();
        let sampler = Sampler::new(&model, params)?;
        self.cache_make_room(1, 0, 0, &[]);
        let seq = self.ledger.take_lease(&mut self.raw)?;
        let handle = self.branches.insert(BranchState::new(seq, position, sampler, self.sampling_perplexity));
        self.topology.add(handle, None);
        Ok(handle)
    }

    /// `Branch.fork`: a child sharing the parent's KV prefix (metadata copy, 0 new cells).
    pub fn branch_fork(&mut self, parent: Handle, clone_logits: bool) -> Result<Handle> {
        self.branch_fork_at(parent, clone_logits, None)
    }

    /// `fork(at=)`: with `Some(at)` below the parent's position, the child shares only the
    /// first `at` positions (`BranchState::fork_at`); `Some(position)` or `None` is `fork`.
    pub fn branch_fork_at(&mut self, parent: Handle, clone_logits: bool, at: Option<i32>) -> Result<Handle> {
        let position = self.branch(parent)?.position;
        let at = match at {
            Some(a) if a < 1 || a > position => {
                return Err(LloyalError::InvalidArgument(format!(
                    "fork(at={a}): at must be in [1, {position}] (the parent's position); a fork shares \
                     the parent's first `at` positions"
                )))
            }
            Some(a) if a < position => Some(a),
            _ => None,
        };
        let exact_from = self.fork_exact_from(parent);
        if let Some(a) = at.filter(|&a| (a as usize) < exact_from) {
            return Err(LloyalError::InvalidArgument(format!(
                "fork(at={a}): this branch's sequence was written back from a saved state (a loaded \
                 branch, a copy from host memory, or a fork of one), for which llama.cpp keeps only \
                 the last {} positions of the sliding-window layers' cells, so a fork continues \
                 exactly only at {exact_from} or later; fork there, or prefill the prefix again",
                self.model().n_swa()
            )));
        }
        self.cache_make_room(1, 0, 0, &[parent]);
        let seq = self.ledger.take_lease(&mut self.raw)?;
        let made = self.branch(parent).and_then(|p| match at {
            Some(a) => p.fork_at(seq, a),
            None => p.fork(seq, clone_logits),
        });
        let child = match made {
            Ok(c) => c,
            Err(e) => {
                self.ledger.return_lease(seq);
                return Err(e);
            }
        };
        let parent_seq = self.branch(parent)?.seq_id;
        // Unified KV shares the cells: no tensor copy.
        self.raw_mut().seq_cp(parent_seq, seq, -1, at.unwrap_or(-1));
        let handle = self.branches.insert(child);
        self.topology.add(handle, Some(parent));
        if exact_from > 0 {
            crate::cache::lock(&self.cache).set_exact_from(handle, exact_from);
        }
        Ok(handle)
    }

    fn dispose(&mut self, handle: Handle) {
        if let Some(b) = self.branches.remove(handle) {
            // Its own cells [fork_head, position) are held by no other sequence: park them.
            self.park_cells(b.seq_id, b.fork_head, b.position);
            self.remove_cells(b.seq_id, -1, -1);
            self.ledger.free_cells((b.position - b.fork_head).max(0) as usize);
            self.ledger.return_lease(b.seq_id);
            self.topology.remove(handle);
            self.cache_forget(handle);
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

    /// `produce()`: the token this branch would sample now (no state change; idempotent).
    pub fn branch_produce(&mut self, handle: Handle) -> Result<i32> {
        self.branch_mut(handle)?.produce()
    }

    /// `produce()` on each of `handles`' branches, on the decode's threads when called on an
    /// engine thread: the tokens are cached for the `produce` calls that follow (errors are
    /// not: those calls meet them again).
    pub(crate) fn produce_ahead(&mut self, handles: &[Handle]) {
        let threads = usize::try_from(self.shape().n_threads).unwrap_or(1);
        let branches: Vec<Mutex<&mut BranchState>> =
            self.branches.get_many_mut(handles).into_iter().map(Mutex::new).collect();
        crate::omp::parallel_for(branches.len(), threads, &|i| {
            let _ = branches[i].lock().produce();
        });
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

    /// A branch's current sampling parameters.
    pub fn branch_params(&self, handle: Handle) -> Result<SamplingParams> {
        Ok(self.branch(handle)?.sampler.params().clone())
    }

    /// Replace a branch's sampler parameters (history kept; no-op if unchanged).
    pub fn branch_set_params(&mut self, handle: Handle, params: SamplingParams) -> Result<()> {
        self.change_sampler(handle, |sampler, model| sampler.set_params(model, params))
    }

    /// Restart a branch's RNG with `seed`.
    pub fn branch_reseed_sampler(&mut self, handle: Handle, seed: u32) -> Result<()> {
        self.change_sampler(handle, |sampler, model| sampler.reseed(model, seed))
    }

    /// Start a branch's sampling afresh, as a new branch after its prefill: no penalty history
    /// (penalties, DRY, mirostat) and no perplexity so far; the parameters, RNG, bias, grammar,
    /// KV and logits kept. A request that forks a cached prefix (whose branch holds an earlier
    /// request's tokens) then samples as the same request run cold.
    pub fn branch_start_afresh(&mut self, handle: Handle) -> Result<()> {
        self.change_sampler(handle, |sampler, model| sampler.forget_history(model))?;
        let b = self.branch_mut(handle)?;
        b.model_ppl = Default::default();
        b.sampling_ppl = Default::default();
        Ok(())
    }

    /// Apply `change` to a branch's sampler; its produced token is drawn again.
    fn change_sampler(
        &mut self,
        handle: Handle,
        change: impl FnOnce(&mut Sampler, &Model) -> Result<()>,
    ) -> Result<()> {
        let model = self.model();
        let b = self.branch_mut(handle)?;
        change(&mut b.sampler, &model)?;
        b.invalidate();
        Ok(())
    }

    fn check_bias(&self, bias: &[(i32, f32)]) -> Result<()> {
        check_bias(&self.model(), bias)
    }

    /// Set the inherited logit bias (replaces the previous one).
    pub fn branch_set_logit_bias(&mut self, handle: Handle, bias: Vec<(i32, f32)>) -> Result<()> {
        self.set_bias(handle, bias, |b| &mut b.logit_bias)
    }

    /// Set per-branch steering (not inherited by forks).
    pub fn branch_steer(&mut self, handle: Handle, bias: Vec<(i32, f32)>) -> Result<()> {
        self.set_bias(handle, bias, |b| &mut b.steer)
    }

    /// Check `bias` and put it in the branch's bias list `which`.
    fn set_bias(
        &mut self,
        handle: Handle,
        bias: Vec<(i32, f32)>,
        which: fn(&mut BranchState) -> &mut Vec<(i32, f32)>,
    ) -> Result<()> {
        self.check_bias(&bias)?;
        let n_vocab = self.shape().n_vocab as usize;
        let b = self.branch_mut(handle)?;
        let before = std::mem::replace(which(b), bias);
        if bans_every_token(&b.logit_bias, &b.steer, n_vocab) {
            *which(b) = before;
            return Err(LloyalError::invalid(
                "this bias bans every token of the vocabulary (-inf for each, with the branch's \
                 logit bias and steering together): nothing could be sampled; leave one allowed",
            ));
        }
        b.invalidate();
        Ok(())
    }

    /// Replace the logits snapshot.
    pub fn branch_set_logits(&mut self, handle: Handle, logits: Vec<f32>) -> Result<()> {
        super::logits::check_supplied(&logits, self.shape().n_vocab as usize, "logits")?;
        let b = self.branch_mut(handle)?;
        b.logits = Arc::new(Logits::new(logits));
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
        let b = self.branch(handle)?;
        b.logits()?;
        Ok(base.scale(b.logits.surprisal(token as usize)))
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

/// Whether `-inf` entries of the two bias maps together cover all `n_vocab` tokens.
fn bans_every_token(a: &[(i32, f32)], b: &[(i32, f32)], n_vocab: usize) -> bool {
    if a.len() + b.len() < n_vocab {
        return false;
    }
    let mut banned = vec![false; n_vocab];
    for &(t, v) in a.iter().chain(b) {
        if v == f32::NEG_INFINITY {
            if let Some(slot) = banned.get_mut(t as usize) {
                *slot = true;
            }
        }
    }
    banned.iter().all(|&x| x)
}

/// A logit bias's tokens are in the vocabulary and its values finite or `-inf` (a ban).
pub fn check_bias(model: &Model, bias: &[(i32, f32)]) -> Result<()> {
    for &(t, b) in bias {
        model.check_token(i64::from(t))?;
        if b.is_nan() || b == f32::INFINITY {
            return Err(LloyalError::invalid(format!("bias for token {t} must be finite or -inf, got {b}")));
        }
    }
    Ok(())
}
