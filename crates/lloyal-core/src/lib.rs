//! lloyal-core: forkable, branch-parallel inference over llama.cpp, with no Python in sight.
//!
//! Layout: `model` (weights, vocab), `context` (one lock per llama.cpp context; flat decode
//! path), `sampling`/`sampler` (parameters and llama.cpp chains), `metrics` (entropy,
//! perplexity), `utf8` (streaming text), `raw` (the only raw pointers), `error`.

pub mod backend;
pub mod branch;
pub mod branch_state;
pub mod chat;
pub mod chat_family;
pub mod chat_templates;
pub mod context;
pub mod embeddings;
pub mod error;
pub mod gbnf_check;
pub mod grammar;
pub mod metrics;
pub mod model;
pub mod model_file;
pub mod options;
pub mod packing;
pub mod raw;
pub mod reseed;
pub mod sampler;
pub mod sampling;
pub mod state_format;
pub mod state_io;
pub mod store;
pub mod tenancy;
pub mod topology;
pub mod utf8;
pub mod verify;

pub use chat::{ChatOptions, ChatOutput, FormattedChat, ToolCall};
pub use chat_family::ChatFamily;
pub use context::{Context, ContextShape, ContextState, InterruptCheck};
pub use error::{LloyalError, Result};
pub use grammar::{json_schema_to_grammar, Grammar, GrammarSource};
pub use metrics::{Base, PerplexityTracker};
pub use model::{Model, ModelOptions};
pub use options::{ContextOptions, Pooling};
pub use sampling::{Dry, Mirostat, SamplingParams, Xtc};
pub use store::{BranchInfo, KvPressure};
pub use tenancy::Handle;
pub use utf8::Utf8Stream;
