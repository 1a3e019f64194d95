//! `lloyal.Model`: loaded weights and vocabulary, shared by contexts.

use std::path::PathBuf;
use std::sync::Arc;

use lloyal_core::{Model, ModelOptions};
use pyo3::prelude::*;

use crate::convert::int_arg;
use crate::detach::detached;
use crate::error::IntoPyResult;
use crate::lora::PyLoraAdapter;

/// Model weights (thread-safe; shared by every context created from it).
///
/// ``Model(path, *, n_gpu_layers=None, use_mmap=True, repack=True)`` loads (or shares) the
/// weights of a GGUF file: a path opened twice loads once. ``n_gpu_layers`` layers run on a GPU
/// in a build with a GPU backend; left out, it is ``$LLOYAL_N_GPU_LAYERS`` (0 when unset).
/// ``repack=True`` (the default, as in llama.cpp) lets llama.cpp rearrange Q4 weights for its
/// fastest CPU matmul, which multiplies rows in groups of 4: a token's logits then depend on
/// how many rows share its decode, so contexts of such a model are not batch-invariant; load
/// with ``repack=False`` for those.
///
/// Raises:
///     ModelLoadError: the file is missing, not a GGUF, or of an unsupported architecture.
///     ValueError: ``LLOYAL_N_GPU_LAYERS`` is set to something other than a whole number.
///
/// Example:
///     >>> m = Model(default_model_path())
///     >>> m.architecture
///     'gemma3'
#[pyclass(name = "Model", module = "lloyal._lloyal", frozen)]
pub struct PyModel {
    pub(crate) inner: Arc<Model>,
}

impl PyModel {
    /// Load `path` with the GIL released (weights are shared per path and options).
    pub(crate) fn load(py: Python<'_>, path: PathBuf, options: ModelOptions) -> PyResult<Arc<Model>> {
        detached(py, move || Model::load(&path, options))
    }
}

/// Raise ``ModelLoadError`` unless ``path`` is a readable GGUF file with a plausible header (the
/// check ``Model`` makes before llama.cpp reads a file), without loading it.
#[pyfunction(name = "_check_model_file")]
pub fn check_model_file(path: PathBuf) -> PyResult<()> {
    lloyal_core::model_file::check_gguf_file(&path).py()
}

#[pymethods]
impl PyModel {
    #[new]
    #[pyo3(signature = (path, *, n_gpu_layers=None, use_mmap=true, repack=true))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        n_gpu_layers: Option<&Bound<'_, PyAny>>,
        use_mmap: bool,
        repack: bool,
    ) -> PyResult<Self> {
        let n_gpu_layers =
            n_gpu_layers.map(|n| int_arg::<u32>("n_gpu_layers", n, ">= 0 (99: every layer)")).transpose()?;
        let n_gpu_layers = ModelOptions::gpu_layers_or_env(n_gpu_layers).py()?;
        let inner = Self::load(py, path, ModelOptions { n_gpu_layers, use_mmap, repack })?;
        Ok(PyModel { inner })
    }

    /// Whether llama.cpp repacked the weights for its fastest (batch-dependent) CPU kernels.
    #[getter]
    fn repack(&self) -> bool {
        self.inner.options().repack
    }

    /// Path of the GGUF file.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_path_buf()
    }

    /// Vocabulary size.
    #[getter]
    fn n_vocab(&self) -> i32 {
        self.inner.n_vocab()
    }

    /// Training context length.
    #[getter]
    fn n_ctx_train(&self) -> u32 {
        self.inner.n_ctx_train()
    }

    /// Embedding width.
    #[getter]
    fn n_embd(&self) -> i32 {
        self.inner.n_embd()
    }

    /// Number of layers.
    #[getter]
    fn n_layer(&self) -> u32 {
        self.inner.n_layer()
    }

    /// Number of parameters.
    #[getter]
    fn n_params(&self) -> u64 {
        self.inner.n_params()
    }

    /// Size of the weights in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.inner.size_bytes()
    }

    /// Bytes of the weights' memory the load asked the kernel to back with 2 MiB pages (Linux):
    /// all the weights with ``use_mmap=False``, the repacked ones with ``use_mmap=True``
    /// (mapped file pages stay 4 KiB). A decode reads every weight each step, and huge pages
    /// spare it TLB misses; 0 elsewhere.
    #[getter]
    fn huge_page_bytes(&self) -> usize {
        self.inner.huge_page_bytes()
    }

    /// Architecture name from the GGUF metadata (e.g. ``"gemma3"``).
    #[getter]
    fn architecture(&self) -> String {
        self.inner.architecture()
    }

    /// The model's Jinja chat template, or None.
    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template()
    }

    /// A GGUF metadata value as a string, or None.
    fn meta(&self, key: &str) -> Option<String> {
        self.inner.meta(key)
    }

    /// Load the LoRA adapter at ``path`` for this model (or return the one already loaded
    /// from that file); apply it with ``Context(model, lora=[adapter])``.
    ///
    /// Raises:
    ///     ModelLoadError: the file is missing, not a GGUF, not a LoRA adapter, made for
    ///         another architecture or with tensors of the wrong shape for this model, or an
    ///         activated LoRA (aLoRA), which lloyal does not apply.
    fn load_lora(&self, py: Python<'_>, path: PathBuf) -> PyResult<PyLoraAdapter> {
        PyLoraAdapter::load(py, &self.inner, path)
    }

    fn __repr__(&self) -> String {
        format!(
            "Model(path={:?}, architecture={:?}, n_vocab={})",
            self.inner.path().display().to_string(),
            self.inner.architecture(),
            self.inner.n_vocab()
        )
    }
}
