//! Saved state: the verified envelope (`envelope`), one sequence's KV cells (`kv`), a whole
//! branch (`branch`: KV plus sampler, grammar, metrics and logits) and the atomic file write
//! (`file`).

pub mod branch;
pub mod envelope;
pub mod file;
pub mod kv;
