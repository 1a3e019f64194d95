//! lloyal's llama.cpp sampler: the operations a decode's graph gets to summarise its rows.
//!
//! llama.cpp calls a backend sampler's `backend_apply` once per output row, with a view of that
//! row. The summariser that gets row 0 of the decode's logits (every decode has one; sequences
//! without a row only build, their part of the graph is not run) summarises every row at once,
//! over the whole logits matrix `X` (`n_vocab` x `R` rows); the others add nothing, so llama.cpp
//! copies their rows back as they are. Every reduction over a row is split into parts, so the
//! GPU runs many small blocks in parallel rather than one block per 262,144-float row:
//! - span maxima: `argmax` over spans of [`SPAN`] values, their values gathered (`get_rows`);
//! - the row maximum `m`: the same over the span maxima;
//! - `log sum exp(x - m)` and `log sum exp(s (x - m))`, `s` the row's sampling scale (an input
//!   the decode's `set_input` fills from [`Scales`]), each summed in [`PARTS`] parts first.
//!
//! Output of row 0: `probs` = `[lse_0..R, scaled_0..R, span maxima of row 0, row 1, ...]`,
//! `candidates` = each span maximum's position in its span. Both go through llama.cpp's
//! per-row buffers (`n_vocab` values each), so a decode summarises at most
//! [`max_rows`] rows; above that it adds nothing and the host summarises.

use std::ffi::c_char;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use llama_cpp_sys_2 as sys;

use crate::scan::SPAN;

/// Parts each row's sums are split into before they are added up.
const PARTS: i64 = 64;

/// The sampling scale of each output row of the next decode, in batch order (set by the host
/// before the decode, read by the graph's `set_input`).
pub type Scales = Arc<Mutex<Vec<f32>>>;

/// Rows one decode's summary can hold: row 0's `probs` (2 + spans floats a row) within
/// `n_vocab` values; 0 when `n_vocab` is not a whole number of spans and parts.
pub fn max_rows(n_vocab: usize) -> usize {
    let spans = n_vocab / SPAN;
    let whole = n_vocab > 0 && n_vocab.is_multiple_of(SPAN) && n_vocab.is_multiple_of(PARTS as usize);
    if whole {
        n_vocab / (2 + spans)
    } else {
        0
    }
}

/// One summariser's state.
struct Summarise {
    scales: Scales,
    /// The scale input of the graph built last (row 0's summariser only), else null.
    input: *mut sys::ggml_tensor,
}

unsafe extern "C" fn summarise_name(_: *const sys::llama_sampler) -> *const c_char {
    c"lloyal-row-summary".as_ptr()
}

/// The host side of the sampler: nothing (lloyal draws from the row itself).
unsafe extern "C" fn summarise_apply(_: *mut sys::llama_sampler, _: *mut sys::llama_token_data_array) {}

unsafe extern "C" fn summarise_free(smpl: *mut sys::llama_sampler) {
    // SAFETY: llama.cpp calls free once, on a sampler made by `summariser` whose ctx is a
    // leaked Box<Summarise>.
    unsafe { drop(Box::from_raw((*smpl).ctx.cast::<Summarise>())) }
}

unsafe extern "C" fn summarise_init(
    _: *mut sys::llama_sampler,
    _: sys::ggml_backend_buffer_type_t,
    _: u32,
) -> bool {
    true // plain ggml operations every backend has (the scheduler places any it lacks on the CPU)
}

unsafe extern "C" fn summarise_reset(smpl: *mut sys::llama_sampler) {
    // SAFETY: ctx is this sampler's Box<Summarise>; llama.cpp calls this between graph builds.
    unsafe { (*(*smpl).ctx.cast::<Summarise>()).input = std::ptr::null_mut() }
}

