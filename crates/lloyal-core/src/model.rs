//! Loaded model weights and vocabulary: loading (shared per path), tokenizer, token queries.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use std::ffi::CString;

use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_sys_2 as sys;

use crate::backend::{backend, clear_recent_errors, recent_errors_or};
use crate::error::{LloyalError, Result};
use crate::model_file::check_gguf_file;
use crate::options::ModelOptions;
use crate::raw::{load_model, Weights};

type RegistryKey = (PathBuf, ModelOptions);
static REGISTRY: Mutex<Option<HashMap<RegistryKey, Weak<Model>>>> = Mutex::new(None);

/// Model weights plus vocabulary facts read once at load time.
pub struct Model {
    /// DRY samplers made for this vocabulary, cloned for new ones (first: freed before the
    /// weights, though they hold nothing of them).
    dry_prototypes: crate::sampler::DryPrototypes,
    llama: LlamaModel,
    path: PathBuf,
    options: ModelOptions,
    n_vocab: i32,
    /// Bytes of the mappings the load created that it asked to be backed by huge pages.
    huge_page_bytes: usize,
    /// Tokens allowed at the start rule of recently used grammars, keyed by (rules, root).
    grammar_starts: Mutex<Vec<GrammarStart>>,
    /// llguidance's parser factory (token trie over the vocabulary), built on first use.
    llg_factory: OnceLock<std::result::Result<Arc<llguidance::ParserFactory>, String>>,
    /// Every end-of-generation token, found on first use.
    eog_tokens: OnceLock<Arc<Vec<i32>>>,
}

/// A grammar's (rules, root) and the tokens its start rule allows.
type GrammarStart = ((String, String), Arc<Vec<i32>>);

/// How many grammars' start sets a model keeps.
const GRAMMAR_STARTS: usize = 32;

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("path", &self.path).field("n_vocab", &self.n_vocab).finish()
    }
}

impl Model {
    /// Load `path` (or return the already-loaded weights for the same file and options).
    pub fn load(path: &Path, options: ModelOptions) -> Result<Arc<Model>> {
        check_gguf_file(path)?;
        let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let key = (canonical.clone(), options);
        let mut guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        let registry = guard.get_or_insert_with(HashMap::new);
        registry.retain(|_, w| w.strong_count() > 0);
        if let Some(model) = registry.get(&key).and_then(Weak::upgrade) {
            return Ok(model);
        }
        let model = Arc::new(Self::load_uncached(&canonical, options)?);
        registry.insert(key, Arc::downgrade(&model));
        Ok(model)
    }

    fn load_uncached(path: &Path, options: ModelOptions) -> Result<Model> {
        let fail = |reason: String| LloyalError::ModelLoad { path: path.display().to_string(), reason };
        let text = path.to_str().ok_or_else(|| fail("the path is not valid UTF-8".into()))?;
        let cpath = CString::new(text).map_err(|_| fail("the path contains a NUL byte".into()))?;
        backend();
        clear_recent_errors();
        // On a thread of its own: the OpenMP pool of a parallel repack ends with it (see `omp`).
        let load = || {
            let mut params = crate::raw::default_model_params();
            params.n_gpu_layers = i32::try_from(options.n_gpu_layers).unwrap_or(i32::MAX);
            params.load_mode =
                if options.use_mmap { sys::LLAMA_LOAD_MODE_MMAP } else { sys::LLAMA_LOAD_MODE_NONE };
            params.use_extra_bufts = options.repack;
            // The weight buffers get huge pages before llama.cpp reads into them (hugepages.rs).
            let mut advisor = crate::hugepages::Advisor::new();
            params.progress_callback = Some(crate::hugepages::Advisor::callback);
            params.progress_callback_user_data = std::ptr::addr_of_mut!(advisor).cast();
            let llama = load_model(&cpath, params);
            llama.map(|llama| (llama, advisor.advised))
        };
        let (llama, huge_page_bytes) = crate::omp::on_own_thread(load)
            .ok_or_else(|| fail(recent_errors_or("llama.cpp could not load it")))?;
        let n_vocab = llama.n_vocab();
        Ok(Model {
            dry_prototypes: Default::default(),
            llama,
            path: path.to_path_buf(),
            options,
            n_vocab,
            huge_page_bytes,
            grammar_starts: Mutex::new(Vec::new()),
            llg_factory: OnceLock::new(),
            eog_tokens: OnceLock::new(),
        })
    }

