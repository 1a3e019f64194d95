//! The core's one error type: every failure a user can cause, with the data to explain it.

use thiserror::Error;

/// Result alias used throughout the core.
pub type Result<T> = std::result::Result<T, LloyalError>;

/// Every error the core reports. The Python glue maps each variant to exactly one
/// exception class of `lloyal.errors` (see `src/error.rs`); messages say what was
/// wrong and what to do about it.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum LloyalError {
    /// The model file could not be opened or parsed.
    #[error("cannot load model {path:?}: {reason}")]
    ModelLoad { path: String, reason: String },

    /// A LoRA adapter file could not be opened, parsed or fitted to its model.
    #[error("cannot load LoRA adapter {path:?}: {reason}")]
    LoraLoad { path: String, reason: String },

    /// A call on a context (or one of its branches) after `close()`.
    #[error("the context is closed; create a new Context to continue")]
    ContextClosed,

    /// llama.cpp refused or failed a decode for a reason other than a full cache.
    #[error("llama_decode failed with code {code}: {detail}")]
    Decode { code: i32, detail: String },

    /// No room left in the KV cache for the tokens of this call.
    #[error(
        "KV cache full: {needed} cells needed ({detail}; n_ctx={n_ctx}); prune branches, remove \
         cells (kv_cache_remove) or create the context with a larger n_ctx"
    )]
    KvCacheFull { needed: usize, n_ctx: u32, detail: String },

    /// The branch was pruned (or its context closed) and can no longer be used.
    #[error("branch {handle} is disposed (pruned or retained away); fork or create a new branch")]
    BranchDisposed { handle: u64 },

    /// Every sequence id of the context is held by a live branch.
    #[error(
        "no free KV lease: all {n_seq_max} sequences (n_seq_max) are held by {live} live branches; \
         prune a branch or create the context with a larger n_seq_max"
    )]
    LeaseExhausted { n_seq_max: u32, live: u32 },

    /// A lease request waited its whole timeout without a lease coming free.
    #[error(
        "no free KV lease within {waited:.3} s: all {n_seq_max} sequences (n_seq_max) stayed held by \
         live branches; wait longer (timeout=None waits as long as it takes), prune a branch, or create \
         the context with a larger n_seq_max"
    )]
    LeaseWaitTimedOut { n_seq_max: u32, waited: f64 },

    /// Every sequence id not held by a branch holds flat-path cells (which a lease would wipe).
    #[error(
        "no free KV lease: {live} of {n_seq_max} sequences are held by live branches and the other \
         ones ({flat:?}) hold flat-path cells (ctx.decode), which a branch would wipe; free them with \
         ctx.kv_cache_remove(seq_id, 0) or ctx.kv_cache_clear(), prune a branch, or create the \
         context with a larger n_seq_max"
    )]
    LeasesHoldFlatCells { n_seq_max: u32, live: u32, flat: Vec<i32> },

    /// A topology rule was broken (e.g. RESTRICT prune of a branch with live children).
    #[error("{0}")]
    Topology(String),

    /// A flat-path call touched a sequence a live branch owns.
    #[error(
        "seq_id {seq_id} is leased by a live branch; use the Branch API for it, or prune the branch first"
    )]
    SeqLeased { seq_id: i32 },

    /// A token id outside the vocabulary.
    #[error("token id {token} is out of range: valid ids are 0..{n_vocab} (exclusive)")]
    InvalidToken { token: i64, n_vocab: i32 },

    /// A grammar could not be parsed, or a token it forbids was accepted.
    #[error("{0}")]
    Grammar(String),

    /// Saved state that is corrupt, truncated or from another model/version.
    #[error("{0}")]
    State(String),

    /// A chat template could not be rendered.
    #[error("{0}")]
    ChatTemplate(String),

    /// A bad argument (maps to Python `ValueError`).
    #[error("{0}")]
    InvalidArgument(String),

    /// A branch's sampling perplexity read on a context that does not track it.
    #[error(
        "this context does not track sampling perplexity (it was created with \
         sampling_perplexity=False); create the Context with sampling_perplexity=True (the default) \
         to read it"
    )]
    SamplingPerplexityOff,

    /// A request that needs logits before any decode produced them.
    #[error("no logits available: decode (or prefill) at least one token first")]
    NoLogits,

    /// llama.cpp could not allocate a buffer (a context's KV cache or compute buffers).
    #[error("{0}")]
    OutOfMemory(String),

    /// llama.cpp failed in a way the user cannot fix by changing arguments.
    #[error("{0}")]
    Backend(String),

    /// The call was interrupted (e.g. Ctrl-C) and rolled back.
    #[error("interrupted; the call was rolled back")]
    Interrupted,
}

impl LloyalError {
    /// Shorthand for [`LloyalError::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        LloyalError::InvalidArgument(msg.into())
    }
}
