//! A llama.cpp context behind one lock (released fairly): the flat decode path, sampling,
//! logits and raw KV ops; branch accounting lives in `ledger.rs`, llama.cpp calls in `raw.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use crate::backend::{clear_recent_errors, recent_errors};
use crate::branch::BranchState;
use crate::embeddings::Encoded;
use crate::engine::gen::GenSpec;
use crate::engine::{Done, Engine, EngineStats, Ticket, Work};
use crate::error::{LloyalError, Result};
use crate::grammar::Grammar;
use crate::ledger::Ledger;
use crate::metrics::{entropy, surprisal, Base};
use crate::model::Model;
use crate::options::ContextOptions;
use crate::raw::{Batch, RawContext};
use crate::sampler::Sampler;
use crate::sampling::SamplingParams;
use crate::store::KvPressure;
use crate::tenancy::{Handle, Slots};
use crate::topology::Topology;

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

/// A context handle shared by its Python objects. All work goes through [`Context::with`],
/// which serialises callers on one mutex; `close()` waits for the running call.
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
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("shape", &self.shape).finish()
    }
}

impl Context {
    /// Create a context for `model` (validated options; llama.cpp failures explained).
    pub fn new(model: Arc<Model>, options: ContextOptions) -> Result<Arc<Context>> {
        let options =
            options.with_model_pooling(model.pooling()).resolve(&model.options(), model.float_weights())?;
        let params = options.to_llama()?;
        clear_recent_errors();
        let raw = RawContext::new(model.clone(), params).ok_or_else(|| {
            LloyalError::Backend(format!(
                "llama.cpp could not create the context ({}); try a smaller n_ctx or other cache types",
                recent_errors()
            ))
        })?;
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
            kv_cell_bytes: model.kv_bytes_per_cell(params.type_k, params.type_v),
            batch_invariant: options.is_batch_invariant(),
            split_mixed_ticks: !options.is_batch_invariant()
                && options.flash_attn
                && model.options().n_gpu_layers == 0,
            encoded: HashMap::new(),
            interrupt: None,
            batches_in_call: 0,
        };
        let occupancy = Mutex::new((state.available(), state.kv_pressure()));
        Ok(Arc::new(Context {
            model,
            shape,
            options,
            state: Mutex::new(Some(state)),
            closed: AtomicBool::new(false),
            engine: Engine::default(),
            occupancy,
        }))
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

    /// Run `f` on the open context state, holding the context lock.
    ///
    /// The lock is released unfairly: a caller making several calls in a row (the server's
    /// fork, then sampler, bias and grammar of a new request) usually takes it again before
    /// the engine wakes, so the sequence waits for one engine tick, not one tick per call
    /// (before: up to 2.4 s with prefill ticks of ~0.8 s, the event loop blocked all along).
    /// parking_lot still hands the lock to a waiter after at most ~0.5 ms of that.
    pub fn with<T>(&self, f: impl FnOnce(&mut ContextState) -> Result<T>) -> Result<T> {
        self.locked(None, false, f)
    }

    /// [`Context::with`] for the engine's ticks: the lock is released fairly, so a thread
    /// waiting for it (a reader of `kv_seq_pos_max` while the engine runs a long chunked
    /// prefill) gets it before the engine's next tick, and a busy engine never starves
    /// other callers.
    pub(crate) fn with_fair<T>(&self, f: impl FnOnce(&mut ContextState) -> Result<T>) -> Result<T> {
        self.locked(None, true, f)
    }

    /// Like [`Context::with`], but `check` runs between the n_batch-sized decodes of a long
    /// call (prefill of many tokens, a commit of more than n_batch branches); when it returns
    /// `true` the call stops there, rolls back everything it wrote and returns
    /// [`LloyalError::Interrupted`]. The Python glue uses it to honour Ctrl-C. The lock is
    /// released fairly.
    pub fn with_interrupt<T>(
        &self,
        check: InterruptCheck,
        f: impl FnOnce(&mut ContextState) -> Result<T>,
    ) -> Result<T> {
        self.locked(Some(check), true, f)
    }