    /// The DRY samplers made for this model's vocabulary (`sampler`).
    pub(crate) fn dry_prototypes(&self) -> &crate::sampler::DryPrototypes {
        &self.dry_prototypes
    }

    /// The underlying llama-cpp-2 model.
    pub fn llama(&self) -> &LlamaModel {
        &self.llama
    }

    /// The file the weights came from (canonicalised).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Options the weights were loaded with.
    pub fn options(&self) -> ModelOptions {
        self.options
    }

    /// Bytes of the weights' mappings the load asked the kernel to back with 2 MiB pages (the
    /// weights it read into memory: all of them with `use_mmap` off, the repacked ones with it
    /// on; 0 off Linux). See [`crate::hugepages`].
    pub fn huge_page_bytes(&self) -> usize {
        self.huge_page_bytes
    }

    /// Vocabulary size.
    pub fn n_vocab(&self) -> i32 {
        self.n_vocab
    }

    /// Context length the model was trained with.
    pub fn n_ctx_train(&self) -> u32 {
        self.llama.n_ctx_train()
    }

    /// Embedding width.
    pub fn n_embd(&self) -> i32 {
        self.llama.n_embd()
    }

    /// The window of its sliding-window attention layers, in positions (0: none). llama.cpp
    /// saves only the last window of a sequence's cells for those layers (`state_write`).
    pub fn n_swa(&self) -> i32 {
        crate::raw::model_n_swa(&self.llama)
    }

    /// Number of layers.
    pub fn n_layer(&self) -> u32 {
        self.llama.n_layer()
    }

    /// Parameter count.
    pub fn n_params(&self) -> u64 {
        self.llama.n_params()
    }

