//! Saved state: the verified envelope (`envelope`), one sequence's KV cells (`kv`), a whole
//! branch (`branch`: KV plus sampler, grammar, metrics and logits) and the atomic file write
//! (`file`), and the whole KV cache written out and read back from cell 0 (`compact`).

pub mod branch;
pub mod compact;
pub mod envelope;
pub mod file;
pub mod kv;
pub(crate) mod window;
