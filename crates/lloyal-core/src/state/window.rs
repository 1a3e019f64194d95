//! Sliding-window (SWA) cells of sequences written from a serialised state.
//!
//! A model with sliding-window layers (Gemma 3: 512 positions) keeps their cells in a second
//! cache. lloyal makes it full size, so a live sequence holds every cell in both, and a fork at
//! any position finds the window it attends to. llama.cpp's `state_write` saves only the
//! cells inside the last window for those layers, though, so a sequence written back from a
//! state (a loaded branch, a prefix-cache copy from host memory, a batch-invariant
//! `retain_only`'s rewrite) holds its sliding-window cells from `pos_max - n_swa + 1` on:
//!
//! - it continues exactly, and so does a fork at a position whose window it still holds; a fork
//!   further back would attend to fewer cells than a fresh prefill does (wrong logits, with no
//!   error). The lowest exact position is recorded per branch
//!   ([`crate::cache::PrefixIndex::exact_from`]) and inherited by forks; `fork(at=)` below it
//!   is refused and the prefix cache does not fork there;
//! - `llama_memory_seq_pos_min` answers from the sliding-window cache, so the cells such a
//!   sequence holds are counted from the state itself ([`payload_cells`]).

use crate::cache::lock;
use crate::context::state::ContextState;
use crate::model::Model;
use crate::tenancy::Handle;

/// Cells of the full-attention cache a serialised sequence holds, whose positions run from
/// `pos_min` to `pos_max`. For a model with sliding-window layers that is the count near the
/// head of the state (after llama.cpp's magic and the sequence id: `n_stream` = 1, then the
/// first cache's cell count), since `pos_min` may be the sliding-window cache's; otherwise, and
/// when the head is not that, the span.
pub(crate) fn payload_cells(model: &Model, payload: &[u8], pos_min: i32, pos_max: i32) -> usize {
    if pos_max < 0 {
        return 0;
    }
    let span = (pos_max - pos_min.max(0) + 1) as usize;
    let word = |at: usize| payload.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    // llama_state_seq_get_data: io magic (u32), seq_id (i32), then the memory's state
    match (model.n_swa() > 0, word(8), word(12)) {
        (true, Some(1), Some(cells))
            if (cells as usize) >= span && cells as i64 <= i64::from(pos_max) + 1 =>
        {
            cells as usize
        }
        _ => span,
    }
}

impl ContextState {
    /// The lowest position at which a fork of `handle` continues exactly (0: any).
    pub fn fork_exact_from(&self, handle: Handle) -> usize {
        lock(&self.cache).exact_from(handle)
    }

    /// After `seq` (branch `handle`'s, its first cell at `start`) was written from a state:
    /// record where its forks start to be exact, when its sliding-window cells begin later
    /// than its cells do.
    pub(crate) fn note_window(&mut self, handle: Handle, seq: i32, start: i32) {
        let n_swa = self.model().n_swa();
        if n_swa <= 0 || self.raw_mut().seq_pos_max(seq) < 0 {
            return;
        }
        let swa_min = self.raw_mut().seq_pos_min(seq);
        if swa_min > start {
            // a decode at p attends to cells p - n_swa + 1 ..= p
            lock(&self.cache).set_exact_from(handle, (swa_min + n_swa - 1) as usize);
        }
    }

    /// Where forks of a sequence whose cells run from `start` to `pos_max` will be exact once
    /// it is written back from a state (0: anywhere): what [`Self::note_window`] will record.
    pub(crate) fn window_after_write(&self, start: i32, pos_max: i32) -> usize {
        let n_swa = self.model().n_swa();
        if n_swa <= 0 || pos_max < 0 || pos_max - n_swa < start {
            return 0;
        }
        pos_max as usize // (pos_max - n_swa + 1) + n_swa - 1
    }
}
