//! lloyal-core: forkable, branch-parallel inference over llama.cpp, with no Python in sight.
//!
//! Layout, by concept (each glue file in `src/` calls the core module of the same name):
//! `model` (weights, vocab), `context` (one lock per llama.cpp context; flat decode path),
//! `engine/` (the per-context scheduler thread that coalesces decode-bearing calls),
//! `branch/` (the branch type, its operations, reseed, verify), `store` (multi-branch commit,
//! prefill, retain_only), `state/` (saved KV and branch state), `chat/` (templates, render,
//! output parsing), `sampling`/`sampler` (parameters and llama.cpp chains), `grammar/` (GBNF, llguidance),
//! `metrics` (entropy, perplexity), `text` (streaming UTF-8), `tenancy`/`topology` (leases,
//! handles, parent/child links), `raw` (llama.cpp FFI wrappers), `error`.

pub mod backend;
pub mod branch;
pub mod cache;
pub mod chat;
pub mod context;
pub mod cxx_alloc;
pub mod device_rows;
pub mod embeddings;
pub mod engine;
pub mod error;
pub mod grammar;
pub mod hugepages;
pub mod ledger;
pub mod lora;
pub mod metrics;
pub mod model;
pub mod model_file;
pub mod omp;
pub mod options;
pub mod raw;
pub mod sampler;
pub mod sampling;
pub mod scan;
pub mod state;
pub mod store;
pub mod tenancy;
pub mod text;
pub mod tiled;
pub mod topology;

pub use branch::BranchInfo;
pub use chat::ChatFamily;
pub use chat::{ChatOptions, ChatOutput, FormattedChat, ToolCall};
pub use context::state::{ContextState, InterruptCheck};
pub use context::{Context, ContextShape};
pub use engine::apply::{CallDone, Queued};
pub use engine::gen::{Finish, GenItem, GenSpec, GenStream};
pub use engine::{EngineStats, Ticket, Waiter, Work};
pub use error::{LloyalError, Result};
pub use grammar::{json_schema_to_grammar, GbnfEngineChoice, Grammar, GrammarKind, GrammarSource};
pub use ledger::KvPressure;
pub use metrics::{Base, PerplexityTracker};
pub use model::Model;
pub use options::ModelOptions;
pub use options::{ContextOptions, Pooling};
pub use sampling::{Dry, Mirostat, SamplingParams, Xtc};
pub use state::file::write_atomic;
pub use tenancy::Handle;
pub use text::Utf8Stream;
