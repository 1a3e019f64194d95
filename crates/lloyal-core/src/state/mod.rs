//! Saved state: the verified envelope (`envelope`), one sequence's KV cells (`kv`) and a whole
//! branch (`branch`: KV plus sampler, grammar, metrics and logits).

pub mod branch;
pub mod envelope;
pub mod kv;
