//! Safe wrappers over the llama.cpp calls on models, contexts, KV memory and batches.
//!
//! llama-cpp-2's `LlamaContext`/`LlamaBatch` hide their pointers, and lloyal needs calls they
//! do not wrap (row logits without panics, per-sequence state I/O, partial-range sequence
//! copies), so the context and batch are owned here at the sys level; the model stays a
//! llama-cpp-2 value. Every `unsafe` block for these calls lives in this file, each range
//! check (sequence ids, rows, buffer sizes) inside the wrapper that needs it; callers hold no
//! raw pointers. The other FFI wrapper files are `sampler/mod.rs` (sampler chains),
//! `device_rows/` (the row summary a decode computes),
//! `grammar/gbnf.rs` (llama.cpp's grammar sampler) and `backend.rs` (the log callback); the
//! test at the bottom keeps `unsafe` out of every other file.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use llama_cpp_2::model::LlamaModel;
use llama_cpp_sys_2 as sys;

use crate::device_rows::{DeviceRows, DeviceSummary};
use crate::lora::ffi::RawLora;

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
    // pointer fields (devices, overrides) are the null defaults, and whose progress callback,
    // when set, is a function whose user data the caller keeps alive through the call.
    let ptr = unsafe { sys::llama_model_load_from_file(path.as_ptr(), params) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: LlamaModel is repr(transparent) over a non-null `*mut llama_model` (size checked
    // above); `ptr` is non-null and owned by nobody else, and LlamaModel's Drop frees it once.
    Some(unsafe { std::mem::transmute::<*mut sys::llama_model, LlamaModel>(ptr) })
}

/// llama.cpp's default model parameters.
pub fn default_model_params() -> sys::llama_model_params {
    // SAFETY: returns a plain struct by value.
    unsafe { sys::llama_model_default_params() }
}

/// llama.cpp's default context parameters.
pub fn default_context_params() -> sys::llama_context_params {
    // SAFETY: returns a plain struct by value.
    unsafe { sys::llama_context_default_params() }
}

/// Bytes of one row of `n` elements of ggml type `ty` (KV cell size arithmetic).
pub fn row_size(ty: sys::ggml_type, n: i64) -> usize {
    // SAFETY: pure size arithmetic; ggml returns 0-sized rows for no valid type rather than
    // reading memory.
    unsafe { sys::ggml_row_size(ty, n) }
}

/// Width of one output embedding vector of `model`.
pub fn model_n_embd_out(model: &LlamaModel) -> usize {
    // SAFETY: the model pointer is valid while `model` lives.
    unsafe { sys::llama_model_n_embd_out(model_ptr(model)) }.max(0) as usize
}

/// The sliding-window size of `model`'s SWA layers (0: none).
pub fn model_n_swa(model: &LlamaModel) -> i32 {
    // SAFETY: the model pointer is valid while `model` lives; a read-only getter.
    unsafe { sys::llama_model_n_swa(model_ptr(model)) }
}

/// The raw vocab of a model.
pub fn vocab_ptr(model: &LlamaModel) -> *const sys::llama_vocab {
    // SAFETY: model_ptr is valid for the model's lifetime; the vocab lives inside the model.
    unsafe { sys::llama_model_get_vocab(model_ptr(model)) }
}

/// What a context's weights are held by (lloyal's `Model`): a context keeps it alive.
pub trait Weights: Send + Sync {
    /// The llama-cpp-2 model.
    fn llama(&self) -> &LlamaModel;
    /// Tokens in its vocabulary (the width of a logits row).
    fn n_vocab(&self) -> i32;
}

/// An owned `llama_context*` that keeps its model alive (field order: context dropped first).
pub struct RawContext {
    ptr: NonNull<sys::llama_context>,
    model: Arc<dyn Weights>,
    n_seq: i32,
    n_vocab: usize,
    n_ubatch: usize,
    /// Counts the times llama.cpp may have rewritten its logits buffer: an [`OutputRow`] taken
    /// before the last count reads as empty.
    epoch: Arc<AtomicU64>,
    /// Logits rows llama.cpp's output buffer holds for certain: the most a decode has
    /// produced (the buffer only grows, and only when a decode needs more).
    out_rows: usize,
    /// The summarisers of rows summarised by the decode itself ([`crate::device_rows`]).
    /// After `ptr` in field order, so the chains outlive the context that points at them.
    device: DeviceRows,
    /// Whether decodes summarise rows (else the host does).
    device_on: bool,
    /// Whether llama.cpp's logits buffer is put on huge pages (its rows are on the host).
    huge_logits: bool,
    /// The logits buffer's base and rows (its capacity) as last put on huge pages (`(0, 0)`:
    /// not yet).
    collapsed: (usize, usize),
    /// Bytes of it on huge pages.
    huge_logit_bytes: usize,
    /// The LoRA adapters llama.cpp applies, with their scales: held until the context is
    /// freed (Drop frees the context before the fields go).
    loras: Vec<(Arc<RawLora>, f32)>,
}

// SAFETY: a llama_context has no thread affinity; lloyal only touches it through &mut under
// the context's Mutex, so it is never used from two threads at once.
unsafe impl Send for RawContext {}

impl RawContext {
    /// Create a context; `None` when llama.cpp refuses (its log says why).
    pub fn new(model: Arc<dyn Weights>, params: sys::llama_context_params) -> Option<Self> {
        // SAFETY: the model pointer is valid while `model` (kept in self) lives.
        let ptr = unsafe { sys::llama_init_from_model(model_ptr(model.llama()), params) };
        let ptr = NonNull::new(ptr)?;
        // SAFETY: valid context pointer.
        let n_seq = unsafe { sys::llama_n_seq_max(ptr.as_ptr()) } as i32;
        let n_vocab = model.n_vocab().max(0) as usize;
        // SAFETY: valid context pointer.
        let n_ubatch = unsafe { sys::llama_n_ubatch(ptr.as_ptr()) } as usize;
        let epoch = Arc::new(AtomicU64::new(0));
        Some(RawContext {
            ptr,
            model,
            n_seq,
            n_vocab,
            n_ubatch,
            epoch,
            out_rows: 0,
            device: DeviceRows::new(n_vocab),
            device_on: false,
            huge_logits: false,
            collapsed: (0, 0),
            huge_logit_bytes: 0,
            loras: Vec::new(),
        })
    }

    /// Apply `loras` (adapter, scale) to every later decode, in place of any set before.
    /// Each adapter must have been loaded for this context's model (checked: `Err` with the
    /// reason otherwise, nothing changed).
    pub fn set_loras(&mut self, loras: Vec<(Arc<RawLora>, f32)>) -> Result<(), String> {
        let ours = model_ptr(self.model.llama());
        if loras.iter().any(|(l, _)| model_ptr(l.weights().llama()) != ours) {
            return Err("a LoRA adapter was loaded for another model than this context's".into());
        }
        let mut ptrs: Vec<*mut sys::llama_adapter_lora> = loras.iter().map(|(l, _)| l.as_ptr()).collect();
        let mut scales: Vec<f32> = loras.iter().map(|(_, s)| *s).collect();
        // SAFETY: valid context pointer; `ptrs` and `scales` hold `len` entries each and live
        // through the call; every adapter belongs to this context's model (checked above) and
        // is kept alive in `self.loras` until the context is freed.
        unsafe {
            sys::llama_set_adapters_lora(
                self.ptr.as_ptr(),
                ptrs.as_mut_ptr(),
                ptrs.len(),
                scales.as_mut_ptr(),
            )
        };
        self.loras = loras;
        Ok(())
    }

    /// `(n_ctx, n_batch, n_seq_max)` as llama.cpp settled them.
    pub fn sizes(&self) -> (u32, u32, u32) {
        let p = self.ptr.as_ptr();
        // SAFETY: valid context pointer; read-only getters.
        unsafe { (sys::llama_n_ctx(p), sys::llama_n_batch(p), sys::llama_n_seq_max(p)) }
    }

    /// The context's pooling as llama.cpp resolved it.
    pub fn pooling_type(&self) -> sys::llama_pooling_type {
        // SAFETY: valid context pointer; read-only getter.
        unsafe { sys::llama_pooling_type(self.ptr.as_ptr()) }
    }

    /// A caller bug, not user input (callers validate ids with typed errors first): llama.cpp
    /// aborts the process on an out-of-range sequence id, so refuse it here.
    fn check_seq(&self, seq_id: i32) {
        assert!((0..self.n_seq).contains(&seq_id), "seq id {seq_id} outside 0..{}", self.n_seq);
    }

    fn memory(&mut self) -> sys::llama_memory_t {
        // SAFETY: valid context pointer.
        unsafe { sys::llama_get_memory(self.ptr.as_ptr()) }
    }

    /// Smallest position stored for `seq_id` (-1 when empty).
    pub fn seq_pos_min(&mut self, seq_id: i32) -> i32 {
        self.check_seq(seq_id);
        let mem = self.memory();
        // SAFETY: valid memory handle; seq id checked above.
        unsafe { sys::llama_memory_seq_pos_min(mem, seq_id) }
    }

    /// Largest position stored for `seq_id` (-1 when empty).
    pub fn seq_pos_max(&mut self, seq_id: i32) -> i32 {
        self.check_seq(seq_id);
        let mem = self.memory();
        // SAFETY: valid memory handle; seq id checked above.
        unsafe { sys::llama_memory_seq_pos_max(mem, seq_id) }
    }

    /// Add `dst` to the cells of `src` in positions `[p0, p1)` (-1: unbounded). With unified
    /// KV this shares the cells (no tensor copy), partial ranges included.
    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) {
        self.check_seq(src);
        self.check_seq(dst);
        let mem = self.memory();
        // SAFETY: valid memory; both ids checked above.
        unsafe { sys::llama_memory_seq_cp(mem, src, dst, p0, p1) }
    }

    /// Remove `seq_id` from its cells in `[p0, p1)` (-1: unbounded). llama.cpp's verdict.
    pub fn seq_rm(&mut self, seq_id: i32, p0: i32, p1: i32) -> bool {
        self.check_seq(seq_id);
        let mem = self.memory();
        // SAFETY: valid memory; id checked above.
        unsafe { sys::llama_memory_seq_rm(mem, seq_id, p0, p1) }
    }

    /// Drop every sequence but `seq_id`.
    pub fn seq_keep(&mut self, seq_id: i32) {
        self.check_seq(seq_id);
        let mem = self.memory();
        // SAFETY: valid memory; id checked above.
        unsafe { sys::llama_memory_seq_keep(mem, seq_id) }
    }

    /// Empty the KV cache (data included).
    pub fn memory_clear(&mut self) {
        let mem = self.memory();
        // SAFETY: valid memory handle.
        unsafe { sys::llama_memory_clear(mem, true) }
    }

    /// `llama_decode` on `batch`: llama.cpp's return code (0 ok, 1 no room, 2 aborted,
    /// other: error). llama.cpp validates token and sequence ids itself. Every [`OutputRow`]
    /// taken before reads as empty afterwards, unless the decode failed while
    /// [`Self::fails_cleanly`] held for it. A batch with logits rows is waited for here: on a
    /// GPU `llama_decode` returns once the work is queued, and the first read of its rows would
    /// wait anyway; waiting here puts that time in the decode's (`EngineStats.decode_seconds`),
    /// not in the host work after it. On a CPU the decode is done when it returns.
    pub fn decode(&mut self, batch: &Batch) -> i32 {
        crate::tiled::note_decode(); // from here on ggml may read its tiled-matmul switch
        let clean = self.fails_cleanly(batch);
        // SAFETY: valid context; the batch's arrays hold `n_tokens` initialised rows (Batch
        // only grows through `push`, which checks its capacity).
        let code = unsafe { sys::llama_decode(self.ptr.as_ptr(), batch.raw()) };
        if code == 0 {
            self.out_rows = self.out_rows.max(batch.outputs());
            if batch.outputs() > 0 {
                // SAFETY: valid context.
                unsafe { sys::llama_synchronize(self.ptr.as_ptr()) };
            }
            self.device.decoded(self.ptr); // after the wait: llama.cpp copies the summaries async
            if self.huge_logits && batch.outputs() > 0 {
                self.collapse_logits();
            }
        }
        if code == 0 || !clean {
            self.epoch.fetch_add(1, Ordering::Release);
        }
        code
    }

    /// Put llama.cpp's logits buffer on huge pages now (llama.cpp made it with the context)
    /// and after each decode that moved it ([`crate::hugepages::collapse_buffer`]): for a
    /// context whose logits are on the host.
    pub fn use_huge_logits(&mut self) {
        self.huge_logits = true;
        self.collapse_logits();
    }

    /// Bytes of llama.cpp's logits buffer on huge pages.
    pub fn huge_logit_bytes(&self) -> usize {
        self.huge_logit_bytes
    }

    /// The first `n_seq_max` rows of the logits buffer on huge pages, once for each place and
    /// size it takes: llama.cpp allocates it with the context (`n_seq_max` rows) and again,
    /// larger (perhaps at the same address), for a decode with more output rows than it holds,
    /// and clears it, so its 4 KiB pages exist and are collapsed here. Those rows are the ones
    /// a decode of commits and prompt tails writes, every tick; the rows beyond them (a scored
    /// prompt's, read once) are left on 4 KiB pages: collapsing costs ~0.3-3 ms a MiB on a VM
    /// (64 rows took 169 ms). Done with the context, not in its first decode, so that decode's
    /// time (and the burst wait learned from it, [`crate::engine::burst`]) is the model's.
    fn collapse_logits(&mut self) {
        // SAFETY: valid context; returns llama.cpp's logits buffer (null when it has none).
        let base = unsafe { sys::llama_get_logits(self.ptr.as_ptr()) } as usize;
        // llama.cpp sizes it for max(n_seq_max, the most outputs a decode asked for).
        let rows = self.n_seq.max(1) as usize;
        let capacity = self.out_rows.max(rows);
        if base == 0 || (base, capacity) == self.collapsed {
            return;
        }
        self.collapsed = (base, capacity);
        self.huge_logit_bytes = crate::hugepages::collapse_buffer(base, rows * self.n_vocab * 4);
    }

    /// Whether a failed `decode` of `batch` leaves the logits rows of the decode before it
    /// where they were. llama.cpp writes a batch's logits after computing each of its
    /// micro-batches, and moves its output buffer only to grow it (`output_reserve`, before
    /// the first micro-batch); so a batch that is one micro-batch (at most `n_ubatch` rows,
    /// one per sequence: both of llama.cpp's splits keep it whole) and needs no more rows
    /// than the buffer holds fails without writing there (llama.cpp as llama-cpp-sys-2 0.1.160 vendors it,
    /// `llama_context::decode`).
    pub fn fails_cleanly(&self, batch: &Batch) -> bool {
        let mut seqs = batch.seqs();
        seqs.sort_unstable();
        let one_per_sequence = seqs.windows(2).all(|w| w[0] != w[1]);
        seqs.len() <= self.n_ubatch && one_per_sequence && batch.outputs() <= self.out_rows
    }

    /// Have decodes summarise the rows of summarised sequences ([`crate::device_rows`]).
    pub fn use_device_rows(&mut self) {
        self.device_on = true;
    }

    /// Whether decodes summarise rows (a summariser llama.cpp refused turns that off).
    pub fn device_rows(&self) -> bool {
        self.device_on
    }

    /// Before a decode: its output rows (`(batch index, sequence, sampling scale)`, in order)
    /// are summarised by it. Whether llama.cpp's samplers changed (its output buffer may then
    /// move at that decode). When llama.cpp refuses a summariser, rows are summarised on the
    /// host from then on.
    pub fn want_device_rows(&mut self, outputs: &[(i32, i32, f32)]) -> bool {
        if !self.device_on {
            return false;
        }
        match self.device.want(self.ptr, outputs) {
            Some(changed) => changed,
            None => {
                self.device_on = false; // the chains it had set are freed after the next decode
                true
            }
        }
    }

    /// The device's summary of batch row `row` of the last decode.
    pub fn device_summary(&self, row: i32) -> Option<DeviceSummary> {
        self.device.summary(row)
    }

    /// Where llama.cpp keeps batch row `row`'s logits from the last decode: the copy its
    /// backend sampling made for a summarised sequence (the plain row is then not copied),
    /// else the plain row; null when that row asked for none.
    fn row_ptr(&mut self, row: i32) -> *mut f32 {
        let summarised = self.device.row_ptr(self.ptr, row, self.n_vocab);
        if !summarised.is_null() {
            return summarised;
        }
        // SAFETY: valid context; llama.cpp returns null (not abort) for a row without logits.
        unsafe { sys::llama_get_logits_ith(self.ptr.as_ptr(), row) }
    }

    /// The logits of batch rows `rows` of the last decode, in order, read where llama.cpp
    /// keeps them (no copy); `None` when one of them asked for none.
    pub fn output_rows(&mut self, rows: &[i32]) -> Option<Vec<OutputRow>> {
        let epoch = self.epoch.load(Ordering::Acquire);
        let mut out = Vec::with_capacity(rows.len());
        for &row in rows {
            let ptr = NonNull::new(self.row_ptr(row))?;
            out.push(OutputRow { ptr, len: self.n_vocab, epoch, current: Arc::clone(&self.epoch) });
        }
        Some(out)
    }

    /// The logits of batch row `row` of the last decode; `None` when that row asked for none.
    pub fn logits_row(&mut self, row: i32) -> Option<&[f32]> {
        let ptr = self.row_ptr(row);
        // SAFETY: llama.cpp guarantees n_vocab floats at a non-null logits row, valid until
        // the next decode (which needs `&mut self`, so the borrow ends first).
        (!ptr.is_null()).then(|| unsafe { std::slice::from_raw_parts(ptr, self.n_vocab) })
    }

    /// The pooled embedding of `seq_id` from the last decode (`dim` floats); `None` when the
    /// sequence was not in it.
    pub fn embeddings_seq(&mut self, seq_id: i32, dim: usize) -> Option<&[f32]> {
        self.check_seq(seq_id);
        assert!(dim <= model_n_embd_out(self.model.llama()), "embedding width {dim} too large");
        // SAFETY: valid context; llama.cpp returns null for a sequence absent from the last decode.
        let ptr = unsafe { sys::llama_get_embeddings_seq(self.ptr.as_ptr(), seq_id) };
        // SAFETY: with pooling llama.cpp stores n_embd_out >= dim floats per sequence.
        (!ptr.is_null()).then(|| unsafe { std::slice::from_raw_parts(ptr, dim) })
    }

    /// The embedding of batch row `row` of the last decode (`dim` floats); `None` for a row
    /// without one.
    pub fn embeddings_row(&mut self, row: i32, dim: usize) -> Option<&[f32]> {
        assert!(dim <= model_n_embd_out(self.model.llama()), "embedding width {dim} too large");
        // SAFETY: valid context; llama.cpp returns null (not abort, release build) for a bad row.
        let ptr = unsafe { sys::llama_get_embeddings_ith(self.ptr.as_ptr(), row) };
        // SAFETY: a non-null row holds n_embd_out >= dim floats.
        (!ptr.is_null()).then(|| unsafe { std::slice::from_raw_parts(ptr, dim) })
    }

    /// llama.cpp's serialised state of `seq_id` (its KV cells); `Err((written, size))` when
    /// llama.cpp wrote fewer bytes than it asked for.
    pub fn state_seq_get(&mut self, seq_id: i32) -> std::result::Result<Vec<u8>, (usize, usize)> {
        self.check_seq(seq_id);
        self.state_get(seq_id)
    }

    /// Load a serialised sequence state into `seq_id`; bytes read (0: refused).
    pub fn state_seq_set(&mut self, seq_id: i32, payload: &[u8]) -> usize {
        self.check_seq(seq_id);
        self.state_set(seq_id, payload)
    }

    /// llama.cpp's serialised state of the whole KV cache: every cell in cell order, with its
    /// position and all its sequences; `Err((written, size))` as for [`Self::state_seq_get`].
    pub fn memory_state_get(&mut self) -> std::result::Result<Vec<u8>, (usize, usize)> {
        self.state_get(-1)
    }

    /// Replace the whole KV cache with a state from [`Self::memory_state_get`]: llama.cpp
    /// empties the cache and writes the cells back from cell 0, in their order. Bytes read
    /// (0: refused; the cache is then empty).
    pub fn memory_state_set(&mut self, payload: &[u8]) -> usize {
        self.state_set(-1, payload)
    }

    /// `seq_id` checked by the caller (-1: the whole cache).
    fn state_get(&mut self, seq_id: i32) -> std::result::Result<Vec<u8>, (usize, usize)> {
        let ctx = self.ptr.as_ptr();
        // SAFETY: valid context; `seq_id` is a sequence of the context or -1 (every sequence).
        let size = unsafe { sys::llama_state_seq_get_size(ctx, seq_id) };
        let mut payload = vec![0u8; size];
        // SAFETY: `payload` has exactly `size` writable bytes, the size llama.cpp asked for.
        let written = unsafe { sys::llama_state_seq_get_data(ctx, payload.as_mut_ptr(), size, seq_id) };
        if written == size {
            Ok(payload)
        } else {
            Err((written, size))
        }
    }

    /// `seq_id` checked by the caller (-1: the whole cache).
    fn state_set(&mut self, seq_id: i32, payload: &[u8]) -> usize {
        // SAFETY: valid context; `payload` is readable for its length; `seq_id` is a sequence
        // of the context or -1 (every sequence).
        unsafe { sys::llama_state_seq_set_data(self.ptr.as_ptr(), payload.as_ptr(), payload.len(), seq_id) }
    }
}

