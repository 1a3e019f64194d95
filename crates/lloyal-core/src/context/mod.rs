//! A llama.cpp context behind one lock (released fairly): [`Context`], the handle shared by
//! Python objects and the engine, and [`state::ContextState`], what the lock guards. The
//! flat decode path and raw KV ops are in `flat.rs`, logits rows in `rows.rs`; branch
//! accounting lives in `ledger.rs`, llama.cpp calls in `raw.rs`.

pub(crate) mod batches;
mod flat;
mod rows;
pub mod state;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use crate::backend::{clear_recent_errors, recent_errors};
use crate::engine::apply::{CallDone, Queued};
use crate::engine::gen::GenSpec;
use crate::engine::{Done, Engine, EngineStats, Host, Ticket, Work};
use crate::error::{LloyalError, Result};
use crate::ledger::{KvPressure, Ledger};
use crate::model::Model;
use crate::options::ContextOptions;
use crate::raw::{Batch, RawContext};
use crate::tenancy::Slots;
use crate::topology::Topology;
use llama_cpp_sys_2 as sys;
use state::{ContextState, InterruptCheck};

/// Sizes fixed at creation (readable without the lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextShape {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_seq_max: u32,
    pub n_vocab: i32,
    pub n_threads: i32,
    pub embeddings: bool,
}

/// A context handle shared by its Python objects. Decode-bearing work goes to its engine
/// ([`Context::submit`]), every other call through [`Context::apply`]; `close()` waits for
/// the running call.
pub struct Context {
    model: Arc<Model>,
    shape: ContextShape,
    options: ContextOptions,
    state: Mutex<Option<ContextState>>,
    closed: AtomicBool,
    engine: Engine,
    /// Free leases and KV occupancy as of the last call that released the context lock
    /// ([`Context::occupancy`]): held only to copy it, so readers never wait for a tick (a
    /// scheduler deciding whether a request fits waited up to a prefill chunk's ~0.8 s).
    occupancy: Mutex<(u32, KvPressure)>,
    /// The prefix cache's bookkeeping (also in the state, which prunes): lookups take only
    /// its lock, never the context's.
    cache: crate::cache::SharedIndex,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("shape", &self.shape).finish()
    }
}

impl Context {
    /// Create a context for `model` (validated options; llama.cpp failures explained).
    pub fn new(model: Arc<Model>, options: ContextOptions) -> Result<Arc<Context>> {
        crate::lora::check(&options.lora, &model)?;
        if options.pooling.is_some() && !options.embeddings {
            return Err(LloyalError::invalid(
                "pooling applies to embeddings contexts: pass embeddings=True with it, or leave pooling out",
            ));
        }
        let options =
            options.with_model_pooling(model.pooling()).resolve(&model.options(), model.float_weights())?;
        let device_rows = crate::device_rows::wanted(options.is_batch_invariant(), options.embeddings)?;
        let mut params = options.to_llama()?;
        if device_rows {
            // Summarised rows: as many per sequence as a batch has (verify, all-logits prefill),
            // where llama.cpp's default for backend sampling is one.
            params.n_outputs_max_per_seq = 0;
        }
        clear_recent_errors();
        let mut raw = RawContext::new(model.clone(), params).ok_or_else(|| creation_failed(&params))?;
        if device_rows {
            raw.use_device_rows();
        }
        let loras = options.lora.iter().map(|l| (Arc::clone(l.adapter.raw()), l.scale)).collect();
        raw.set_loras(loras).map_err(LloyalError::invalid)?;
        // Layers on a GPU: asked for and a GPU backend loaded (a CPU build runs n_gpu_layers > 0
        // on the CPU, as llama.cpp does, and is treated as the CPU context it is).
        let offloaded = model.options().n_gpu_layers != 0 && crate::backend::backend().supports_gpu_offload();
        if !offloaded {
            raw.use_huge_logits(); // a GPU build's output buffer is pinned host memory: left alone
        }
        let (n_ctx, n_batch, n_seq_all) = raw.sizes();
        let parks = options.parks_freed_cells();
        // The hidden parking sequence is the last id; users and leases see the ones before it.
        let n_seq_max = n_seq_all - u32::from(parks);
        let shape = ContextShape {
            n_ctx,
            n_batch,
            n_seq_max,
            n_vocab: model.n_vocab(),
            n_threads: params.n_threads,
            embeddings: options.embeddings,
        };
        let state = ContextState {
            model: model.clone(),
            batch: Batch::new(n_batch as usize),
            raw,
            shape,
            logits: Vec::new(),
            sampler: None,
            branches: Slots::default(),
            topology: Topology::default(),
            ledger: Ledger::new(n_seq_max),
            park_seq: parks.then_some(n_seq_max as i32),
            parked: 0,
            flat_cells: 0,
            count_flat: true,
            kv_cell_bytes: model.kv_bytes_per_cell(params.type_k, params.type_v),
            batch_invariant: options.is_batch_invariant(),
            split_mixed_ticks: !options.is_batch_invariant() && options.flash_attn && !offloaded,
            encoded: HashMap::new(),
            interrupt: None,
            batches_in_call: 0,
            cache: Default::default(),
            in_engine: Vec::new(),
            compacts: crate::state::compact::enabled(options.is_batch_invariant()),
            sampling_perplexity: options.sampling_perplexity,
        };
        let cache = Arc::clone(&state.cache);
        let occupancy = Mutex::new((state.available(), state.kv_pressure()));
        let engine = Engine::default();
        engine.set_spin(crate::engine::spin::configured(shape.n_threads, offloaded));
        Ok(Arc::new(Context {
            model,
            shape,
            options,
            state: Mutex::new(Some(state)),
            closed: AtomicBool::new(false),
            engine,
            occupancy,
            cache,
        }))
    }

