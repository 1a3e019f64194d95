//! The direct path: one commit or prefill run at once on the locked context (`verify`'s
//! bonus token, `reseed`'s rewrite), through the same admission, decode, rollback and
//! publishing as an engine tick. All-or-nothing.

use super::admit::{admit_commit, admit_prefill};
use super::execute::{commit_rows, decode_now, prefill_rows};
use super::update::{finish_commit, finish_prefill};
use crate::context::state::ContextState;
use crate::error::Result;
use crate::tenancy::Handle;

impl ContextState {
    /// Accept and decode one token per branch (`ceil(N / n_batch)` decodes), capturing each
    /// branch's logits.
    pub fn commit(&mut self, pairs: &[(Handle, i32)]) -> Result<()> {
        let rows = admit_commit(self, pairs, 0)?;
        decode_now(self, &commit_rows(&rows))?;
        finish_commit(self, &rows)
    }

    /// Write each branch's tokens (no accept), packed into `ceil(total / n_batch)` decodes,
    /// logits kept for each branch's last token.
    pub fn prefill(&mut self, items: &[(Handle, Vec<i32>)]) -> Result<()> {
        let (items, cells) = admit_prefill(self, items, 0)?;
        decode_now(self, &prefill_rows(&items))?;
        finish_prefill(self, &items, cells)
    }
}
