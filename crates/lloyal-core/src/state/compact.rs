//! Compacting the KV cache: its cells moved back to the front.
//!
//! llama.cpp's attention spans every cell up to the highest one in use, whichever sequence
//! holds it: the other sequences' cells are masked, but the CPU's flash attention still reads
//! each mask value, per head and per query row. Cells left high by a busy stretch (a burst of
//! prompts, the last of whose branches the prefix cache keeps) so slow every later decode: a
//! 1014-token prompt took 1.47 s instead of 1.03 s with 15,000 cells in use below it. llama.cpp
//! no longer defragments, and its `find_slot` goes back to cell 0 only for new cells.
//!
//! So when the engine runs dry and the cells in use are few next to the most there were since
//! the last compaction ([`worth_compacting`]), the whole cache is written out and read back:
//! llama.cpp empties it and puts every cell back from cell 0, in the same order, with its
//! position and all its sequences. Shared prefixes stay shared, sliding-window caches keep their
//! windows, and flash attention visits each sequence's cells in the same order as before.

use crate::backend::{clear_recent_errors, recent_errors_or};
use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};

/// Set to `0` when a context is made, its engine never compacts (for comparisons).
pub const COMPACTION_VAR: &str = "LLOYAL_KV_COMPACTION";

/// Whether a context made now compacts: not a batch-invariant one (its pruned branches' cells
/// stay parked, in place, for exactness), nor with [`COMPACTION_VAR`] set to `0`.
pub fn enabled(batch_invariant: bool) -> bool {
    !batch_invariant && std::env::var(COMPACTION_VAR).ok().as_deref().map(str::trim) != Some("0")
}

/// Fewest cells a compaction must win back (a peak this far above the cells in use). Below
/// this the cells above the ones in use cost each later prompt token less than ~30 µs on a CPU
/// (Gemma 3 270M, 2 threads), while a compaction writes out and reads back the cells in use and
/// clears the whole cache.
pub const MIN_SLACK: usize = 1024;

/// Whether compacting pays: `peak` cells were in use since the last compaction, `used` are now.
/// The highest cell in use went at least as high as `peak`; compacting copies `used` cells, so
/// it runs when the cells it would win back are at least [`MIN_SLACK`] and twice as many as it
/// copies. (Where the cells in use sit is llama.cpp's to know: a request's cells freed above a
/// cached prefix's leave nothing to win, and a server at concurrency 1 does that after each
/// request, its peak about twice what it keeps.) An empty cache spans nothing already.
pub fn worth_compacting(used: usize, peak: usize) -> bool {
    let slack = peak.saturating_sub(used);
    used > 0 && slack >= MIN_SLACK && slack >= 2 * used
}

impl ContextState {
    /// Whether the context compacts ([`enabled`]) and [`worth_compacting`] says it pays.
    pub(crate) fn wants_compaction(&self) -> bool {
        self.compacts && worth_compacting(self.ledger.cells_used(), self.ledger.peak_cells())
    }

    /// Compact the KV cache when [`Self::wants_compaction`]; whether it ran.
    pub(crate) fn compact_if_sparse(&mut self) -> Result<bool> {
        if !self.wants_compaction() {
            return Ok(false);
        }
        self.kv_compact()?;
        Ok(true)
    }

    /// Write the whole KV cache out and read it back from cell 0 (see the module). Branches,
    /// positions and cell counts do not change.
    ///
    /// Reading back the bytes just written cannot fail short of a llama.cpp fault; if it did,
    /// the cache would be empty, so every branch is disposed (none is left whose KV no longer
    /// matches it) and the error says so.
    pub fn kv_compact(&mut self) -> Result<()> {
        let payload = self.raw.memory_state_get().map_err(|(written, size)| {
            LloyalError::Backend(format!("llama.cpp wrote {written} of {size} bytes of the KV cache's state"))
        })?;
        clear_recent_errors();
        if self.raw.memory_state_set(&payload) == 0 {
            self.dispose_all();
            return Err(LloyalError::Backend(format!(
                "compacting the KV cache failed and every branch was disposed ({})",
                recent_errors_or("see LLOYAL_LOG=1 for llama.cpp's log")
            )));
        }
        self.ledger.compacted();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compacts_when_the_cells_won_back_are_many_and_outnumber_the_cells_copied() {
        assert!(worth_compacting(315, 5865)); // a burst's last branch kept
        assert!(worth_compacting(1, MIN_SLACK + 1));
        assert!(worth_compacting(1024, 3072));
    }

    #[test]
    fn keeps_the_cells_in_place_when_little_would_be_won_back() {
        assert!(!worth_compacting(1, MIN_SLACK)); // too few cells above
        assert!(!worth_compacting(0, 5000)); // nothing in use: nothing spanned
        assert!(!worth_compacting(1078, 2224)); // concurrency 1: a prefix kept, a request gone
        assert!(!worth_compacting(1024, 3071)); // slack 2047 < twice the 1024 cells to copy
        assert!(!worth_compacting(5000, 4000)); // a peak below the cells in use (never, but safe)
    }
}