impl Drop for RawContext {
    fn drop(&mut self) {
        self.epoch.fetch_add(1, Ordering::Release);
        // SAFETY: freed exactly once; the model (self.model) is still alive here.
        unsafe { sys::llama_free(self.ptr.as_ptr()) }
    }
}

/// One logits row inside llama.cpp's output buffer, read without copying it out. It reads as
/// empty once llama.cpp may have rewritten that buffer (a later decode, the context freed):
/// callers copy a row out before then if they still need it.
pub struct OutputRow {
    ptr: NonNull<f32>,
    len: usize,
    /// The context's decode count when the row was taken, and the count now.
    epoch: u64,
    current: Arc<AtomicU64>,
}

// SAFETY: the row is only read, through `get`, which checks that llama.cpp has not rewritten
// it; llama.cpp writes the buffer only inside a decode, which needs `&mut RawContext` under
// the context's lock, where every `OutputRow` lives.
unsafe impl Send for OutputRow {}
// SAFETY: as for Send: shared reads of a buffer nothing writes while the row is current.
unsafe impl Sync for OutputRow {}

impl OutputRow {
    /// The row's values; empty once llama.cpp may have rewritten them.
    pub fn get(&self) -> &[f32] {
        if self.current.load(Ordering::Acquire) != self.epoch {
            return &[];
        }
        // SAFETY: llama.cpp keeps `len` (n_vocab) floats at a non-null logits row until its
        // next decode or free, both of which advance `current` first (decode) or before the
        // buffer goes (free); the epoch check above rules both out.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

#[cfg(test)]
impl OutputRow {
    /// A row over `values` (leaked), current until `epoch` moves (tests without llama.cpp).
    pub fn over(values: Vec<f32>, epoch: &Arc<AtomicU64>) -> OutputRow {
        let len = values.len();
        let ptr = NonNull::from(Box::leak(values.into_boxed_slice())).cast::<f32>();
        OutputRow { ptr, len, epoch: epoch.load(Ordering::Acquire), current: Arc::clone(epoch) }
    }
}

impl std::fmt::Debug for OutputRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OutputRow({} floats, epoch {})", self.len, self.epoch)
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

    /// The sequence id of each row.
    pub fn seqs(&self) -> Vec<i32> {
        // SAFETY: rows below `len` were written by `push`, each with one seq id.
        (0..self.len()).map(|i| unsafe { *(*self.raw.seq_id.add(i)) }).collect()
    }

    /// `(row, sequence)` of each row that keeps its outputs, in row order.
    pub fn output_seqs(&self) -> Vec<(i32, i32)> {
        let seqs = self.seqs();
        // SAFETY: rows below `len` were written by `push`.
        let kept = |i: usize| unsafe { *self.raw.logits.add(i) } != 0;
        seqs.into_iter().enumerate().filter(|&(i, _)| kept(i)).map(|(i, s)| (i as i32, s)).collect()
    }

    /// Rows that keep their outputs.
    pub fn outputs(&self) -> usize {
        // SAFETY: rows below `len` were written by `push`.
        (0..self.len()).filter(|&i| unsafe { *self.raw.logits.add(i) } != 0).count()
    }

    /// The raw batch for `llama_decode`.
    fn raw(&self) -> sys::llama_batch {
        self.raw
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: allocated by llama_batch_init and freed once.
        unsafe { sys::llama_batch_free(self.raw) }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The files allowed to hold `unsafe`: the FFI wrappers.
    // FFI wrappers (omp.rs: libgomp's GOMP_parallel), and scan/x86.rs: the SIMD kernels' loads
    // and stores (intrinsics take raw pointers).
    const FFI_WRAPPERS: [&str; 11] = [
        "raw.rs",
        "lora/ffi.rs",
        "cxx_alloc.rs",
        "hugepages.rs",
        "sampler/mod.rs",
        "grammar/gbnf.rs",
        "backend.rs",
        "omp.rs",
        "scan/x86.rs",
        "device_rows/mod.rs",
        "device_rows/graph.rs",
    ];

    fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn unsafe_lives_only_in_the_ffi_wrappers() {
        // The core's sources, and the PyO3 glue's (`src/` at the repository root). The
        // directory cargo runs the test from, not the one it was compiled in: a test binary
        // cached in a shared CARGO_TARGET_DIR may come from another checkout of the crate.
        let manifest =
            std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned());
        let core = Path::new(&manifest).join("src");
        let glue = Path::new(&manifest).join("../../src");
        let mut files = Vec::new();
        rust_files(&core, &mut files);
        let n_core = files.len();
        rust_files(&glue, &mut files);
        assert!(files.len() > n_core, "the glue sources were not found at {}", glue.display());
        let mut offenders = Vec::new();
        for (i, path) in files.iter().enumerate() {
            let root = if i < n_core { &core } else { &glue };
            let rel = path.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
            if i < n_core && FFI_WRAPPERS.contains(&rel.as_str()) {
                continue;
            }
            let text = std::fs::read_to_string(path).unwrap();
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                if code.contains("unsafe ") || code.contains("unsafe{") {
                    offenders.push(format!("{rel}:{}", n + 1));
                }
            }
        }
        assert!(offenders.is_empty(), "unsafe outside the FFI wrappers: {offenders:?}");
    }
}
