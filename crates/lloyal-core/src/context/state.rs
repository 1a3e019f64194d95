//! What the context lock guards: the llama.cpp context, its decode batch, the branches
//! and their ledger; the decode path every other module builds on.

use std::collections::HashMap;
use std::sync::Arc;

use super::ContextShape;
use crate::backend::{clear_recent_errors, recent_errors_or};
use crate::branch::BranchState;
use crate::embeddings::vectors::Encoded;
use crate::error::{LloyalError, Result};
use crate::ledger::Ledger;
use crate::model::Model;
use crate::raw::{Batch, RawContext};
use crate::sampler::Sampler;
use crate::tenancy::Slots;
use crate::topology::Topology;

/// The mutable state behind the lock: the llama.cpp context and the flat path's snapshot.
pub struct ContextState {
    /// The model the context runs.
    pub(super) model: Arc<Model>,
    pub(crate) raw: RawContext,
    pub(super) batch: Batch,
    pub(super) shape: ContextShape,
    /// Logits of the last flat-path decode (empty before any).
    pub(super) logits: Vec<f32>,
    /// Flat-path sampler, rebuilt when the parameters change (history kept).
    pub(super) sampler: Option<Sampler>,
    /// Live branches (generation-checked handles).
    pub(crate) branches: Slots<BranchState>,
    /// Parent/children links between branches.
    pub(crate) topology: Topology,
    /// Which sequence ids live branches hold and how many KV cells they hold (written only
    /// by `ledger.rs`).
    pub(crate) ledger: Ledger,
    /// The hidden sequence id holding the cells of pruned branches until a decode needs the
    /// room (`None` for embeddings contexts and `n_seq_max = 256`, which free at once).
    pub(super) park_seq: Option<i32>,
    /// Cells only `park_seq` holds (exact, like the ledger's cell count).
    pub(crate) parked: usize,
    /// Cells the sequences no branch holds keep (flat-path decodes, copies, loaded states):
    /// each such sequence's span of positions, as of the last [`Self::note_flat_cells`] (an
    /// upper bound: copies among them share cells).
    pub(crate) flat_cells: usize,
    /// Whether [`Self::note_flat_cells`] counts them (`Context::count_flat_cells`: tests).
    pub(crate) count_flat: bool,
    /// K+V bytes per cell (for `memory_size`).
    pub(super) kv_cell_bytes: u64,
    /// Batch-invariant kernels (then `retain_only` also rewrites the winner's cells in order).
    pub(crate) batch_invariant: bool,
    /// An engine tick decodes its commit rows and its prefill rows in separate `llama_decode`
    /// calls (see `engine::tick::split_point`): the fast CPU kernels with flash attention.
    pub(crate) split_mixed_ticks: bool,
    /// Vectors of the last `encode()` per sequence (embeddings contexts).
    pub(crate) encoded: HashMap<i32, Encoded>,
    /// Asked before every decode of a call but the first (see [`super::Context::apply`]).
    pub(super) interrupt: Option<InterruptCheck>,
    /// `llama_decode` calls made by the current call (the first is never interrupted: the
    /// caller has just checked for signals itself).
    pub(super) batches_in_call: u32,
    /// The prefix cache (`cache/`): its bookkeeping, shared with the context's callers.
    pub(crate) cache: crate::cache::SharedIndex,
    /// Branches the engine's requests use (set by the engine each tick): never evicted.
    pub(crate) in_engine: Vec<crate::tenancy::Handle>,
    /// The engine compacts the KV cache when it pays (`state::compact`).
    pub(crate) compacts: bool,
    /// Whether its branches keep their sampling perplexity (`ContextOptions::sampling_perplexity`).
    pub(crate) sampling_perplexity: bool,
}

/// A check run between the decodes of one call: `true` stops the call, which then rolls
/// back like any failed decode and returns [`LloyalError::Interrupted`].
pub type InterruptCheck = Box<dyn Fn() -> bool + Send>;

impl ContextState {
    /// Sizes fixed at creation.
    pub fn shape(&self) -> ContextShape {
        self.shape
    }

    /// The model.
    pub fn model(&self) -> Arc<Model> {
        Arc::clone(&self.model)
    }

    /// Bytes of KV cache memory (cells x per-cell K+V size over all layers).
    pub fn memory_size(&self) -> u64 {
        u64::from(self.shape.n_ctx) * self.kv_cell_bytes
    }

    /// Whether a live branch holds `seq_id`.
    pub fn is_leased(&self, seq_id: i32) -> bool {
        self.branch_on(seq_id).is_some()
    }

    /// The live branch holding `seq_id`.
    fn branch_on(&self, seq_id: i32) -> Option<&BranchState> {
        self.branches.values().find(|b| b.seq_id == seq_id)
    }

    pub(crate) fn check_seq(&self, seq_id: i32) -> Result<()> {
        if seq_id < 0 || seq_id as u32 >= self.shape.n_seq_max {
            return Err(LloyalError::invalid(format!(
                "seq_id {seq_id} is out of range: this context has n_seq_max={} (valid 0 to {}); \
                 create the context with a larger n_seq_max to use more sequences",
                self.shape.n_seq_max,
                self.shape.n_seq_max - 1
            )));
        }
        Ok(())
    }

    /// Validate a seq id for a flat-path write: in range and not owned by a branch.
    pub(super) fn check_flat_seq(&self, seq_id: i32) -> Result<()> {
        self.check_seq(seq_id)?;
        if self.is_leased(seq_id) {
            return Err(LloyalError::SeqLeased { seq_id });
        }
        Ok(())
    }