    /// The prefix cache's bookkeeping (lookups, pins, entries; pruning is the state's).
    pub fn prefix_index(&self) -> &crate::cache::SharedIndex {
        &self.cache
    }

    /// Sweep the prefix cache's released branches and trim it to its budget without waiting:
    /// at once when no tick runs, else by the engine after the tick (which tidies at its end
    /// too). A closed context has nothing to tidy.
    pub fn tidy_cache(&self) {
        let tidy = |s: &mut ContextState| {
            s.cache_tidy();
            Ok(())
        };
        let _ = self.apply_then(tidy, Box::new(|_: Result<()>| {}));
    }

    /// Fault injection for tests: with `false`, room checks stop counting the cells of
    /// sequences no branch holds ([`ContextState::note_flat_cells`]), so a decode can reach
    /// llama.cpp's own refusal of a full cache (the engine's isolation and rollback of a
    /// rejected batch). Applied before the next tick.
    pub fn count_flat_cells(&self, on: bool) {
        let set = move |s: &mut ContextState| {
            s.count_flat = on;
            Ok(())
        };
        let _ = self.apply_then(set, Box::new(|_: Result<()>| {}));
    }

    /// The model this context runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Sizes fixed at creation.
    pub fn shape(&self) -> ContextShape {
        self.shape
    }

    /// The options the context was created with (`batch_invariant` and `type_k` settled).
    pub fn options(&self) -> &ContextOptions {
        &self.options
    }