/// Fill the scale input of the graph about to run with the rows' scales.
unsafe extern "C" fn summarise_set_input(smpl: *mut sys::llama_sampler) {
    // SAFETY: ctx is this sampler's Box<Summarise>; `input` (when set) is a tensor of the graph
    // llama.cpp is about to compute, allocated by now, of `ne[1]` f32 values.
    unsafe {
        let state = &*(*smpl).ctx.cast::<Summarise>();
        let Some(input) = NonNull::new(state.input) else { return };
        let rows = (*input.as_ptr()).ne[1] as usize;
        let mut values = state.scales.lock().map(|s| s.clone()).unwrap_or_default();
        values.resize(rows, 1.0);
        sys::ggml_backend_tensor_set(input.as_ptr(), values.as_ptr().cast(), 0, rows * size_of::<f32>());
    }
}

/// Add the summary of every row to the graph, from the summariser that got row 0.
unsafe extern "C" fn summarise_apply_graph(
    smpl: *mut sys::llama_sampler,
    ctx: *mut sys::ggml_context,
    _: *mut sys::ggml_cgraph,
    data: *mut sys::llama_sampler_data,
) {
    // SAFETY: llama.cpp passes the sampler made by `summariser`, a graph context and the row's
    // data, whose `logits` is a contiguous 1-D f32 view of row `view_offs / nb[1]` of the
    // decode's padded logits matrix (its last row is padding), or, in llama.cpp's probe of the
    // graph's size, a plain 1-D tensor; every call builds a node in `ctx` from tensors of it.
    unsafe {
        let state = &mut *(*smpl).ctx.cast::<Summarise>();
        let data = &mut *data;
        let row = &*data.logits;
        let n = row.ne[0];
        let (x, rows) = if row.view_src.is_null() {
            (sys::ggml_reshape_2d(ctx, data.logits, n, 1), 1)
        } else if row.view_offs == 0 {
            let all = &*row.view_src;
            let rows = all.ne[1] - 1;
            (sys::ggml_view_2d(ctx, row.view_src, n, rows, all.nb[1], 0), rows)
        } else {
            return; // row 0's summariser covers this row (its input stays: `backend_reset` clears it)
        };
        if rows < 1 || rows as usize > max_rows(n as usize) {
            return;
        }
        let scale = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, 1, rows);
        sys::ggml_set_input(scale);
        state.input = scale;
        let spans = n / SPAN as i64;
        let (maxima, positions) = group_maxima(ctx, x, SPAN as i64, spans * rows);
        let max = sys::ggml_reshape_2d(ctx, group_maxima(ctx, maxima, spans, rows).0, 1, rows);
        let shifted = sys::ggml_sub(ctx, x, max);
        let lse = log_sum_exp(ctx, shifted, n, rows);
        let scaled = log_sum_exp(ctx, sys::ggml_mul(ctx, shifted, scale), n, rows);
        let sums = sys::ggml_concat(ctx, lse, scaled, 0);
        data.probs = sys::ggml_concat(ctx, sums, sys::ggml_reshape_1d(ctx, maxima, spans * rows), 0);
        data.candidates = positions;
        // Outputs: the graph allocator must not hand their memory to a later node (`positions`
        // is also an input of the gathers).
        sys::ggml_set_output(data.probs);
        sys::ggml_set_output(positions);
    }
}

/// The maximum of each of `groups` consecutive runs of `width` values of `t` (contiguous f32):
/// (`[1, 1, groups]` values, `[groups]` positions in their runs). An `argmax` over each run,
/// whose value is then gathered (`get_rows` of a `[1, width, groups]` view, one index a group).
///
/// # Safety
/// `ctx` a graph context and `t` a contiguous f32 tensor of it of `width * groups` values.
unsafe fn group_maxima(
    ctx: *mut sys::ggml_context,
    t: *mut sys::ggml_tensor,
    width: i64,
    groups: i64,
) -> (*mut sys::ggml_tensor, *mut sys::ggml_tensor) {
    // SAFETY: shapes as documented; every reshape keeps the element count of a contiguous tensor.
    unsafe {
        let positions = sys::ggml_argmax(ctx, sys::ggml_reshape_2d(ctx, t, width, groups));
        let by_group = sys::ggml_reshape_3d(ctx, t, 1, width, groups);
        let values = sys::ggml_get_rows(ctx, by_group, sys::ggml_reshape_2d(ctx, positions, 1, groups));
        (values, positions)
    }
}

