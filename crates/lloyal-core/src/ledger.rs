//! The KV ledger: the one owner of lease and cell accounting.
//!
//! A context's scarce resources are its sequence ids (leases) and its KV cells. Every lease
//! taken or returned and every change to the count of cells branches hold goes through the
//! methods here (`take_lease`, `return_lease`, `grow_cells`, `free_cells`, `reset`); the
//! counts themselves are private to this file. [`Ledger::check`] compares the ledger with
//! llama.cpp's own view of each branch's sequence; `Context` runs it after every call in
//! debug builds and when `LLOYAL_CHECK_LEDGER=1` (the test suite sets it).

use std::sync::OnceLock;

use crate::branch::BranchState;
use crate::error::{LloyalError, Result};
use crate::raw::RawContext;
use crate::tenancy::{Handle, Leases, Slots};

/// KV occupancy by branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPressure {
    pub n_ctx: u32,
    pub cells_used: usize,
    pub remaining: usize,
    /// Cells of pruned branches parked until the cache fills (batch-invariant contexts only;
    /// not in `cells_used`: a decode that needs them frees them).
    pub cells_parked: usize,
}

/// Leases and the cells branches hold (shared prefix cells counted once; parked cells are
/// not counted: they are free to any decode that needs them).
pub struct Ledger {
    leases: Leases,
    cells: usize,
    /// Branches with an engine prefill in flight, and the tokens of it already decoded
    /// (cells written past the branch's position, counted once the prefill finishes).
    in_flight: Vec<(Handle, usize)>,
    /// Leases a reseed in flight parked a branch's old cells on, and how many (still counted
    /// in `cells`: they stay occupied until the new ones are written).
    parked: Vec<(i32, usize)>,
    /// The most cells branches held since the KV cache was last compacted: llama.cpp's
    /// highest cell in use went at least this high ([`crate::state::compact`]).
    peak: usize,
}

impl Ledger {
    /// A ledger for `n_seq_max` leases and no cells.
    pub fn new(n_seq_max: u32) -> Self {
        Ledger {
            leases: Leases::new(n_seq_max),
            cells: 0,
            in_flight: Vec::new(),
            parked: Vec::new(),
            peak: 0,
        }
    }

    /// The lease table (read-only).
    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    /// KV cells held by branches (exact: prefill +n, commit +N, fork +0, prune -own cells).
    pub fn cells_used(&self) -> usize {
        self.cells
    }
}

/// Whether to check the ledger after every context call (debug builds, or
/// `LLOYAL_CHECK_LEDGER=1`; read once).
pub fn checking() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| cfg!(debug_assertions) || std::env::var("LLOYAL_CHECK_LEDGER").is_ok_and(|v| v == "1"))
}

impl Ledger {
    /// Cells held by branches and what is left of `n_ctx` (`parked`: cells of pruned
    /// branches waiting to be freed).
    pub fn pressure(&self, n_ctx: u32, parked: usize) -> KvPressure {
        KvPressure {
            n_ctx,
            cells_used: self.cells,
            remaining: (n_ctx as usize).saturating_sub(self.cells),
            cells_parked: parked,
        }
    }

    pub(crate) fn lease_exhausted(&self) -> LloyalError {
        LloyalError::LeaseExhausted { n_seq_max: self.leases.n_seq_max(), live: self.leases.live() }
    }

    /// Take a lease whose sequence is empty in `raw`: an id holding flat-path cells
    /// (`ctx.decode` on a sequence no branch holds) is skipped rather than wiped.
    pub(crate) fn take_lease(&mut self, raw: &mut RawContext) -> Result<i32> {
        let mut empty = |s: i32| raw.seq_pos_max(s) < 0;
        if let Some(seq) = self.leases.acquire_where(&mut empty) {
            return Ok(seq);
        }
        if self.leases.available() == 0 {
            return Err(self.lease_exhausted());
        }
        let mut flat = self.leases.free_ids().to_vec();
        flat.sort_unstable();
        Err(LloyalError::LeasesHoldFlatCells {
            n_seq_max: self.leases.n_seq_max(),
            live: self.leases.live(),
            flat,
        })
    }