    fn guard(&self) -> MutexGuard<'_, Option<ContextState>> {
        // parking_lot's lock is not poisoned by a panic: a panic while holding it cannot leave
        // llama.cpp half-updated in a way the next call could observe more than any failed
        // call could, so keep going.
        self.state.lock()
    }

    /// Run `f` on the open context state: every call that is not decode-bearing engine
    /// work (create, fork, prune, sampler changes, the flat path's sampling, reads) comes
    /// here; one that decodes goes through [`Context::apply_decoding`]. It runs at once on
    /// the caller's thread when no engine tick is running, else the engine thread runs it
    /// before its next tick ([`crate::engine::apply`]). A decode inside `f` run on the
    /// caller's thread fails (`LloyalError::Backend`, nothing written): only the engine's
    /// thread decodes.
    ///
    /// `interrupt` (the Python glue's Ctrl-C check, on the main thread) is asked between the
    /// n_batch-sized decodes of a long call (a prefill of many tokens), or every 50 ms while
    /// the call waits for the engine: when it returns `true` the call stops, rolls back
    /// everything it wrote and returns [`LloyalError::Interrupted`].
    pub fn apply<T, F>(&self, interrupt: Option<InterruptCheck>, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut ContextState) -> Result<T> + Send + 'static,
    {
        self.check_open()?;
        match self.engine.turn() {
            Some(_turn) => self.locked(interrupt, f),
            None => self.engine.call(interrupt, f),
        }
    }

    /// [`Context::apply`] for a call that decodes (the flat path's `decode`, embeddings, a
    /// reseed): it runs on the engine thread (started for it), in the same order as any
    /// other call. Each thread that decodes keeps an OpenMP pool of the context's threads for
    /// as long as it lives, and libgomp slows every pool in the process while they hold more
    /// threads than there are CPUs ([`crate::omp`]); the engine hands its pool back when idle,
    /// a caller's thread could not.
    pub fn apply_decoding<T, F>(self: &Arc<Self>, interrupt: Option<InterruptCheck>, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut ContextState) -> Result<T> + Send + 'static,
    {
        self.check_open()?;
        if self.engine.is_engine_thread() {
            return self.apply(interrupt, f); // a finalizer run by the engine thread itself
        }
        self.engine.start(self)?;
        self.engine.call(interrupt, f)
    }

    /// [`Context::apply`] for a caller that must not block (an asyncio event loop): `done`
    /// gets the result, called before this returns when `f` ran at once (`None`), else on the
    /// engine thread (`Some`: cancel it there).
    pub fn apply_then<T, F>(&self, f: F, done: CallDone<T>) -> Result<Option<Queued>>
    where
        T: Send + 'static,
        F: FnOnce(&mut ContextState) -> Result<T> + Send + 'static,
    {
        self.check_open()?;
        match self.engine.turn() {
            Some(turn) => {
                let r = self.locked(None, f);
                drop(turn);
                done(r);
                Ok(None)
            }
            None => self.engine.queue(f, done).map(Some),
        }
    }

    /// `f` under the lock with `interrupt` installed, then the ledger check, the published
    /// occupancy and, when the cells in use have grown sparse, a word to the engine. The lock
    /// is released fairly (handed to a waiting thread).
    fn locked<T>(
        &self,
        interrupt: Option<InterruptCheck>,
        f: impl FnOnce(&mut ContextState) -> Result<T>,
    ) -> Result<T> {
        let mut guard = self.guard();
        let state = guard.as_mut().ok_or(LloyalError::ContextClosed)?;
        state.batches_in_call = 0;
        state.interrupt = interrupt;
        let result = f(state);
        state.interrupt = None;
        check_ledger(state);
        *self.occupancy.lock() = (state.available(), state.kv_pressure());
        let compact = state.wants_compaction();
        MutexGuard::unlock_fair(guard);
        if compact {
            // Cells left high by a busy stretch: the engine compacts once it has nothing
            // else to do (`state::compact`).
            self.engine.check_compaction();
        }
        result
    }

    /// Queue decode-bearing `work` on this context's engine (started on first use); `done`
    /// receives the result on the engine thread. Returns a ticket to cancel it, or
    /// `ContextClosed` (then `done` is never called).
    pub fn submit(self: &Arc<Self>, work: Work, done: Done) -> Result<Ticket> {
        self.check_open()?;
        self.engine.submit(self, work, done)
    }

    /// Queue a generation request ([`crate::engine::gen`]); its tokens, end or error arrive
    /// on `spec.stream`. Returns a ticket that cancels it (freed at the next tick).
    pub fn generate(self: &Arc<Self>, spec: GenSpec) -> Result<Ticket> {
        spec.validate(self.model())?;
        let stream = Arc::clone(&spec.stream);
        let done: Done = Box::new(move |r| {
            if let Err(e) = r {
                stream.fail(e);
            }
        });
        self.submit(Work::Generate(Box::new(spec)), done)
    }

    /// How long a caller waiting for this context's engine spins before it sleeps
    /// ([`crate::engine::spin`]; zero without a spare core).
    pub fn engine_spin(&self) -> std::time::Duration {
        self.engine.spin()
    }

    /// Wake the engine: a generation stream asked for its next token.
    pub fn notify_engine(&self) {
        self.engine.notify();
    }

    /// The engine's counters.
    pub fn engine_stats(&self) -> EngineStats {
        self.engine.stats()
    }

    /// Hold the engine's ticks (queued operations wait) until [`Context::resume_engine`].
    pub fn pause_engine(&self) {
        self.engine.pause();
    }

    /// Let the engine tick again.
    pub fn resume_engine(&self) {
        self.engine.resume();
    }

    /// Cap the prefill tokens of one engine tick (`Some(0)`: fill the tick's batch; `None`:
    /// paced next to running streams, the default; see [`crate::engine::pace`]).
    pub fn set_engine_prefill_chunk(&self, tokens: Option<usize>) {
        self.engine.set_prefill_chunk(tokens);
    }

    /// The engine's prefill cap per tick (`Some(0)`: none; `None`: paced).
    pub fn engine_prefill_chunk(&self) -> Option<usize> {
        self.engine.prefill_chunk()
    }

    /// Set the engine's gather window in seconds (0 to 1).
    pub fn set_engine_gather(&self, seconds: f64) -> Result<()> {
        self.engine.set_gather(seconds)
    }

    /// Free the llama.cpp context (waits for a running call, and for the engine to finish
    /// the operations already submitted to it). Idempotent.
    pub fn close(&self) {
        self.engine.close();
        let mut guard = self.guard();
        self.closed.store(true, Ordering::Release);
        let state = guard.take();
        drop(guard);
        drop(state);
        // its branches are gone: the prefix cache holds nothing
        crate::cache::lock(&self.cache).take_all();
    }

    /// Free leases and the branches' KV occupancy as of the last call that finished, without
    /// the context lock (so without waiting for the engine's tick in progress).
    pub fn occupancy(&self) -> Result<(u32, KvPressure)> {
        self.check_open()?;
        Ok(*self.occupancy.lock())
    }

    /// Whether `close()` ran (lock-free).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// `ContextClosed` once `close()` ran (lock-free).
    pub fn check_open(&self) -> Result<()> {
        if self.is_closed() {
            Err(LloyalError::ContextClosed)
        } else {
            Ok(())
        }
    }
}