/// `log sum exp` of each row of `y` (`n` x `rows`), summed in [`PARTS`] parts first: `[rows]`.
///
/// # Safety
/// `ctx` a graph context, `y` a contiguous f32 tensor of it, `n` a multiple of [`PARTS`].
unsafe fn log_sum_exp(
    ctx: *mut sys::ggml_context,
    y: *mut sys::ggml_tensor,
    n: i64,
    rows: i64,
) -> *mut sys::ggml_tensor {
    // SAFETY: shapes as documented.
    unsafe {
        let e = sys::ggml_exp(ctx, y);
        let parts = sys::ggml_sum_rows(ctx, sys::ggml_reshape_2d(ctx, e, n / PARTS, PARTS * rows));
        let sums = sys::ggml_sum_rows(ctx, sys::ggml_reshape_2d(ctx, parts, PARTS, rows));
        sys::ggml_reshape_1d(ctx, sys::ggml_log(ctx, sums), rows)
    }
}

/// The sampler's operations (the `llama_sampler_i` table llama.cpp calls through).
static SUMMARISE: SamplerTable = SamplerTable(sys::llama_sampler_i {
    name: Some(summarise_name),
    accept: None,
    apply: Some(summarise_apply),
    reset: None,
    clone: None,
    free: Some(summarise_free),
    backend_init: Some(summarise_init),
    backend_accept: None,
    backend_apply: Some(summarise_apply_graph),
    backend_set_input: Some(summarise_set_input),
    backend_reset: Some(summarise_reset),
    copy_state: None,
});

/// The table as a `static` (it holds only function pointers, which are shareable).
struct SamplerTable(sys::llama_sampler_i);
// SAFETY: function pointers and no state; llama.cpp only reads the table.
unsafe impl Sync for SamplerTable {}

/// An owned sampler chain holding one summariser (llama.cpp takes only chains).
pub struct Chain(NonNull<sys::llama_sampler>);

// SAFETY: plain heap state used only under the context's lock (like `RawContext`).
unsafe impl Send for Chain {}

impl Chain {
    /// The chain for `llama_set_sampler`.
    pub fn ptr(&self) -> *mut sys::llama_sampler {
        self.0.as_ptr()
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        // SAFETY: made by `summariser`, freed once (which frees the summariser in it).
        unsafe { sys::llama_sampler_free(self.0.as_ptr()) }
    }
}

/// A chain with one summariser reading `scales`; `None` when llama.cpp could not allocate it.
pub fn summariser(scales: &Scales) -> Option<Chain> {
    let state =
        Box::into_raw(Box::new(Summarise { scales: Arc::clone(scales), input: std::ptr::null_mut() }));
    let table = std::ptr::from_ref(&SUMMARISE.0).cast_mut();
    // SAFETY: llama.cpp only reads the table (it is never written through the pointer); the
    // sampler owns `state` from here on (freed by `summarise_free`).
    let one = unsafe { sys::llama_sampler_init(table, state.cast()) };
    if one.is_null() {
        // SAFETY: not taken by llama.cpp; reclaimed once.
        drop(unsafe { Box::from_raw(state) });
        return None;
    }
    // SAFETY: plain constructor.
    let chain = unsafe { sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params()) };
    let Some(chain) = NonNull::new(chain) else {
        // SAFETY: `one` is ours alone and freed once.
        unsafe { sys::llama_sampler_free(one) };
        return None;
    };
    // SAFETY: the chain takes ownership of `one`.
    unsafe { sys::llama_sampler_chain_add(chain.as_ptr(), one) };
    Some(Chain(chain))
}
