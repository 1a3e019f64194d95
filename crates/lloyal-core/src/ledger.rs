//! The KV ledger: the one owner of lease and cell accounting.
//!
//! A context's scarce resources are its sequence ids (leases) and its KV cells. Every lease
//! taken or returned and every change to the count of cells branches hold goes through the
//! methods here (`take_lease`, `return_lease`, `grow_cells`, `free_cells`, `reset_ledger`);
//! the counts themselves are private to this file. [`ContextState::check_ledger`] compares
//! the ledger with llama.cpp's own view of each branch's sequence; `Context` runs it after
//! every call in debug builds and when `LLOYAL_CHECK_LEDGER=1` (the test suite sets it).

use std::sync::OnceLock;

use crate::context::ContextState;
use crate::error::{LloyalError, Result};
use crate::tenancy::{Handle, Leases};

/// Leases and the cells branches hold (shared prefix cells counted once; parked cells are
/// not counted: they are free to any decode that needs them).
pub struct Ledger {
    leases: Leases,
    cells: usize,
    /// Branches with an engine prefill in flight, and the tokens of it already decoded
    /// (cells written past the branch's position, counted once the prefill finishes).
    in_flight: Vec<(Handle, usize)>,
}

impl Ledger {
    /// A ledger for `n_seq_max` leases and no cells.
    pub fn new(n_seq_max: u32) -> Self {
        Ledger { leases: Leases::new(n_seq_max), cells: 0, in_flight: Vec::new() }
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

impl ContextState {
    pub(crate) fn lease_exhausted(&self) -> LloyalError {
        let l = &self.ledger.leases;
        LloyalError::LeaseExhausted { n_seq_max: l.n_seq_max(), live: l.live() }
    }

    /// Take a lease whose sequence is empty: an id holding flat-path cells (`ctx.decode` on
    /// a sequence no branch holds) is skipped rather than wiped.
    pub(crate) fn take_lease(&mut self) -> Result<i32> {
        let raw = &mut self.raw;
        let mut empty = |s: i32| raw.seq_pos_max(s) < 0;
        let leases = &mut self.ledger.leases;
        if let Some(seq) = leases.acquire_where(&mut empty) {
            return Ok(seq);
        }
        if leases.available() == 0 {
            return Err(self.lease_exhausted());
        }
        let mut flat = leases.free_ids().to_vec();
        flat.sort_unstable();
        Err(LloyalError::LeasesHoldFlatCells { n_seq_max: leases.n_seq_max(), live: leases.live(), flat })
    }

    /// Give a lease back (its sequence must already be empty or parked).
    pub(crate) fn return_lease(&mut self, seq: i32) {
        self.ledger.leases.release(seq);
    }

    /// Branches now hold `n` more cells.
    pub(crate) fn grow_cells(&mut self, n: usize) {
        self.ledger.cells += n;
    }

    /// Branches now hold `n` fewer cells.
    pub(crate) fn free_cells(&mut self, n: usize) {
        debug_assert!(n <= self.ledger.cells, "freeing {n} of {} cells", self.ledger.cells);
        self.ledger.cells = self.ledger.cells.saturating_sub(n);
    }

    /// Record the engine's prefills in flight after a tick (see [`Ledger`]).
    pub(crate) fn note_in_flight(&mut self, written: Vec<(Handle, usize)>) {
        self.ledger.in_flight = written;
    }

    /// Start over: only the sequences in `keep` stay leased, and branches hold `cells`.
    pub(crate) fn reset_ledger(&mut self, keep: &[i32], cells: usize) {
        self.ledger.leases.rebuild(keep);
        self.ledger.cells = cells;
    }

    /// Compare the ledger with the branch table and llama.cpp: every live branch holds its
    /// own lease, llama.cpp's last position of its sequence is `position - 1`, and the cell
    /// count equals the sum of the branches' own cells (`position - fork_head`). Cells an
    /// engine prefill in flight has written ahead of a branch's position are allowed for.
    pub fn check_ledger(&mut self) -> std::result::Result<(), String> {
        let mut own = 0usize;
        let mut seqs = Vec::new();
        for h in self.branches.handles() {
            let Some(b) = self.branches.get(h) else { continue };
            let (seq, position, fork_head) = (b.seq_id, b.position, b.fork_head);
            own += (position - fork_head).max(0) as usize;
            seqs.push(seq);
            let ahead: usize =
                self.ledger.in_flight.iter().filter(|(f, _)| *f == h).map(|(_, done)| done).sum();
            let last = self.raw.seq_pos_max(seq) - ahead as i32;
            if last != position - 1 && !(last == -1 && position == fork_head) {
                return Err(format!(
                    "branch {h} (seq {seq}) is at position {position} but llama.cpp's last position is {last}"
                ));
            }
        }
        let live = self.ledger.leases.live() as usize;
        if live != seqs.len() {
            return Err(format!("{live} leases are live but {} branches hold one", seqs.len()));
        }
        seqs.sort_unstable();
        seqs.dedup();
        if seqs.len() != live {
            return Err("two branches hold the same sequence".into());
        }
        if own != self.ledger.cells {
            return Err(format!("the ledger counts {} cells but the branches own {own}", self.ledger.cells));
        }
        Ok(())
    }
}
