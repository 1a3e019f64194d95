//! Context options: defaults, validation and translation into llama.cpp's context params.

use llama_cpp_sys_2 as sys;

use crate::error::{LloyalError, Result};

/// How to load weights. Two loads with equal options and the same file share one [`crate::model::Model`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelOptions {
    /// Layers to offload to the GPU (0 = CPU only).
    pub n_gpu_layers: u32,
    /// Memory-map the file instead of reading it.
    pub use_mmap: bool,
    /// Let llama.cpp repack Q4 weights for its fastest CPU matmul (the default, as in llama.cpp).
    /// The repacked kernel multiplies rows in groups of 4, so a token's logits then depend on how
    /// many rows share its decode; batch-invariant contexts need `repack: false`.
    pub repack: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions { n_gpu_layers: 0, use_mmap: true, repack: true }
    }
}

/// The variable that gives the layers to offload when a load does not say
/// ([`ModelOptions::gpu_layers_or_env`]), as llama-server's `LLAMA_ARG_N_GPU_LAYERS` does.
pub const GPU_LAYERS_VAR: &str = "LLOYAL_N_GPU_LAYERS";

impl ModelOptions {
    /// The weights a context loading its own model should use: repacked (llama.cpp's fastest
    /// kernels) and with the layers [`GPU_LAYERS_VAR`] offloads, unless the context asks for
    /// batch invariance (`batch_invariant=True`): then on the CPU in the invariant layout (GPU
    /// kernels are not batch-invariant; the explicit request wins over the variable's default).
    pub fn for_context(batch_invariant: Option<bool>) -> Result<Self> {
        let n_gpu_layers = if batch_invariant == Some(true) { 0 } else { Self::gpu_layers_or_env(None)? };
        Ok(ModelOptions { repack: batch_invariant != Some(true), n_gpu_layers, ..Default::default() })
    }

