//! Context options: defaults, validation and translation into llama.cpp's context params.

use llama_cpp_sys_2 as sys;

use crate::error::{LloyalError, Result};

/// Largest `n_seq_max` llama.cpp supports (LLAMA_MAX_SEQ).
pub const MAX_SEQ: u32 = 256;

/// How embeddings are pooled per sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    None,
    Mean,
    Cls,
    Last,
    Rank,
}

impl Pooling {
    /// Parse "none" | "mean" | "cls" | "last" | "rank".
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "none" => Pooling::None,
            "mean" => Pooling::Mean,
            "cls" => Pooling::Cls,
            "last" => Pooling::Last,
            "rank" => Pooling::Rank,
            _ => {
                return Err(LloyalError::invalid(format!(
                    "pooling must be one of none, mean, cls, last, rank; got {s:?}"
                )))
            }
        })
    }

    fn raw(self) -> sys::llama_pooling_type {
        match self {
            Pooling::None => sys::LLAMA_POOLING_TYPE_NONE,
            Pooling::Mean => sys::LLAMA_POOLING_TYPE_MEAN,
            Pooling::Cls => sys::LLAMA_POOLING_TYPE_CLS,
            Pooling::Last => sys::LLAMA_POOLING_TYPE_LAST,
            Pooling::Rank => sys::LLAMA_POOLING_TYPE_RANK,
        }
    }
}

/// KV cache element types accepted for `type_k` / `type_v`.
const KV_TYPES: &[(&str, sys::ggml_type)] = &[
    ("f32", sys::GGML_TYPE_F32),
    ("f16", sys::GGML_TYPE_F16),
    ("bf16", sys::GGML_TYPE_BF16),
    ("q8_0", sys::GGML_TYPE_Q8_0),
    ("q4_0", sys::GGML_TYPE_Q4_0),
    ("q4_1", sys::GGML_TYPE_Q4_1),
    ("q5_0", sys::GGML_TYPE_Q5_0),
    ("q5_1", sys::GGML_TYPE_Q5_1),
    ("iq4_nl", sys::GGML_TYPE_IQ4_NL),
];

/// Parse a KV cache type name.
pub fn parse_kv_type(field: &str, s: &str) -> Result<sys::ggml_type> {
    KV_TYPES.iter().find(|(n, _)| *n == s).map(|(_, t)| *t).ok_or_else(|| {
        let names: Vec<&str> = KV_TYPES.iter().map(|(n, _)| *n).collect();
        LloyalError::invalid(format!("{field} must be one of {}; got {s:?}", names.join(", ")))
    })
}

/// Everything `Context(...)` accepts besides the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ContextOptions {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_seq_max: u32,
    pub n_threads: Option<i32>,
    pub embeddings: bool,
    pub pooling: Pooling,
    pub type_k: String,
    pub type_v: String,
    /// Flash attention (on by default, as in llama.cpp). Both attention paths of llama.cpp's
    /// CPU backend have batch- or layout-dependent rounding that Gemma 3 amplifies to ~0.8 in
    /// the logits: with flash attention a result depends on how tokens are grouped into a
    /// decode (n_batch, rows per commit); without it, on where the sequence's cells sit in the
    /// cache (odd vs even cell offsets), so a fork would not reproduce its twin. Flash
    /// attention keeps forks, twins and `retain_only` winners exact; `flash_attn=False` makes
    /// single-sequence prefill exact across n_batch.
    pub flash_attn: bool,
}

impl Default for ContextOptions {
    fn default() -> Self {
        ContextOptions {
            n_ctx: 2048,
            n_batch: 512,
            n_seq_max: 1,
            n_threads: None,
            embeddings: false,
            pooling: Pooling::Mean,
            type_k: "f16".into(),
            type_v: "f16".into(),
            flash_attn: true,
        }
    }
}

/// Threads to use when the caller does not say: every available core.
pub fn default_threads() -> i32 {
    std::thread::available_parallelism().map(|n| n.get() as i32).unwrap_or(4)
}