/// The ledger check after a context call (see [`crate::ledger`]): a mismatch is a bug in
/// lloyal, reported loudly rather than left to corrupt later calls.
fn check_ledger(state: &mut ContextState) {
    if crate::ledger::checking() {
        if let Err(e) = state.ledger.check(&state.branches, &mut state.raw) {
            panic!("KV ledger out of step with llama.cpp after a context call: {e}");
        }
    }
}

impl Host for Context {
    /// The lock for the engine's ticks and queued calls.
    fn locked<T>(
        &self,
        interrupt: Option<InterruptCheck>,
        f: impl FnOnce(&mut ContextState) -> Result<T>,
    ) -> Result<T> {
        Context::locked(self, interrupt, f)
    }
}

/// Why llama.cpp could not create a context with `params`, from what it logged: a buffer it
/// could not allocate ([`LloyalError::OutOfMemory`]), or another failure.
fn creation_failed(params: &sys::llama_context_params) -> LloyalError {
    let logged = recent_errors();
    let shape = format!("n_ctx={}, n_batch={}, n_seq_max={}", params.n_ctx, params.n_batch, params.n_seq_max);
    if is_allocation_failure(&logged) {
        LloyalError::OutOfMemory(format!(
            "llama.cpp could not allocate the buffers of a context with {shape} ({logged}); the KV \
             cache grows with n_ctx: try a smaller n_ctx, a smaller n_batch, or a quantized cache \
             (type_k='q8_0', type_v='q8_0' with flash_attn=True)"
        ))
    } else {
        LloyalError::Backend(format!(
            "llama.cpp could not create the context with {shape} ({logged}); try a smaller n_ctx or \
             other cache types"
        ))
    }
}

/// Whether llama.cpp's log says an allocation failed (host `std::bad_alloc`, or a backend
/// buffer it could not allocate).
fn is_allocation_failure(logged: &str) -> bool {
    ["bad_alloc", "failed to allocate", "unable to allocate", "out of memory"]
        .iter()
        .any(|m| logged.contains(m))
}

#[cfg(test)]
mod creation_tests {
    use super::is_allocation_failure;

    #[test]
    fn allocation_failures_are_told_from_other_failures() {
        assert!(is_allocation_failure(
            "llama_init_from_model: failed to initialize the context: std::bad_alloc"
        ));
        assert!(is_allocation_failure(
            "ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 9"
        ));
        assert!(is_allocation_failure("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9 MiB on device 0: cudaMalloc failed: out of memory"));
        assert!(!is_allocation_failure("llama_init_from_model: n_batch is less than GGML_KQ_MASK_PAD"));
    }
}
