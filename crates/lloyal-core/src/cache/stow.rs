//! Entries copied into the host tier ([`super::host`]) as they are evicted, and written back
//! as entries again for a request that reuses them (on the locked context).

use std::fmt;

use super::evict::lock;
use crate::branch::BranchState;
use crate::context::state::ContextState;
use crate::error::LloyalError;
use crate::tenancy::Handle;

/// An evicted entry's copy: its branch (sampler, metrics, logits) and llama.cpp's serialised
/// cells of its sequence (shared ones included: the copy stands alone).
pub struct Stowed {
    state: BranchState,
    kv: Vec<u8>,
    /// Cells the copy fills when written back.
    cells: usize,
    pos_max: i32,
    /// The lowest position a fork of it written back continues exactly (its sliding-window
    /// cells are saved from its last window on: `state::window`).
    exact_from: usize,
}

/// [`ContextState::cache_restore`]'s answer: the entry made, or why not with the copy given
/// back.
pub type RestoreResult = Result<Handle, (LloyalError, Box<Stowed>)>;

impl fmt::Debug for Stowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stowed").field("cells", &self.cells).field("kv_bytes", &self.kv.len()).finish()
    }
}

impl Stowed {
    /// The cells the copy fills when written back.
    pub fn cells(&self) -> usize {
        self.cells
    }

    /// The lowest position a fork of the copy, written back, continues exactly (0: any).
    pub fn exact_from(&self) -> usize {
        self.exact_from
    }
}

impl ContextState {
    /// Copy entry `h` into the host tier when one is kept, before it is evicted.
    pub(super) fn stow(&mut self, h: Handle, tokens: &[i32]) {
        if lock(&self.cache).host.budget() == 0 {
            return;
        }
        let Some((stowed, bytes)) = self.copy_entry(h) else { return };
        lock(&self.cache).host.keep(tokens, stowed, bytes);
    }

    /// Entry `h`'s copy and its size in bytes (`None` when llama.cpp could not serialise it).
    fn copy_entry(&mut self, h: Handle) -> Option<(Stowed, usize)> {
        let b = self.branch(h).ok()?;
        let seq = b.seq_id;
        let state = b.fork(-1, true).ok()?; // the logits copied out of llama.cpp's buffer
        let kv = self.seq_state_bytes(seq).ok()?;
        let pos_max = self.raw_mut().seq_pos_max(seq);
        let pos_min = self.raw_mut().seq_pos_min(seq);
        if pos_max < 0 || pos_max + 1 != state.position {
            return None;
        }
        let cells = crate::state::window::payload_cells(&self.model(), &kv, pos_min, pos_max);
        let exact_from =
            self.window_after_write(pos_max + 1 - cells as i32, pos_max).max(self.fork_exact_from(h));
        let bytes = kv.len() + state.logits.len() * std::mem::size_of::<f32>();
        Some((Stowed { state, kv, cells, pos_max, exact_from }, bytes))
    }

    /// Write `stowed` back as a new root branch holding `tokens`, an entry of the prefix cache
    /// again (takes a lease and its cells). On failure nothing is taken, and the copy comes back
    /// with the error (for the host tier to keep).
    pub fn cache_restore(&mut self, tokens: &[i32], stowed: Stowed) -> RestoreResult {
        let Stowed { state, kv, cells, pos_max, exact_from } = stowed;
        let start = pos_max + 1 - cells as i32;
        let write = |s: &mut Self, seq| {
            s.write_seq_payload(seq, &kv, pos_max).map_err(|why| {
                LloyalError::Backend(format!(
                    "a cached prompt of {cells} cells could not be written back: {why}"
                ))
            })
        };
        let seq = match self.root_lease(cells, write) {
            Ok(seq) => seq,
            Err(e) => return Err((e, Box::new(Stowed { state, kv, cells, pos_max, exact_from }))),
        };
        let handle = self.root_insert(BranchState { seq_id: seq, fork_head: start, ..state }, cells);
        self.note_window(handle, seq, start);
        lock(&self.cache).add(handle, tokens);
        Ok(handle)
    }
}
