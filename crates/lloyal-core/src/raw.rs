//! The only place that holds raw llama.cpp pointers: the context and batch wrappers.
//!
//! llama-cpp-2's `LlamaContext`/`LlamaBatch` hide their pointers, and lloyal needs calls they
//! do not wrap (row logits without panics, per-sequence state I/O, abort callbacks), so the
//! context and batch are owned here at the sys level; the model stays a llama-cpp-2 value.

use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_2::model::LlamaModel;
use llama_cpp_sys_2 as sys;

use crate::model::Model;

// `LlamaModel` is `#[repr(transparent)]` over a `NonNull<llama_model>` (llama-cpp-2 0.1.160,
// pinned with `=`); fail the build if that ever changes size.
const _: () = assert!(std::mem::size_of::<LlamaModel>() == std::mem::size_of::<*mut sys::llama_model>());

/// The raw `llama_model*` behind a llama-cpp-2 model.
pub fn model_ptr(model: &LlamaModel) -> *mut sys::llama_model {
    // SAFETY: LlamaModel is repr(transparent) over Ptr<llama_model>, itself repr(transparent)
    // over NonNull<llama_model> (checked by the size assertion above), so reading the first
    // pointer-sized field yields the model pointer. The pointer is only used while `model` lives.
    unsafe { *(model as *const LlamaModel as *const *mut sys::llama_model) }
}

/// Load a model from raw llama.cpp parameters (llama-cpp-2's `LlamaModelParams` keeps
/// `use_extra_bufts`, the weight-repacking switch, private). `None` when llama.cpp refuses
/// (its log says why).
pub fn load_model(path: &std::ffi::CStr, params: sys::llama_model_params) -> Option<LlamaModel> {
    // SAFETY: `path` is NUL-terminated and outlives the call; `params` is a plain struct whose
    // pointer fields (devices, overrides, callbacks) are the null defaults.
    let ptr = unsafe { sys::llama_model_load_from_file(path.as_ptr(), params) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: LlamaModel is repr(transparent) over a non-null `*mut llama_model` (size checked
    // above); `ptr` is non-null and owned by nobody else, and LlamaModel's Drop frees it once.
    Some(unsafe { std::mem::transmute::<*mut sys::llama_model, LlamaModel>(ptr) })
}

/// The raw vocab of a model.
pub fn vocab_ptr(model: &LlamaModel) -> *const sys::llama_vocab {
    // SAFETY: model_ptr is valid for the model's lifetime; the vocab lives inside the model.
    unsafe { sys::llama_model_get_vocab(model_ptr(model)) }
}

/// An owned `llama_context*` that keeps its model alive (field order: context dropped first).
pub struct RawContext {
    ptr: NonNull<sys::llama_context>,
    model: Arc<Model>,
}

// SAFETY: a llama_context has no thread affinity; lloyal only touches it through &mut under
// the context's Mutex, so it is never used from two threads at once.
unsafe impl Send for RawContext {}

impl RawContext {
    /// Create a context; `None` when llama.cpp refuses (its log says why).
    pub fn new(model: Arc<Model>, params: sys::llama_context_params) -> Option<Self> {
        // SAFETY: the model pointer is valid while `model` (kept in self) lives.
        let ptr = unsafe { sys::llama_init_from_model(model_ptr(model.llama()), params) };
        NonNull::new(ptr).map(|ptr| RawContext { ptr, model })
    }

    /// The pointer, for FFI calls made while `&mut self` is held.
    pub fn as_ptr(&mut self) -> *mut sys::llama_context {
        self.ptr.as_ptr()
    }

    /// The model this context runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The context's memory (KV cache) handle.
    pub fn memory(&mut self) -> sys::llama_memory_t {
        // SAFETY: valid context pointer.
        unsafe { sys::llama_get_memory(self.ptr.as_ptr()) }
    }
}

impl Drop for RawContext {
    fn drop(&mut self) {
        // SAFETY: freed exactly once; the model (self.model) is still alive here.
        unsafe { sys::llama_free(self.ptr.as_ptr()) }
    }
}

/// An owned `llama_batch` of fixed capacity with one seq id per token.
pub struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
}

// SAFETY: the batch is plain heap arrays owned by this value.
unsafe impl Send for Batch {}

impl Batch {
    /// Allocate room for `capacity` tokens.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        // SAFETY: allocates token/pos/seq/logits arrays of `capacity` entries, 1 seq id each.
        let raw = unsafe { sys::llama_batch_init(capacity as i32, 0, 1) };
        Batch { raw, capacity }
    }

    /// Tokens currently in the batch.
    pub fn len(&self) -> usize {
        self.raw.n_tokens as usize
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.raw.n_tokens == 0
    }

    /// Capacity in tokens.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Remove all tokens (keeps the allocation).
    pub fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    /// Append one token. Panics only on a caller bug (capacity exceeded), never on user input:
    /// callers size chunks by the capacity.
    pub fn push(&mut self, token: i32, pos: i32, seq_id: i32, logits: bool) {
        let i = self.len();
        assert!(i < self.capacity, "batch capacity exceeded");
        // SAFETY: i < capacity, so every array write is in bounds; seq_id[i] has room for 1 id.
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos;
            *self.raw.n_seq_id.add(i) = 1;
            *(*self.raw.seq_id.add(i)) = seq_id;
            *self.raw.logits.add(i) = i8::from(logits);
        }
        self.raw.n_tokens += 1;
    }

    /// The raw batch for `llama_decode`.
    pub fn raw(&self) -> sys::llama_batch {
        self.raw
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: allocated by llama_batch_init and freed once.
        unsafe { sys::llama_batch_free(self.raw) }
    }
}