    /// `given`, or else the count in [`GPU_LAYERS_VAR`] (0 when unset or empty). A value that
    /// is no count → `InvalidArgument`.
    pub fn gpu_layers_or_env(given: Option<u32>) -> Result<u32> {
        if let Some(n) = given {
            return Ok(n);
        }
        let value = std::env::var(GPU_LAYERS_VAR).unwrap_or_default();
        if value.trim().is_empty() {
            return Ok(0);
        }
        value.trim().parse().map_err(|_| {
            LloyalError::InvalidArgument(format!(
                "{GPU_LAYERS_VAR}={value:?} is not a layer count: set it to a whole number \
                 (0 = CPU only, 99 = every layer) or unset it"
            ))
        })
    }
}

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

    /// The pooling a GGUF declares as `<arch>.pooling_type` (llama_pooling_type); None if unknown.
    pub fn from_gguf(value: u64) -> Option<Self> {
        Some(match value {
            0 => Pooling::None,
            1 => Pooling::Mean,
            2 => Pooling::Cls,
            3 => Pooling::Last,
            4 => Pooling::Rank,
            _ => return None,
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

/// The K cache type when none is given: q8_0 keeps flash attention on its one-row kernel.
fn default_type_k(batch_invariant: bool) -> &'static str {
    if batch_invariant {
        "q8_0"
    } else {
        "f16"
    }
}

/// f16, or f32 (which llama.cpp's flash attention casts to f16).
fn f16_class(t: sys::ggml_type) -> bool {
    t == sys::GGML_TYPE_F16 || t == sys::GGML_TYPE_F32
}

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
    /// Pooling of embeddings; `None` takes the model's own (`<arch>.pooling_type` in the
    /// GGUF), else mean (see [`ContextOptions::with_model_pooling`]).
    pub pooling: Option<Pooling>,
    /// K cache type; `None` picks `q8_0` for a batch-invariant context, else `f16`.
    pub type_k: Option<String>,
    pub type_v: String,
    /// Flash attention (on by default, as in llama.cpp).
    pub flash_attn: bool,
    /// Batch-invariant kernels: a token's logits do not depend on which other rows share its
    /// decode, nor on where its sequence's cells sit in the cache. `None` turns them on when
    /// the model allows it (see [`ContextOptions::resolve`]).
    pub batch_invariant: Option<bool>,
    /// Whether branches keep their sampling perplexity. Off, a decode's summary of each row
    /// takes one exponential a value instead of two (the sum at `1 / temperature`).
    pub sampling_perplexity: bool,
    /// LoRA adapters applied to every decode, with their scales (fixed for the context's life).
    pub lora: Vec<crate::lora::LoraUse>,
}

impl Default for ContextOptions {
    fn default() -> Self {
        ContextOptions {
            n_ctx: 2048,
            n_batch: 512,
            n_seq_max: 1,
            n_threads: None,
            embeddings: false,
            pooling: None,
            type_k: None,
            type_v: "f16".into(),
            flash_attn: true,
            batch_invariant: None,
            sampling_perplexity: true,
            lora: Vec::new(),
        }
    }
}

/// Threads to use when the caller does not say: every available core.
pub fn default_threads() -> i32 {
    std::thread::available_parallelism().map(|n| n.get() as i32).unwrap_or(4)
}

impl ContextOptions {
    /// Whether the context gets one hidden extra sequence id (`n_seq_max`) where the cells of
    /// pruned branches are parked (see `ContextState::park_cells`). Only batch-invariant
    /// contexts park: parking keeps a survivor's cells in position order, which only matters
    /// where its logits must equal a lone run's, and parked cells stay in every later
    /// decode's attention span until the cache fills (a KV cache full of parked cells made
    /// prefill ~1.8x slower, docs/performance.md). Not for embeddings contexts (no decode
    /// order to keep; their pooling ties `n_batch` to `n_seq_max`) and not when `n_seq_max`
    /// already takes every id llama.cpp has.
    pub fn parks_freed_cells(&self) -> bool {
        self.is_batch_invariant() && !self.embeddings && self.n_seq_max < MAX_SEQ
    }

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
        // (An unset pooling is checked once the model's own has filled it in.)
        // llama.cpp takes n_batch down to n_ctx; an n_batch above n_ctx goes down to a multiple
        // of n_seq_max below n_ctx here ([`Self::llama_n_batch`]).
        let mean = self.pools_by_mean();
        if mean && self.n_ctx < self.n_seq_max {
            return Err(LloyalError::invalid(format!(
                "with embeddings=True and mean pooling, n_ctx ({}) must be at least n_seq_max ({})",
                self.n_ctx, self.n_seq_max
            )));
        }
        if mean && self.n_batch <= self.n_ctx && !self.n_batch.is_multiple_of(self.n_seq_max) {
            return Err(LloyalError::invalid(format!(
                "with embeddings=True and pooling={:?}, n_batch must be a multiple of n_seq_max \
                 (got n_batch={}, n_seq_max={}); try n_batch={}",
                if self.pooling == Some(Pooling::Mean) { "mean" } else { "rank" },
                self.n_batch,
                self.n_seq_max,
                match self.n_batch.div_ceil(self.n_seq_max) * self.n_seq_max {
                    up if up <= self.n_ctx => up,
                    _ => self.n_batch / self.n_seq_max * self.n_seq_max,
                }
            )));
        }
        if let Some(k) = &self.type_k {
            parse_kv_type("type_k", k)?;
        }
        let v = parse_kv_type("type_v", &self.type_v)?;
        let plain = [sys::GGML_TYPE_F32, sys::GGML_TYPE_F16, sys::GGML_TYPE_BF16];
        if !self.flash_attn && !plain.contains(&v) {
            return Err(LloyalError::invalid(format!(
                "type_v={:?} (a quantized V cache) needs flash_attn=True",
                self.type_v
            )));
        }
        if self.batch_invariant == Some(true) {
            if !self.flash_attn {
                return Err(LloyalError::invalid(
                    "batch_invariant=True needs flash_attn=True (without flash attention llama.cpp \
                     multiplies one-row and many-row batches with different kernels); \
                     pass batch_invariant=False to run without flash attention",
                ));
            }
            if self.explicit_f16_pair() {
                return Err(LloyalError::invalid(format!(
                    "batch_invariant=True cannot use type_k={:?} with type_v={:?}: with both in \
                     f16/f32 llama.cpp switches flash-attention kernels by batch size; leave \
                     type_k unset (q8_0), quantize one of them, or pass batch_invariant=False",
                    self.type_k.as_deref().unwrap_or_default(),
                    self.type_v
                )));
            }
        }
        Ok(())
    }

    /// Whether `type_k` was given and both cache types are f16-class (which rules out the
    /// one-row flash-attention kernel). An unparsable type counts as not f16-class.
    fn explicit_f16_pair(&self) -> bool {
        let class = |field: &str, t: &str| parse_kv_type(field, t).is_ok_and(f16_class);
        self.type_k.as_deref().is_some_and(|k| class("type_k", k) && class("type_v", &self.type_v))
    }

    /// Fill an unset `pooling` with the model's own (`model_pooling`, from its GGUF), else mean.
    pub fn with_model_pooling(mut self, model_pooling: Option<Pooling>) -> ContextOptions {
        self.pooling = self.pooling.or(model_pooling).or(Some(Pooling::Mean));
        self
    }

    /// The pooling in effect (mean while unset).
    pub fn pooling(&self) -> Pooling {
        self.pooling.unwrap_or(Pooling::Mean)
    }

    /// Settle `batch_invariant` and `type_k` for a model loaded with `model`. Batch invariance
    /// needs llama.cpp's per-row kernels everywhere: weights not repacked, ggml's tiled K-quant
    /// matmul off (see `tiled`), flash attention on its one-row-at-a-time path (taken when K
    /// and V are not both f16: the K cache defaults to q8_0), and the CPU. `None` turns it on
    /// when all of that holds; `Some(true)` says which part does not. `float_weights` names the
    /// weight type of a float (F32/F16/BF16) model: llama.cpp multiplies those with llamafile's
    /// sgemm for 2+ rows and with a differently ordered dot product for one row, so they are
    /// never batch-invariant (quantized weights take the same per-block order either way).
    pub fn resolve(&self, model: &ModelOptions, float_weights: Option<&str>) -> Result<ContextOptions> {
        self.validate()?;
        let mut out = self.clone();
        let float_blocker = float_weights.map(|t| {
            format!(
                "the model's weights are {t}, which llama.cpp multiplies with one kernel for a single \
                 row and another (llamafile sgemm) for 2+ rows; use a quantized model (e.g. Q8_0)"
            )
        });
        let blocker = if model.n_gpu_layers > 0 {
            Some(
                "the model was loaded with n_gpu_layers > 0, for a GPU, whose kernels are not \
                 batch-invariant (n_gpu_layers=0 keeps it on the CPU)"
                    .into(),
            )
        } else if model.repack {
            Some(
                "the model was loaded with repack=True, whose Q4 kernel multiplies rows in groups of 4"
                    .into(),
            )
        } else if !self.lora.is_empty() {
            Some(
                "the context applies LoRA adapters, whose float matrices llama.cpp multiplies with one \
                 kernel for a single row and another (llamafile sgemm) for 2+ rows"
                    .into(),
            )
        } else {
            float_blocker
        };
        let mut on = match (self.batch_invariant, blocker) {
            (Some(true), Some(why)) => return Err(not_possible(&why)),
            (Some(on), _) => on,
            (None, blocker) => blocker.is_none() && self.flash_attn && !self.explicit_f16_pair(),
        };
        if on {
            // The tiled matmul must be off: claim the process-wide switch (a decode elsewhere
            // may have latched it on), or say why not.
            if let Err(why) = crate::tiled::keep_off() {
                if self.batch_invariant == Some(true) {
                    return Err(not_possible(&why));
                }
                on = false;
            }
        }
        out.batch_invariant = Some(on);
        out.type_k = Some(self.type_k.clone().unwrap_or_else(|| default_type_k(on).into()));
        Ok(out)
    }

    /// The n_batch to give llama.cpp: `n_batch`, or for mean-pooled embeddings with an n_batch
    /// above n_ctx (which llama.cpp would take down to n_ctx) the largest multiple of n_seq_max
    /// up to n_ctx: llama.cpp reserves that pooling's graph for n_batch rounded up to a multiple
    /// of n_seq_max and aborts when the rounding changes it.
    fn llama_n_batch(&self) -> u32 {
        if self.pools_by_mean() && self.n_batch > self.n_ctx {
            (self.n_ctx / self.n_seq_max.max(1)).max(1) * self.n_seq_max.max(1)
        } else {
            self.n_batch
        }
    }

    /// Whether this is an embeddings context pooled by mean (or rank), whose graph llama.cpp
    /// reserves for n_batch rounded up to a multiple of n_seq_max.
    fn pools_by_mean(&self) -> bool {
        self.embeddings && matches!(self.pooling, Some(Pooling::Mean | Pooling::Rank))
    }

    /// Whether this (resolved) context runs batch-invariant kernels.
    pub fn is_batch_invariant(&self) -> bool {
        self.batch_invariant == Some(true)
    }

    /// llama.cpp params: unified KV and full-size SWA cache always (forks share prefix cells),
    /// one physical batch per logical batch.
    pub fn to_llama(&self) -> Result<sys::llama_context_params> {
        self.validate()?;
        let mut p = crate::raw::default_context_params();
        let threads = self.n_threads.unwrap_or_else(default_threads);
        p.n_ctx = self.n_ctx;
        p.n_batch = self.llama_n_batch();
        p.n_ubatch = p.n_batch;
        p.n_seq_max = self.n_seq_max + u32::from(self.parks_freed_cells());
        // llama.cpp reserves max(outputs, n_seq_max) logit rows and asserts that fits in
        // n_outputs_max (default n_batch): an n_batch below n_seq_max would abort.
        p.n_outputs_max = self.n_batch.max(p.n_seq_max);
        p.n_threads = threads;
        p.n_threads_batch = threads;
        p.embeddings = self.embeddings;
        p.pooling_type = if self.embeddings { self.pooling().raw() } else { sys::LLAMA_POOLING_TYPE_NONE };
        let default_k = default_type_k(self.is_batch_invariant());
        p.type_k = parse_kv_type("type_k", self.type_k.as_deref().unwrap_or(default_k))?;
        p.type_v = parse_kv_type("type_v", &self.type_v)?;
        p.flash_attn_type = if self.flash_attn {
            sys::LLAMA_FLASH_ATTN_TYPE_ENABLED
        } else {
            sys::LLAMA_FLASH_ATTN_TYPE_DISABLED
        };
        p.kv_unified = true;
        p.swa_full = true;
        p.no_perf = true;
        // With a GPU backend loaded, llama.cpp sends the matmuls of large batches to the GPU even
        // for weights on the CPU (op_offload); GPU kernels are not batch-invariant, so an
        // invariant context keeps every op on the CPU (seen on an H200: a packed prefill's
        // logits differed from one prompt's alone).
        p.op_offload = !self.is_batch_invariant();
        Ok(p)
    }
}