impl ContextOptions {
    /// Reject values llama.cpp would assert on, naming the field and the valid range.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_SEQ).contains(&self.n_seq_max) {
            return Err(LloyalError::invalid(format!(
                "n_seq_max must be in 1..={MAX_SEQ}, got {}",
                self.n_seq_max
            )));
        }
        if self.n_ctx < 8 {
            return Err(LloyalError::invalid(format!("n_ctx must be >= 8, got {}", self.n_ctx)));
        }
        if self.n_batch < 1 {
            return Err(LloyalError::invalid("n_batch must be >= 1"));
        }
        if let Some(t) = self.n_threads {
            if !(1..=1024).contains(&t) {
                return Err(LloyalError::invalid(format!("n_threads must be in 1..=1024, got {t}")));
            }
        }
        // llama.cpp reserves the mean-pooling graph with n_batch rounded up to a multiple of
        // n_seq_max but only n_batch output rows, and aborts on the shape mismatch.
        let mean = matches!(self.pooling, Pooling::Mean | Pooling::Rank);
        if self.embeddings && mean && self.n_batch % self.n_seq_max != 0 {
            return Err(LloyalError::invalid(format!(
                "with embeddings=True and pooling={:?}, n_batch must be a multiple of n_seq_max \
                 (got n_batch={}, n_seq_max={}); try n_batch={}",
                if self.pooling == Pooling::Mean { "mean" } else { "rank" },
                self.n_batch,
                self.n_seq_max,
                self.n_batch.div_ceil(self.n_seq_max) * self.n_seq_max
            )));
        }
        parse_kv_type("type_k", &self.type_k)?;
        let v = parse_kv_type("type_v", &self.type_v)?;
        let plain = [sys::GGML_TYPE_F32, sys::GGML_TYPE_F16, sys::GGML_TYPE_BF16];
        if !self.flash_attn && !plain.contains(&v) {
            return Err(LloyalError::invalid(format!(
                "type_v={:?} (a quantized V cache) needs flash_attn=True",
                self.type_v
            )));
        }
        Ok(())
    }

    /// llama.cpp params: unified KV and full-size SWA cache always (forks share prefix cells),
    /// one physical batch per logical batch, flash attention left to llama.cpp.
    pub fn to_llama(&self) -> Result<sys::llama_context_params> {
        self.validate()?;
        // SAFETY: returns a plain struct by value.
        let mut p = unsafe { sys::llama_context_default_params() };
        let threads = self.n_threads.unwrap_or_else(default_threads);
        p.n_ctx = self.n_ctx;
        p.n_batch = self.n_batch;
        p.n_ubatch = self.n_batch;
        p.n_seq_max = self.n_seq_max;
        // llama.cpp reserves max(outputs, n_seq_max) logit rows and asserts that fits in
        // n_outputs_max (default n_batch): an n_batch below n_seq_max would abort.
        p.n_outputs_max = self.n_batch.max(self.n_seq_max);
        p.n_threads = threads;
        p.n_threads_batch = threads;
        p.embeddings = self.embeddings;
        p.pooling_type = if self.embeddings { self.pooling.raw() } else { sys::LLAMA_POOLING_TYPE_NONE };
        p.type_k = parse_kv_type("type_k", &self.type_k)?;
        p.type_v = parse_kv_type("type_v", &self.type_v)?;
        p.flash_attn_type = if self.flash_attn {
            sys::LLAMA_FLASH_ATTN_TYPE_ENABLED
        } else {
            sys::LLAMA_FLASH_ATTN_TYPE_DISABLED
        };
        p.kv_unified = true;
        p.swa_full = true;
        p.no_perf = true;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_unified() {
        let p = ContextOptions::default().to_llama().unwrap();
        assert!(p.kv_unified && p.swa_full);
        assert_eq!(p.flash_attn_type, sys::LLAMA_FLASH_ATTN_TYPE_ENABLED);
        let off = ContextOptions { flash_attn: false, ..Default::default() };
        assert_eq!(off.to_llama().unwrap().flash_attn_type, sys::LLAMA_FLASH_ATTN_TYPE_DISABLED);
        assert_eq!((p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max), (2048, 512, 512, 1));
    }

    #[test]
    fn rejects_bad_options() {
        for o in [
            ContextOptions { n_seq_max: 0, ..Default::default() },
            ContextOptions { n_seq_max: 257, ..Default::default() },
            ContextOptions { n_batch: 0, ..Default::default() },
            ContextOptions { type_k: "f8".into(), ..Default::default() },
            ContextOptions { n_threads: Some(0), ..Default::default() },
            ContextOptions { type_v: "q8_0".into(), flash_attn: false, ..Default::default() },
            ContextOptions { embeddings: true, n_seq_max: 3, ..Default::default() },
        ] {
            assert!(matches!(o.validate(), Err(LloyalError::InvalidArgument(_))), "{o:?}");
        }
        assert!(Pooling::parse("max").is_err());
        let last =
            ContextOptions { embeddings: true, n_seq_max: 3, pooling: Pooling::Last, ..Default::default() };
        assert!(last.validate().is_ok(), "only mean pooling needs n_batch % n_seq_max == 0");
    }
}
