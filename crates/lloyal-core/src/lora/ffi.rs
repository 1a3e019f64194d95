//! The FFI wrapper over llama.cpp's LoRA adapter: load, metadata, free. Setting adapters on a
//! context is `RawContext::set_loras` (raw.rs), which owns the context pointer.

use std::ffi::{CStr, CString};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use llama_cpp_sys_2 as sys;

use crate::raw::{model_ptr, Weights};

/// Longest metadata value read back (adapter GGUFs hold short strings and numbers).
const META_BUF: usize = 4096;

/// Held by every `llama_adapter_lora_init` and `llama_adapter_lora_free`: both change the
/// model's set of its adapters (`llama_model::loras`, a `std::unordered_set` without a lock),
/// so two threads loading or freeing adapters at once corrupted the heap. Its own lock: a
/// free can run inside the loaded-adapter cache's (an `Arc` upgraded there may be the last).
static ADAPTER_SET: Mutex<()> = Mutex::new(());

/// [`ADAPTER_SET`] held (a panic elsewhere leaves nothing half-changed in it).
fn adapter_set() -> std::sync::MutexGuard<'static, ()> {
    ADAPTER_SET.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An owned `llama_adapter_lora*`, freed on drop while the model it was loaded for lives (it
/// holds the model; llama.cpp would otherwise free the adapter with the model, and a second
/// free would follow).
pub struct RawLora {
    ptr: NonNull<sys::llama_adapter_lora>,
    model: Arc<dyn Weights>,
}

// SAFETY: an adapter's tensors are written once, by the load, and only read afterwards (by the
// decodes of contexts that apply it, each under its own context lock); llama.cpp keeps no
// per-thread state in it. Freeing happens once, in Drop, when no context holds it any more;
// the model's set of adapters that load and free change is changed under ADAPTER_SET only.
unsafe impl Send for RawLora {}
// SAFETY: as above: every method here only reads.
unsafe impl Sync for RawLora {}

impl RawLora {
    /// Load the adapter at `path` for `model`; `None` when llama.cpp refuses (its log says why:
    /// not an adapter, another architecture, tensors of the wrong shape).
    pub fn load(model: Arc<dyn Weights>, path: &CStr) -> Option<RawLora> {
        // llama.cpp adds the adapter to the model's set: under ADAPTER_SET.
        let set = adapter_set();
        // SAFETY: the model pointer is valid while `model` lives (kept in the result); `path`
        // is NUL-terminated and outlives the call. llama.cpp catches its own exceptions here
        // and returns null.
        let ptr = unsafe { sys::llama_adapter_lora_init(model_ptr(model.llama()), path.as_ptr()) };
        drop(set);
        NonNull::new(ptr).map(|ptr| RawLora { ptr, model })
    }

    /// The pointer `llama_set_adapters_lora` takes (valid while `self` lives).
    pub(crate) fn as_ptr(&self) -> *mut sys::llama_adapter_lora {
        self.ptr.as_ptr()
    }

    /// The model the adapter was loaded for.
    pub fn weights(&self) -> &Arc<dyn Weights> {
        &self.model
    }

    /// The adapter file's metadata value for `key`, as text (`None` when absent).
    pub fn meta(&self, key: &str) -> Option<String> {
        let key = CString::new(key).ok()?;
        let mut buf = vec![0u8; META_BUF];
        // SAFETY: valid adapter pointer; `key` is NUL-terminated; llama.cpp writes at most
        // `buf.len()` bytes, NUL included, and returns the value's length or -1.
        let n = unsafe {
            sys::llama_adapter_meta_val_str(self.as_ptr(), key.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        };
        if n < 0 {
            return None;
        }
        let text = CStr::from_bytes_until_nul(&buf).ok()?;
        Some(text.to_string_lossy().into_owned())
    }

    /// Tokens an activated LoRA (aLoRA) waits for before it applies (0: a plain LoRA).
    pub fn alora_invocation_tokens(&self) -> u64 {
        // SAFETY: valid adapter pointer; a read-only getter.
        unsafe { sys::llama_adapter_get_alora_n_invocation_tokens(self.as_ptr()) }
    }
}

impl Drop for RawLora {
    fn drop(&mut self) {
        // llama.cpp removes the adapter from the model's set: under ADAPTER_SET.
        let _set = adapter_set();
        // SAFETY: freed exactly once; the model (self.model) is still alive here, and no
        // context applies the adapter any more (each holds an Arc to it until it is freed).
        unsafe { sys::llama_adapter_lora_free(self.ptr.as_ptr()) }
    }
}