    /// Give a lease back (its sequence must already be empty or parked).
    pub(crate) fn return_lease(&mut self, seq: i32) {
        self.leases.release(seq);
    }

    /// Branches now hold `n` more cells.
    pub(crate) fn grow_cells(&mut self, n: usize) {
        self.cells += n;
        self.peak = self.peak.max(self.cells);
    }

    /// The most cells branches held since the last [`Self::compacted`].
    pub fn peak_cells(&self) -> usize {
        self.peak
    }

    /// The cells went back to the front of the KV cache: the peak starts over from now.
    pub(crate) fn compacted(&mut self) {
        self.peak = self.cells;
    }

    /// Branches now hold `n` fewer cells.
    pub(crate) fn free_cells(&mut self, n: usize) {
        debug_assert!(n <= self.cells, "freeing {n} of {} cells", self.cells);
        self.cells = self.cells.saturating_sub(n);
    }

    /// A reseed parked `cells` of its branch's old cells on lease `seq` (they stay counted).
    pub(crate) fn park(&mut self, seq: i32, cells: usize) {
        self.parked.push((seq, cells));
    }

    /// The cells parked on lease `seq`, no longer parked (None: nothing is, e.g. after a
    /// `reset`).
    pub(crate) fn unpark(&mut self, seq: i32) -> Option<usize> {
        let i = self.parked.iter().position(|p| p.0 == seq)?;
        Some(self.parked.swap_remove(i).1)
    }

    /// The leases reseeds in flight parked cells on.
    pub(crate) fn parked_seqs(&self) -> Vec<i32> {
        self.parked.iter().map(|p| p.0).collect()
    }

    /// Record the engine's prefills in flight after a tick (see [`Ledger`]).
    pub(crate) fn note_in_flight(&mut self, written: Vec<(Handle, usize)>) {
        self.in_flight = written;
    }

    /// Start over: only the sequences in `keep` stay leased, and branches hold `cells`.
    pub(crate) fn reset(&mut self, keep: &[i32], cells: usize) {
        self.leases.rebuild(keep);
        self.cells = cells;
        self.parked.clear();
    }

    /// Compare the ledger with the branch table and llama.cpp: every live branch holds its
    /// own lease, llama.cpp's last position of its sequence is `position - 1`, and the cell
    /// count equals the sum of the branches' own cells (`position - fork_head`). Cells an
    /// engine prefill in flight has written ahead of a branch's position are allowed for.
    pub fn check(
        &self,
        branches: &Slots<BranchState>,
        raw: &mut RawContext,
    ) -> std::result::Result<(), String> {
        let mut own = 0usize;
        let mut seqs = Vec::new();
        for h in branches.handles() {
            let Some(b) = branches.get(h) else { continue };
            let (seq, position, fork_head) = (b.seq_id, b.position, b.fork_head);
            own += (position - fork_head).max(0) as usize;
            seqs.push(seq);
            let ahead: usize = self.in_flight.iter().filter(|(f, _)| *f == h).map(|(_, done)| done).sum();
            let last = raw.seq_pos_max(seq) - ahead as i32;
            if last != position - 1 && !(last == -1 && position == fork_head) {
                return Err(format!(
                    "branch {h} (seq {seq}) is at position {position} but llama.cpp's last position is {last}"
                ));
            }
        }
        let live = self.leases.live() as usize;
        if live != seqs.len() + self.parked.len() {
            let parked = self.parked.len();
            return Err(format!(
                "{live} leases are live but {} branches hold one ({parked} parked)",
                seqs.len()
            ));
        }
        seqs.extend(self.parked.iter().map(|p| p.0));
        own += self.parked.iter().map(|p| p.1).sum::<usize>();
        seqs.sort_unstable();
        seqs.dedup();
        if seqs.len() != live {
            return Err("two branches (or a branch and a parked reseed) hold the same sequence".into());
        }
        if own != self.cells {
            return Err(format!("the ledger counts {} cells but the branches own {own}", self.cells));
        }
        Ok(())
    }
}