    /// The body of the `with*` calls: `f` under the lock with `interrupt` installed, then the
    /// ledger check and the published occupancy, then the lock released (`fair`: handed to a
    /// waiting thread).
    fn locked<T>(
        &self,
        interrupt: Option<InterruptCheck>,
        fair: bool,
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
        if fair {
            MutexGuard::unlock_fair(guard);
        } else {
            drop(guard);
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

/// The mutable state behind the lock: the llama.cpp context and the flat path's snapshot.
pub struct ContextState {
    pub(crate) raw: RawContext,
    batch: Batch,
    shape: ContextShape,
    /// Logits of the last flat-path decode (empty before any).
    logits: Vec<f32>,
    /// Flat-path sampler, rebuilt when the parameters change (history kept).
    sampler: Option<Sampler>,
    /// Live branches (generation-checked handles).
    pub(crate) branches: Slots<BranchState>,
    /// Parent/children links between branches.
    pub(crate) topology: Topology,
    /// Which sequence ids live branches hold and how many KV cells they hold (written only
    /// by `ledger.rs`).
    pub(crate) ledger: Ledger,
    /// The hidden sequence id holding the cells of pruned branches until a decode needs the
    /// room (`None` for embeddings contexts and `n_seq_max = 256`, which free at once).
    park_seq: Option<i32>,
    /// Cells only `park_seq` holds (exact, like the ledger's cell count).
    pub(crate) parked: usize,
    /// K+V bytes per cell (for `memory_size`).
    kv_cell_bytes: u64,
    /// Batch-invariant kernels (then `retain_only` also rewrites the winner's cells in order).
    pub(crate) batch_invariant: bool,
    /// An engine tick decodes its commit rows and its prefill rows in separate `llama_decode`
    /// calls (see `engine::tick::split_point`): the fast CPU kernels with flash attention.
    pub(crate) split_mixed_ticks: bool,
    /// Vectors of the last `encode()` per sequence (embeddings contexts).
    pub(crate) encoded: HashMap<i32, Encoded>,
    /// Asked before every decode of a call but the first (see [`Context::with_interrupt`]).
    interrupt: Option<InterruptCheck>,
    /// `llama_decode` calls made by the current call (the first is never interrupted: the
    /// caller has just checked for signals itself).
    batches_in_call: u32,
}

/// A check run between the decodes of one call: `true` stops the call, which then rolls
/// back like any failed decode and returns [`LloyalError::Interrupted`].
pub type InterruptCheck = Box<dyn Fn() -> bool + Send>;

impl ContextState {
    /// Sizes fixed at creation.
    pub fn shape(&self) -> ContextShape {
        self.shape
    }

    /// The model.
    pub fn model(&self) -> Arc<Model> {
        self.raw.model().clone()
    }

    /// Bytes of KV cache memory (cells x per-cell K+V size over all layers).
    pub fn memory_size(&self) -> u64 {
        u64::from(self.shape.n_ctx) * self.kv_cell_bytes
    }

    /// Whether a live branch holds `seq_id`.
    pub fn is_leased(&self, seq_id: i32) -> bool {
        self.branches.handles().iter().any(|&h| self.branches.get(h).is_some_and(|b| b.seq_id == seq_id))
    }

    pub(crate) fn check_seq(&self, seq_id: i32) -> Result<()> {
        if seq_id < 0 || seq_id as u32 >= self.shape.n_seq_max {
            return Err(LloyalError::invalid(format!(
                "seq_id {seq_id} is out of range: this context has n_seq_max={} (valid 0 to {}); \
                 create the context with a larger n_seq_max to use more sequences",
                self.shape.n_seq_max,
                self.shape.n_seq_max - 1
            )));
        }
        Ok(())
    }

    /// Validate a seq id for a flat-path write: in range and not owned by a branch.
    fn check_flat_seq(&self, seq_id: i32) -> Result<()> {
        self.check_seq(seq_id)?;
        if self.is_leased(seq_id) {
            return Err(LloyalError::SeqLeased { seq_id });
        }
        Ok(())
    }

    fn check_no_leases(&self) -> Result<()> {
        match self.branches.handles().first().and_then(|&h| self.branches.get(h)) {
            Some(b) => Err(LloyalError::SeqLeased { seq_id: b.seq_id }),
            None => Ok(()),
        }
    }

    /// Largest position stored for `seq_id` (-1 when empty).
    pub fn seq_pos_max(&mut self, seq_id: i32) -> Result<i32> {
        self.check_seq(seq_id)?;
        Ok(self.raw.seq_pos_max(seq_id))
    }

    /// Decode `tokens` for `seq_id` starting at `pos`, chunked by n_batch; keeps the last
    /// token's logits. All-or-nothing: a failure removes the cells written by this call.
    pub fn decode(&mut self, tokens: &[i32], pos: i32, seq_id: i32) -> Result<()> {
        self.check_flat_seq(seq_id)?;
        self.raw.model().check_tokens(tokens)?;
        if tokens.is_empty() {
            return Ok(());
        }
        if tokens.len() > self.shape.n_ctx as usize {
            return Err(LloyalError::KvCacheFull {
                needed: tokens.len(),
                n_ctx: self.shape.n_ctx,
                detail: "more tokens than the whole cache holds".into(),
            });
        }
        let pos_max = self.seq_pos_max(seq_id)?;
        if pos < 0 || (pos_max >= 0 && pos != pos_max + 1) {
            return Err(LloyalError::invalid(format!(
                "decode at pos {pos} on seq {seq_id}: the sequence ends at position {pos_max}, so the next \
                 position must be {}; remove cells with kv_cache_remove to rewrite history",
                pos_max + 1
            )));
        }
        let last = self.decode_rows(tokens, pos, seq_id)?;
        self.logits = self.copy_logits_row(last)?;
        Ok(())
    }

    /// Decode one sequence's tokens in n_batch chunks, logits only on the final token.
    /// Returns the batch row of that final token. Rolls back on failure.
    fn decode_rows(&mut self, tokens: &[i32], pos: i32, seq_id: i32) -> Result<i32> {
        let n_batch = self.shape.n_batch as usize;
        let total = tokens.len();
        for (c, chunk) in tokens.chunks(n_batch).enumerate() {
            let start = c * n_batch;
            self.batch.clear();
            for (i, &t) in chunk.iter().enumerate() {
                let at = start + i;
                self.batch.push(t, pos + at as i32, seq_id, at + 1 == total);
            }
            if let Err(e) = self.run_batch() {
                self.remove_cells(seq_id, pos, -1);
                return Err(e);
            }
        }
        Ok(self.batch.len() as i32 - 1)
    }

    /// Free a pruned branch's own cells `[p0, p1)` of `seq_id` without making them reusable
    /// yet: they move to the hidden parking sequence, so the survivors' next tokens keep
    /// landing after their own cells (in position order) instead of in the holes. The caller
    /// then removes `seq_id`'s cells. [`Self::reclaim_parked`] frees them when a decode or a
    /// state load needs the room.
    pub(crate) fn park_cells(&mut self, seq_id: i32, p0: i32, p1: i32) {
        let Some(park) = self.park_seq else { return };
        if p1 <= p0 {
            return;
        }
        // Unified KV makes a partial-range copy a metadata change.
        self.raw.seq_cp(seq_id, park, p0, p1);
        self.parked += (p1 - p0) as usize;
    }

    /// Really free the parked cells (after this, survivors may reuse them and exactness of
    /// their later logits against a lone run is no longer guaranteed).
    pub(crate) fn reclaim_parked(&mut self) {
        if let Some(park) = self.park_seq {
            if self.parked > 0 {
                self.remove_cells(park, -1, -1);
            }
        }
        self.parked = 0;
    }

    /// The parked-cell count after llama.cpp dropped every sequence but the branches'
    /// (`llama_memory_clear`, `seq_keep`).
    pub(crate) fn forget_parked(&mut self) {
        self.parked = 0;
    }

    /// Run `llama_decode` on the current batch, mapping its return codes. When no cells are
    /// free for it but some are parked, the parked cells are reclaimed and the decode retried.
    pub(crate) fn run_batch(&mut self) -> Result<()> {
        if self.batches_in_call > 0 && self.interrupt.as_ref().is_some_and(|check| check()) {
            return Err(LloyalError::Interrupted);
        }
        self.batches_in_call += 1;
        clear_recent_errors();
        let n = self.batch.len();
        let mut code = self.raw.decode(&self.batch);
        if code == 1 && self.parked > 0 {
            // llama.cpp checks for room before touching the cache, so the retry is clean.
            self.reclaim_parked();
            code = self.raw.decode(&self.batch);
        }
        match code {
            0 => Ok(()),
            1 => Err(LloyalError::KvCacheFull {
                needed: n,
                n_ctx: self.shape.n_ctx,
                detail: "no contiguous free cells for this batch".into(),
            }),
            2 => Err(LloyalError::Interrupted),
            _ => Err(LloyalError::Decode {
                code,
                detail: match recent_errors() {
                    d if d.is_empty() => "see LLOYAL_LOG=1 for llama.cpp's log".into(),
                    d => d,
                },
            }),
        }
    }

    /// Copy the logits of batch row `row` (which must have requested logits).
    pub(crate) fn copy_logits_row(&mut self, row: i32) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.copy_logits_into(row, &mut out)?;
        Ok(out)
    }

    /// Remove cells `[p0, p1)` of a sequence (p1 = -1: to the end). Returns llama.cpp's verdict.
    pub(crate) fn remove_cells(&mut self, seq_id: i32, p0: i32, p1: i32) -> bool {
        self.raw.seq_rm(seq_id, p0, p1)
    }

    /// The flat path's last logits.
    pub fn logits(&self) -> Result<&[f32]> {
        if self.logits.is_empty() {
            return Err(LloyalError::NoLogits);
        }
        Ok(&self.logits)
    }

    /// Sample from the flat path's last logits with `params`, then accept the token into the
    /// flat sampler's history (penalties persist across calls, as in the original API).
    pub fn sample(&mut self, params: SamplingParams) -> Result<i32> {
        self.sample_from(params, None, None)
    }

    /// [`Self::sample`] from `logits` (caller-modified, length n_vocab) instead of the last
    /// decode's, and/or with every token `grammar` forbids masked out first. The grammar is
    /// not advanced: the caller accepts the token into it (as with `Grammar.apply`).
    pub fn sample_from(
        &mut self,
        params: SamplingParams,
        logits: Option<Vec<f32>>,
        grammar: Option<&mut Grammar>,
    ) -> Result<i32> {
        let n_vocab = self.shape.n_vocab as usize;
        if let Some(l) = &logits {
            if l.len() != n_vocab {
                return Err(LloyalError::invalid(format!(
                    "logits has {} entries; the model's vocabulary has {n_vocab}: pass an array of \
                     length n_vocab (e.g. a modified copy of get_logits())",
                    l.len()
                )));
            }
        } else if self.logits.is_empty() {
            return Err(LloyalError::NoLogits);
        }
        let masked = match grammar {
            Some(g) => {
                let mut m = logits.as_deref().unwrap_or(&self.logits).to_vec();
                g.mask(&mut m)?;
                if m.iter().all(|&l| l == f32::NEG_INFINITY) {
                    return Err(LloyalError::Grammar(
                        "the grammar allows no token with these logits; check the grammar's \
                         state (accept each sampled token into it) or the logits passed"
                            .into(),
                    ));
                }
                Some(m)
            }
            None => logits,
        };
        let model = self.model();
        match &mut self.sampler {
            Some(s) => s.set_params(&model, params)?,
            None => self.sampler = Some(Sampler::new(&model, params)?),
        }
        let sampler = self.sampler.as_mut().ok_or(LloyalError::NoLogits)?;
        let token = sampler.sample(masked.as_deref().unwrap_or(&self.logits), &[]);
        sampler.accept(token);
        Ok(token)
    }

    /// Forget the flat sampler's history (penalties, DRY, RNG).
    pub fn reset_sampler(&mut self) {
        self.sampler = None;
    }

    /// Entropy of the flat path's last logits.
    pub fn model_entropy(&self, base: Base) -> Result<f64> {
        Ok(entropy(self.logits()?, base))
    }

    /// Surprisal of `token` under the flat path's last logits.
    pub fn model_surprisal(&self, token: i32, base: Base) -> Result<f64> {
        self.raw.model().check_token(i64::from(token))?;
        Ok(surprisal(self.logits()?, token as usize, base))
    }

    /// `kv_cache_clear`: empty every sequence (refused while any branch holds one).
    pub fn kv_clear(&mut self) -> Result<()> {
        self.check_no_leases()?;
        self.raw.memory_clear();
        self.forget_parked();
        self.logits.clear();
        Ok(())
    }

    /// `kv_cache_remove(seq, start, end)`: drop positions `[start, end)`; `end = -1` = to the end.
    pub fn kv_remove(&mut self, seq_id: i32, start: i32, end: i32) -> Result<()> {
        self.check_flat_seq(seq_id)?;
        check_range(start, end)?;
        if !self.remove_cells(seq_id, start, end) {
            return Err(LloyalError::Backend(format!(
                "llama.cpp refused to remove positions [{start}, {end}) of seq {seq_id}"
            )));
        }
        Ok(())
    }

    /// `kv_seq_copy(src, dst, p0, p1)`: share `src`'s cells `[p0, p1)` with `dst` (no tensor copy).
    pub fn kv_copy(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        self.check_seq(src)?;
        self.check_flat_seq(dst)?;
        check_range(p0, p1)?;
        if src == dst {
            return Ok(());
        }
        // Unified KV makes partial copies legal.
        self.raw.seq_cp(src, dst, p0, p1);
        Ok(())
    }

    /// `kv_seq_keep(seq)`: drop every other sequence (refused if a branch holds another one).
    pub fn kv_keep(&mut self, seq_id: i32) -> Result<()> {
        self.check_flat_seq(seq_id)?;
        self.check_no_leases()?;
        self.raw.seq_keep(seq_id);
        self.forget_parked();
        Ok(())
    }

    /// Raw context pointer for sibling core modules (branches, state I/O).
    pub(crate) fn raw_mut(&mut self) -> &mut RawContext {
        &mut self.raw
    }

    /// The shared decode batch for sibling core modules.
    pub(crate) fn batch_mut(&mut self) -> &mut Batch {
        &mut self.batch
    }

    /// The logits of batch row `row` of the last decode.
    fn logits_of_row(&mut self, row: i32) -> Result<&[f32]> {
        self.raw
            .logits_row(row)
            .ok_or_else(|| LloyalError::Backend(format!("llama.cpp has no logits for batch row {row}")))
    }

    /// Copy the logits of batch row `row` into `out` (reusing its allocation).
    pub(crate) fn copy_logits_into(&mut self, row: i32, out: &mut Vec<f32>) -> Result<()> {
        let src = self.logits_of_row(row)?;
        out.clear();
        out.extend_from_slice(src);
        Ok(())
    }

    /// Copy logits row `row` of the last decode into branch `handle`'s `next_logits` (its
    /// buffer reused), summarised in the same pass (`Logits::fill_from`).
    pub(crate) fn fill_next_logits(&mut self, row: i32, handle: Handle) -> Result<()> {
        self.fill_next_logits_rows(&[(row, handle)])
    }

    /// [`Self::fill_next_logits`] for each `(row, branch)`, the rows shared among the decode's
    /// threads (on an engine thread: `omp::parallel_for`). Each branch's snapshot also gets the
    /// log-sum-exp of its sampling distribution's scale (sampling perplexity at commit).
    pub(crate) fn fill_next_logits_rows(&mut self, rows: &[(i32, Handle)]) -> Result<()> {
        let mut jobs = Vec::with_capacity(rows.len());
        for &(_, handle) in rows {
            let b = self.branch_mut(handle)?;
            jobs.push((Some(b.sampling_scale()), Mutex::new(std::mem::take(&mut b.next_logits))));
        }
        let ids: Vec<i32> = rows.iter().map(|r| r.0).collect();
        let threads = usize::try_from(self.shape.n_threads).unwrap_or(1);
        let filled = match self.raw.logits_rows(&ids) {
            Some(srcs) => {
                crate::omp::parallel_for(jobs.len(), threads, &|i| {
                    let (scale, next) = &jobs[i];
                    next.lock().fill_from(srcs[i], *scale);
                });
                Ok(())
            }
            None => Err(LloyalError::Backend(format!(
                "llama.cpp has no logits for one of the batch rows {ids:?}"
            ))),
        };
        for (&(_, handle), (_, next)) in rows.iter().zip(jobs) {
            self.branch_mut(handle)?.next_logits = next.into_inner();
        }
        filled
    }
}

/// The ledger check after a context call (see [`crate::ledger`]): a mismatch is a bug in
/// lloyal, reported loudly rather than left to corrupt later calls.
fn check_ledger(state: &mut ContextState) {
    if crate::ledger::checking() {
        if let Err(e) = state.check_ledger() {
            panic!("KV ledger out of step with llama.cpp after a context call: {e}");
        }
    }
}

fn check_range(start: i32, end: i32) -> Result<()> {
    if start < 0 || (end != -1 && end < start) {
        return Err(LloyalError::invalid(format!(
            "invalid position range [{start}, {end}): need 0 <= start and end == -1 or end >= start"
        )));
    }
    Ok(())
}