fn not_possible(why: &str) -> LloyalError {
    LloyalError::invalid(format!(
        "batch_invariant=True is not possible here: {why}; pass batch_invariant=False"
    ))
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
        // The fast kernels: no hidden sequence, pruned branches' cells are freed at once.
        assert_eq!((p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max), (2048, 512, 512, 1));
        // Batch-invariant: one sequence for the user plus the hidden one that parks them.
        let inv = ContextOptions { batch_invariant: Some(true), ..Default::default() };
        assert!(inv.parks_freed_cells());
        assert!(p.op_offload && !inv.to_llama().unwrap().op_offload, "invariant: no op on a GPU");
        assert_eq!(inv.to_llama().unwrap().n_seq_max, 2);
        let embed = ContextOptions { embeddings: true, ..inv.clone() };
        assert_eq!(embed.to_llama().unwrap().n_seq_max, 1);
        let all = ContextOptions { n_seq_max: MAX_SEQ, ..inv };
        assert_eq!(all.to_llama().unwrap().n_seq_max, MAX_SEQ);
    }

    #[test]
    fn rejects_bad_options() {
        for o in [
            ContextOptions { n_seq_max: 0, ..Default::default() },
            ContextOptions { n_seq_max: 257, ..Default::default() },
            ContextOptions { n_batch: 0, ..Default::default() },
            ContextOptions { type_k: Some("f8".into()), ..Default::default() },
            ContextOptions { n_threads: Some(0), ..Default::default() },
            ContextOptions { type_v: "q8_0".into(), flash_attn: false, ..Default::default() },
            ContextOptions {
                embeddings: true,
                n_seq_max: 3,
                pooling: Some(Pooling::Mean),
                ..Default::default()
            },
        ] {
            assert!(matches!(o.validate(), Err(LloyalError::InvalidArgument(_))), "{o:?}");
        }
        assert!(Pooling::parse("max").is_err());
        let last = ContextOptions {
            embeddings: true,
            n_seq_max: 3,
            pooling: Some(Pooling::Last),
            ..Default::default()
        };
        assert!(last.validate().is_ok(), "only mean pooling needs n_batch % n_seq_max == 0");
        // Unset pooling: the model's own wins, mean when it has none; the mean check then runs.
        let unset = ContextOptions { embeddings: true, n_seq_max: 3, ..Default::default() };
        assert!(unset.validate().is_ok());
        assert_eq!(unset.clone().with_model_pooling(Some(Pooling::Last)).pooling, Some(Pooling::Last));
        let mean = unset.with_model_pooling(None);
        assert_eq!(mean.pooling, Some(Pooling::Mean));
        assert!(matches!(mean.validate(), Err(LloyalError::InvalidArgument(_))));
    }

    fn with(
        batch_invariant: Option<bool>,
        type_k: Option<&str>,
        type_v: &str,
        flash_attn: bool,
    ) -> ContextOptions {
        ContextOptions {
            batch_invariant,
            type_k: type_k.map(str::to_string),
            type_v: type_v.into(),
            flash_attn,
            ..Default::default()
        }
    }

    #[test]
    fn batch_invariance_resolves_from_the_model_and_cache_types() {
        // As a process that wants batch invariance after other decodes would: the switch is off.
        std::env::set_var(crate::tiled::TILED_MATMUL, "0");
        // The default weights are repacked: a default context runs the fast kernels.
        let fast = ContextOptions::default().resolve(&ModelOptions::default(), None).unwrap();
        assert_eq!((fast.batch_invariant, fast.type_k.as_deref()), (Some(false), Some("f16")));
        let for_context = |invariant| ModelOptions::for_context(invariant).unwrap();
        assert!(for_context(None).repack && for_context(Some(false)).repack);
        assert!(!for_context(Some(true)).repack);
        let cpu = ModelOptions { repack: false, ..ModelOptions::default() };
        let auto = ContextOptions::default().resolve(&cpu, None).unwrap();
        assert_eq!((auto.batch_invariant, auto.type_k.as_deref()), (Some(true), Some("q8_0")));
        let p = auto.to_llama().unwrap();
        assert_eq!((p.type_k, p.type_v), (sys::GGML_TYPE_Q8_0, sys::GGML_TYPE_F16));
        // Anything that needs a batch-dependent kernel turns auto off and keeps K at f16...
        for (opts, model) in [
            (with(None, None, "f16", false), cpu),
            (with(None, Some("f16"), "f16", true), cpu),
            (with(None, None, "f16", true), ModelOptions { repack: true, ..cpu }),
            (with(None, None, "f16", true), ModelOptions { n_gpu_layers: 99, ..cpu }),
        ] {
            let r = opts.resolve(&model, None).unwrap();
            assert_eq!((r.batch_invariant, r.type_k.as_deref()), (Some(false), Some("f16")), "{opts:?}");
        }
        // ...and an explicit request names the obstacle.
        for (opts, model, needle) in [
            (with(Some(true), None, "f16", false), cpu, "flash_attn"),
            (with(Some(true), Some("f32"), "f16", true), cpu, "type_k"),
            (with(Some(true), None, "f16", true), ModelOptions { repack: true, ..cpu }, "repack"),
            (with(Some(true), None, "f16", true), ModelOptions { n_gpu_layers: 1, ..cpu }, "GPU"),
        ] {
            match opts.resolve(&model, None) {
                Err(LloyalError::InvalidArgument(m)) => assert!(m.contains(needle), "{m}"),
                other => panic!("{opts:?}: {other:?}"),
            }
        }
        // Explicit quantized or mixed cache types keep invariance.
        let v8 = with(Some(true), Some("f16"), "q8_0", true).resolve(&cpu, None).unwrap();
        assert_eq!((v8.batch_invariant, v8.type_k.as_deref()), (Some(true), Some("f16")));
        let off = with(Some(false), None, "f16", true).resolve(&cpu, None).unwrap();
        assert_eq!((off.batch_invariant, off.type_k.as_deref()), (Some(false), Some("f16")));
        // Float weights: auto is off, an explicit request says why.
        let f32 = ContextOptions::default().resolve(&cpu, Some("F32")).unwrap();
        assert_eq!((f32.batch_invariant, f32.type_k.as_deref()), (Some(false), Some("f16")));
        match with(Some(true), None, "f16", true).resolve(&cpu, Some("BF16")) {
            Err(LloyalError::InvalidArgument(m)) => assert!(m.contains("weights are BF16"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