    /// Size of the weights in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.llama.size()
    }

    /// A GGUF metadata string value, if present.
    pub fn meta(&self, key: &str) -> Option<String> {
        self.llama.meta_val_str(key).ok()
    }

    /// `general.architecture` (e.g. "gemma3").
    pub fn architecture(&self) -> String {
        self.meta("general.architecture").unwrap_or_default()
    }

    /// The Jinja chat template stored in the file, if any.
    pub fn chat_template(&self) -> Option<String> {
        self.meta("tokenizer.chat_template")
    }

    /// The weight type of a float model (`general.file_type` all F32, mostly F16 or mostly
    /// BF16), whose matmuls llama.cpp runs with batch-size-dependent kernels; None otherwise.
    pub fn float_weights(&self) -> Option<&'static str> {
        match self.meta("general.file_type")?.trim().parse::<u32>().ok()? {
            0 => Some("F32"),
            1 => Some("F16"),
            32 => Some("BF16"),
            _ => None,
        }
    }

    /// The embedding pooling this model declares (`<arch>.pooling_type`), if any.
    pub fn pooling(&self) -> Option<crate::options::Pooling> {
        self.meta_u64("pooling_type").and_then(crate::options::Pooling::from_gguf)
    }

    fn meta_u64(&self, suffix: &str) -> Option<u64> {
        let key = format!("{}.{suffix}", self.architecture());
        self.meta(&key)?.trim().parse().ok()
    }

    /// Bytes of K and V per KV cell across all layers, for cache types `type_k`/`type_v`
    /// (from GGUF metadata; head width falls back to n_embd / n_head).
    pub fn kv_bytes_per_cell(&self, type_k: sys::ggml_type, type_v: sys::ggml_type) -> u64 {
        let n_layer = u64::from(self.n_layer());
        let n_head = self.meta_u64("attention.head_count").unwrap_or(1).max(1);
        let n_head_kv = self.meta_u64("attention.head_count_kv").unwrap_or(n_head);
        let head = self.n_embd().max(0) as u64 / n_head;
        let k = self.meta_u64("attention.key_length").unwrap_or(head) * n_head_kv;
        let v = self.meta_u64("attention.value_length").unwrap_or(head) * n_head_kv;
        let (kb, vb) = (crate::raw::row_size(type_k, k as i64), crate::raw::row_size(type_v, v as i64));
        n_layer * (kb as u64 + vb as u64)
    }

    /// Check that `token` is a valid id for this vocabulary.
    pub fn check_token(&self, token: i64) -> Result<i32> {
        if token < 0 || token >= i64::from(self.n_vocab) {
            return Err(LloyalError::InvalidToken { token, n_vocab: self.n_vocab });
        }
        Ok(token as i32)
    }

    /// Check every token of a slice.
    pub fn check_tokens(&self, tokens: &[i32]) -> Result<()> {
        tokens.iter().try_for_each(|&t| self.check_token(i64::from(t)).map(|_| ()))
    }

    /// Tokenize UTF-8 text. `parse_special` turns `<start_of_turn>`-style text into control tokens.
    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<i32> {
        self.llama
            .vocab()
            .tokenize(text.as_bytes(), add_special, parse_special)
            .into_iter()
            .map(|t| t.0)
            .collect()
    }

    /// Detokenize to text (invalid UTF-8 replaced by U+FFFD). `special` renders control tokens.
    pub fn detokenize(&self, tokens: &[i32], special: bool) -> Result<String> {
        self.check_tokens(tokens)?;
        let tokens: Vec<LlamaToken> = tokens.iter().map(|&t| LlamaToken(t)).collect();
        let bytes = self.llama.vocab().detokenize(&tokens, false, special);
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The raw bytes of one token's piece (may be a partial UTF-8 sequence).
    pub fn token_bytes(&self, token: i32, special: bool) -> Result<Vec<u8>> {
        self.check_token(i64::from(token))?;
        Ok(self.llama.vocab().token_to_piece(LlamaToken(token), special, None))
    }

    /// Whether `token` ends generation (EOS, EOT, `<end_of_turn>`...).
    pub fn is_eog(&self, token: i32) -> bool {
        token >= 0 && token < self.n_vocab && self.llama.vocab().is_eog(LlamaToken(token))
    }

    /// Every token [`Self::is_eog`] holds, in id order (one pass over the vocabulary, once).
    pub fn eog_tokens(&self) -> Arc<Vec<i32>> {
        Arc::clone(
            self.eog_tokens.get_or_init(|| Arc::new((0..self.n_vocab).filter(|&t| self.is_eog(t)).collect())),
        )
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> i32 {
        self.llama.vocab().bos().0
    }

    /// The model's end-of-generation token (EOT when the model has one, else EOS).
    pub fn eog(&self) -> i32 {
        let vocab = self.llama.vocab();
        let eot = vocab.eot().0;
        if eot >= 0 {
            eot
        } else {
            vocab.eos().0
        }
    }

    /// The chat convention of this model (from its template, else its architecture).
    pub fn chat_family(&self) -> Option<crate::ChatFamily> {
        crate::ChatFamily::detect(self.chat_template().as_deref(), &self.architecture())
    }

    /// Tokens that close a turn and lead to the next (`<end_of_turn>\n` on Gemma); the
    /// end-of-generation token alone for a model with no known chat convention.
    pub fn turn_separator(&self) -> Vec<i32> {
        match self.chat_family() {
            // Mistral closes a turn with EOS itself, whatever its text in this vocabulary.
            Some(crate::ChatFamily::Mistral) if self.eos_token() >= 0 => vec![self.eos_token()],
            Some(family) => self.tokenize(family.turn_separator(), false, true),
            None => vec![self.eog()],
        }
    }

    /// The start-rule token set of grammar (`gbnf`, `root`), from the cache or `compute`
    /// (run without the lock held).
    pub(crate) fn grammar_start(
        &self,
        gbnf: &str,
        root: &str,
        compute: impl FnOnce() -> Vec<i32>,
    ) -> Arc<Vec<i32>> {
        let lock = || self.grammar_starts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(hit) = lock().iter().find(|e| e.0 .0 == gbnf && e.0 .1 == root) {
            return hit.1.clone();
        }
        let set = Arc::new(compute());
        let mut cache = lock();
        if cache.len() >= GRAMMAR_STARTS {
            cache.remove(0);
        }
        cache.push(((gbnf.to_string(), root.to_string()), set.clone()));
        set
    }

    /// llguidance's parser factory for this model, built by `build` once (later calls, also
    /// after a failure, return the first outcome).
    pub(crate) fn llg_factory(
        &self,
        build: impl FnOnce() -> std::result::Result<Arc<llguidance::ParserFactory>, String>,
    ) -> std::result::Result<Arc<llguidance::ParserFactory>, String> {
        self.llg_factory.get_or_init(build).clone()
    }
}

impl Weights for Model {
    fn llama(&self) -> &LlamaModel {
        Model::llama(self)
    }

    fn n_vocab(&self) -> i32 {
        Model::n_vocab(self)
    }
}