    pub(super) fn check_no_leases(&self) -> Result<()> {
        match self.branches.handles().first().and_then(|&h| self.branches.get(h)) {
            Some(b) => Err(LloyalError::SeqLeased { seq_id: b.seq_id }),
            None => Ok(()),
        }
    }

    /// Largest position stored for `seq_id` (-1 when empty).
    pub fn seq_pos_max(&mut self, seq_id: i32) -> Result<i32> {
        self.check_seq(seq_id)?;
        Ok(self.raw.seq_pos_max(seq_id))
    }

    /// Free a pruned branch's own cells `[p0, p1)` of `seq_id` without making them reusable
    /// yet: they move to the hidden parking sequence, so the survivors' next tokens keep
    /// landing after their own cells (in position order) instead of in the holes. The caller
    /// then removes `seq_id`'s cells. [`Self::reclaim_parked`] frees them when a decode or a
    /// state load needs the room.
    pub(crate) fn park_cells(&mut self, seq_id: i32, p0: i32, p1: i32) {
        let Some(park) = self.park_seq else { return };
        if p1 <= p0 {
            return;
        }
        // Unified KV makes a partial-range copy a metadata change.
        self.raw.seq_cp(seq_id, park, p0, p1);
        self.parked += (p1 - p0) as usize;
    }

    /// Really free the parked cells (after this, survivors may reuse them and exactness of
    /// their later logits against a lone run is no longer guaranteed).
    pub(crate) fn reclaim_parked(&mut self) {
        if let Some(park) = self.park_seq {
            if self.parked > 0 {
                self.remove_cells(park, -1, -1);
            }
        }
        self.parked = 0;
    }

    /// The parked-cell count after llama.cpp dropped every sequence but the branches'
    /// (`llama_memory_clear`, `seq_keep`).
    pub(crate) fn forget_parked(&mut self) {
        self.parked = 0;
    }

    /// Run `llama_decode` on the current batch, mapping its return codes. When no cells are
    /// free for it but some are parked, the parked cells are reclaimed and the decode retried.
    /// `replacing`: the sequences of branches whose snapshots the batch's logits replace
    /// when it succeeds (rows read in place elsewhere are copied out first).
    ///
    /// Only on an engine thread: a decode anywhere else (a closure given to `Context::apply`
    /// rather than `Context::apply_decoding`) is refused before it touches the cache, so the
    /// engine stays the one thread that runs the context's decodes.
    pub(crate) fn run_batch(&mut self, replacing: &[i32]) -> Result<()> {
        if !crate::omp::on_engine_thread() {
            return Err(LloyalError::Backend(
                "a decode outside the context's engine thread: run it with Context::apply_decoding".into(),
            ));
        }
        if self.batches_in_call > 0 && self.interrupt.as_ref().is_some_and(|check| check()) {
            return Err(LloyalError::Interrupted);
        }
        let samplers_changed = self.want_device_rows();
        let keep = if !samplers_changed && self.raw.fails_cleanly(&self.batch) { replacing } else { &[] };
        self.keep_output_rows(keep);
        self.batches_in_call += 1;
        clear_recent_errors();
        let n = self.batch.len();
        let mut code = self.raw.decode(&self.batch);
        if code == 1 && self.parked > 0 {
            // llama.cpp checks for room before touching the cache, so the retry is clean.
            self.reclaim_parked();
            code = self.raw.decode(&self.batch);
        }
        match code {
            0 => Ok(()),
            1 => Err(LloyalError::KvCacheFull {
                needed: n,
                n_ctx: self.shape.n_ctx,
                detail: "no contiguous free cells for this batch".into(),
            }),
            2 => Err(LloyalError::Interrupted),
            _ => Err(LloyalError::Decode {
                code,
                detail: recent_errors_or("see LLOYAL_LOG=1 for llama.cpp's log"),
            }),
        }
    }

    /// Bytes of llama.cpp's logits buffer on huge pages (`RawContext::use_huge_logits`).
    pub fn huge_logit_bytes(&self) -> usize {
        self.raw.huge_logit_bytes()
    }

    /// Whether decodes summarise logits rows on the model's device ([`crate::device_rows`]).
    pub fn device_rows(&self) -> bool {
        self.raw.device_rows()
    }

    /// Where decodes summarise rows ([`crate::device_rows`]): each output row is summarised at
    /// the sampling scale of the branch on its sequence (1 for a sequence without one). Whether
    /// llama.cpp's samplers changed (its output buffer may then move).
    fn want_device_rows(&mut self) -> bool {
        if !self.raw.device_rows() {
            return false;
        }
        let scale_of = |seq: i32| self.branch_on(seq).and_then(BranchState::summary_scale).unwrap_or(1.0);
        let outputs: Vec<(i32, i32, f32)> =
            self.batch.output_seqs().into_iter().map(|(row, seq)| (row, seq, scale_of(seq))).collect();
        self.raw.want_device_rows(&outputs)
    }

    /// Remove cells `[p0, p1)` of a sequence (p1 = -1: to the end). Returns llama.cpp's verdict.
    pub(crate) fn remove_cells(&mut self, seq_id: i32, p0: i32, p1: i32) -> bool {
        self.raw.seq_rm(seq_id, p0, p1)
    }

    /// Raw context pointer for sibling core modules (branches, state I/O).
    pub(crate) fn raw_mut(&mut self) -> &mut RawContext {
        &mut self.raw
    }

    /// The shared decode batch for sibling core modules.
    pub(crate) fn batch_mut(&mut self) -> &mut Batch {
        &mut self.batch
    }
}
