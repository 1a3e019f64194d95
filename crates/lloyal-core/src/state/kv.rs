//! Per-sequence KV state save/load through llama.cpp's `llama_state_seq_*`, wrapped in the
//! verified envelope of [`crate::state::envelope`]. A failed load leaves the target sequence
//! empty and every other sequence untouched.

use crate::backend::{clear_recent_errors, recent_errors, recent_errors_or};
use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::model::Model;
use crate::state::envelope::{self, Fingerprint, SavedState};

/// The fingerprint of `model` written into (and required from) saved states.
pub fn fingerprint(model: &Model) -> Fingerprint {
    Fingerprint {
        n_vocab: model.n_vocab(),
        n_embd: model.n_embd(),
        n_layer: model.n_layer(),
        n_params: model.n_params(),
        architecture: model.architecture(),
    }
}

impl ContextState {
    fn seq_pos_min(&mut self, seq_id: i32) -> i32 {
        self.raw_mut().seq_pos_min(seq_id)
    }

    /// llama.cpp's serialised state of `seq_id` (its KV cells, both caches), unwrapped.
    pub(crate) fn seq_state_bytes(&mut self, seq_id: i32) -> Result<Vec<u8>> {
        self.raw_mut().state_seq_get(seq_id).map_err(|(written, size)| {
            LloyalError::Backend(format!("llama.cpp wrote {written} of {size} bytes of seq {seq_id}'s state"))
        })
    }

    /// `kv_cache_save(seq_id)`: the sequence's KV cells as a verified byte string.
    pub fn kv_save(&mut self, seq_id: i32) -> Result<Vec<u8>> {
        self.kv_save_tokens(seq_id, &[])
    }

    /// Like [`Self::kv_save`], storing `tokens` (the text the cells came from) alongside.
    pub fn kv_save_tokens(&mut self, seq_id: i32, tokens: &[i32]) -> Result<Vec<u8>> {
        self.check_seq(seq_id)?;
        self.model().check_tokens(tokens)?;
        if tokens.len() > u32::MAX as usize {
            return Err(LloyalError::invalid("too many tokens to store with a KV state"));
        }
        let payload = self.seq_state_bytes(seq_id)?;
        let pos_max = self.seq_pos_max(seq_id)?;
        let pos_min = if pos_max < 0 { -1 } else { self.seq_pos_min(seq_id) };
        let state = SavedState { pos_min, pos_max, tokens: tokens.to_vec(), payload };
        Ok(envelope::encode(&fingerprint(&self.model()), &state))
    }

    /// Rewrite `seq_id`'s cells so they sit in position order from cell 0. Called by
    /// `retain_only` when `seq_id` is the only sequence left: without it the winner's next
    /// tokens would land in freed cells *ahead of* its older ones, and flash attention, which
    /// visits a sequence's cells in cell order, would sum them in another order (README
    /// "Numerics"). Costs one copy of the sequence's KV.
    pub(crate) fn compact_seq(&mut self, seq_id: i32) -> Result<()> {
        let payload = self.seq_state_bytes(seq_id)?;
        self.remove_cells(seq_id, 0, -1);
        // Loading needs one contiguous run of free cells: give back the parked ones first.
        self.reclaim_parked();
        clear_recent_errors();
        // The cache is empty, so the cells the state needs are free.
        let read = self.raw_mut().state_seq_set(seq_id, &payload);
        if read == 0 {
            return Err(LloyalError::Backend(format!(
                "retain_only could not rewrite the winner's KV cells ({})",
                recent_errors()
            )));
        }
        Ok(())
    }

    /// `kv_cache_load(seq_id, data)`: replace `seq_id`'s cells with a saved state. Returns the
    /// stored tokens. On any failure `seq_id` is left empty; a leased sequence is refused
    /// untouched. No logits are restored: decode the next token to get some.
    pub fn kv_load(&mut self, seq_id: i32, data: &[u8]) -> Result<Vec<i32>> {
        self.check_seq(seq_id)?;
        if self.is_leased(seq_id) {
            return Err(LloyalError::SeqLeased { seq_id });
        }
        let result = self.kv_load_unchecked(seq_id, data);
        if result.is_err() {
            self.remove_cells(seq_id, 0, -1);
        }
        result
    }

    pub(crate) fn kv_load_unchecked(&mut self, seq_id: i32, data: &[u8]) -> Result<Vec<i32>> {
        let model = self.model();
        let state = envelope::decode(&fingerprint(&model), data)?;
        if let Err(e) = model.check_tokens(&state.tokens) {
            return Err(LloyalError::State(format!("cannot load KV state: stored tokens are invalid ({e})")));
        }
        self.write_seq_payload(seq_id, &state.payload, state.pos_max).map_err(|why| {
            if why.contains("available cells") {
                // the data was fine: other sequences (flat-path cells the branches' count does
                // not see) hold the cache
                let cells =
                    super::window::payload_cells(&model, &state.payload, state.pos_min, state.pos_max);
                LloyalError::KvCacheFull {
                    needed: cells,
                    n_ctx: self.shape().n_ctx,
                    detail: format!("llama.cpp found no run of {cells} free cells: {why}"),
                }
            } else {
                LloyalError::State(format!("cannot load KV state: {why}"))
            }
        })?;
        Ok(state.tokens)
    }

    /// Write llama.cpp's serialised cells of one sequence (`payload`) into `seq_id`, emptied
    /// first, which must then end at `pos_max`; why not otherwise (the caller empties it).
    pub(crate) fn write_seq_payload(
        &mut self,
        seq_id: i32,
        payload: &[u8],
        pos_max: i32,
    ) -> std::result::Result<(), String> {
        self.remove_cells(seq_id, 0, -1);
        // Loading needs one contiguous run of free cells: give back the parked ones first.
        self.reclaim_parked();
        clear_recent_errors();
        if self.raw_mut().state_seq_set(seq_id, payload) == 0 {
            return Err(format!(
                "llama.cpp rejected it ({}); the context may have a different cache type or too few \
                 free cells",
                recent_errors_or("see LLOYAL_LOG=1")
            ));
        }
        let end = self.raw_mut().seq_pos_max(seq_id);
        if end != pos_max {
            return Err(format!(
                "the sequence ends at position {end} after loading, the state says {pos_max}"
            ));
        }
        Ok(())
    }
}
