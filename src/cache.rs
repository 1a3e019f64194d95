//! `lloyal._lloyal.PrefixCache`: a context's prefix cache (`lloyal_core::cache`). Lookups,
//! pins and entries take only the cache's own lock; pruning is the engine's (at the end of a
//! tick, when admission needs room, or at once when no tick runs).

use std::sync::{Arc, MutexGuard};

use lloyal_core::cache::{self, PrefixIndex};
use lloyal_core::{Context, Handle};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::branch::PyBranch;
use crate::context::PyContext;
use crate::detach::run;
use crate::engine;
use crate::error::IntoPyResult;

/// Finished requests' branches kept for their KV, found by the longest shared token prefix.
///
/// The engine evicts least recently used entries that nothing forks (leaves, unpinned) when a
/// branch, a prompt or a token needs a lease or cells that are not free, and prunes released
/// branches once nothing depends on them.
///
/// Example:
///     >>> from lloyal._lloyal import PrefixCache
///     >>> with Context(default_model_path(), n_seq_max=4) as ctx:
///     ...     cache = PrefixCache(ctx)
///     ...     b = Branch.create(ctx, 0, SamplingParams(temperature=0))
///     ...     b.prefill(list(range(100, 120)))
///     ...     kept = cache.add(b, list(range(100, 120)))
///     ...     hit = cache.lookup(list(range(100, 130)))
///     ...     (hit[1], hit[2])
///     (20, 20)
#[pyclass(name = "PrefixCache", module = "lloyal._lloyal", frozen)]
pub struct PyPrefixCache {
    /// For the branches it hands out; `core` is its context.
    ctx: Py<PyContext>,
    core: Arc<Context>,
}

/// Prune what `core`'s prefix cache no longer keeps, without the GIL: at once when no tick
/// runs, else after the tick (which tidies at its end too).
pub fn tidy(py: Python<'_>, core: &Arc<Context>) {
    let core = Arc::clone(core);
    py.detach(move || core.tidy_cache());
}

/// Register the class and the cache's constants with the native module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefixCache>()?;
    m.add("PREFIX_MIN_SHARED", lloyal_core::cache::MIN_SHARED)?;
    m.add("PREFIX_GHOSTS", lloyal_core::cache::GHOSTS)
}

impl PyPrefixCache {
    fn index(&self) -> MutexGuard<'_, PrefixIndex> {
        cache::lock(self.core.prefix_index())
    }

    fn tidy(&self, py: Python<'_>) {
        tidy(py, &self.core);
    }

    fn own(&self, branch: &PyBranch) -> PyResult<Handle> {
        branch.handle_in(&self.core, "this PrefixCache")
    }
}

#[pymethods]
impl PyPrefixCache {
    #[new]
    fn new(ctx: Py<PyContext>) -> PyResult<Self> {
        let core = Arc::clone(&ctx.get().inner);
        core.check_open().py()?;
        Ok(PyPrefixCache { ctx, core })
    }

    /// ``(branch, used, length)`` of the entry a request for ``tokens`` forks, pinned (call
    /// :meth:`unpin` once forked): fork it whole when ``used == length``, else
    /// ``fork(at=used)``. ``None`` when no entry shares enough of ``tokens``.
    fn lookup(&self, py: Python<'_>, tokens: Vec<i32>) -> Option<(PyBranch, usize, usize)> {
        let found = self.index().lookup(&tokens)?;
        Some((PyBranch { ctx: self.ctx.clone_ref(py), handle: found.handle }, found.used, found.len))
    }

    /// Count a request's prompt, ``hit`` of whose tokens came from the cache.
    fn record(&self, hit: usize, prompt: Vec<i32>) {
        self.index().record(hit, &prompt);
    }

    /// Keep ``branch`` (holding exactly ``tokens``) as an entry; ``False`` when an entry
    /// already holds these tokens (``branch`` is then released instead).
    fn add(&self, py: Python<'_>, branch: &PyBranch, tokens: Vec<i32>) -> PyResult<bool> {
        let kept = self.index().add(self.own(branch)?, &tokens);
        self.tidy(py);
        Ok(kept)
    }

    /// Prune ``branch`` once nothing depends on it (no live fork, no pin).
    fn release(&self, py: Python<'_>, branch: &PyBranch) -> PyResult<()> {
        self.index().release(self.own(branch)?);
        self.tidy(py);
        Ok(())
    }

    /// A request is about to fork ``branch``: it is not pruned or evicted until :meth:`unpin`.
    fn pin(&self, branch: &PyBranch) -> PyResult<()> {
        self.index().pin(self.own(branch)?);
        Ok(())
    }

    /// Undo one pin (or a lookup's).
    fn unpin(&self, py: Python<'_>, branch: &PyBranch) -> PyResult<()> {
        self.index().unpin(self.own(branch)?);
        self.tidy(py);
        Ok(())
    }

    /// Most KV cells the entries keep of their own (``None``: no limit); least recently used
    /// entries are evicted to keep within it.
    #[getter]
    fn budget(&self) -> Option<usize> {
        self.index().budget(self.core.shape().n_ctx as usize)
    }

    #[setter]
    fn set_budget(&self, py: Python<'_>, cells: Option<usize>) {
        self.index().set_budget(cells);
        self.tidy(py);
    }

    /// Keep the :attr:`budget` at ``n_ctx`` times ``stats()["reuse"]`` (the share of recent
    /// prompts the cache served or, trimmed less, would have), recomputed at every trim (the
    /// end of each tick, each ``add`` or ``release``) until a budget is set; and keep at most
    /// as many entries nothing forks (a conversation's turns count once) as the last 16
    /// hits reached back (1 + the entries used since the newest holding what a hit
    /// reused), since every kept cell slows every decode a little.
    fn follow_reuse(&self, py: Python<'_>) {
        self.index().follow_reuse();
        self.tidy(py);
    }

    /// Most bytes of host memory the copies of evicted entries hold (0, the default: none are
    /// kept). An entry evicted for room is copied first (its cells, sampler and logits), and a
    /// request that would reuse more of a copy than of any live entry writes it back instead of
    /// prefilling those tokens again (as llama-server's ``--cache-ram``); least recently used
    /// copies go to keep within it.
    #[getter]
    fn host_budget(&self) -> usize {
        self.index().host.budget()
    }

    #[setter]
    fn set_host_budget(&self, bytes: usize) {
        self.index().host.set_budget(bytes);
    }

    /// Await room for ``leases`` more branches and ``cells`` more KV cells, evicting entries
    /// if need be; raises ``LeaseExhaustedError`` or ``KvCacheFullError`` when even an empty
    /// cache would not make it.
    #[pyo3(signature = (*, leases = 0, cells = 0))]
    fn amake_room<'py>(&self, py: Python<'py>, leases: u32, cells: usize) -> PyResult<Bound<'py, PyAny>> {
        engine::awaitable(py, &self.core, move |s| s.cache_ensure_room(leases, cells))
    }

    /// Prune every entry and released branch (with their forks), and drop the host tier's copies.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        run(py, &self.core, |s| {
            s.cache_clear();
            Ok(())
        })
    }

    /// Every entry: ``(branch, tokens)``, in no particular order.
    fn entries(&self, py: Python<'_>) -> Vec<(PyBranch, Vec<i32>)> {
        let all = self.index().entries();
        all.into_iter()
            .map(|(handle, tokens)| (PyBranch { ctx: self.ctx.clone_ref(py), handle }, tokens))
            .collect()
    }

    fn __len__(&self) -> usize {
        self.index().stats().entries
    }

    /// Counters: ``entries``, ``released`` (released branches not pruned yet: something still
    /// forks or pins them), ``hit_tokens`` (prompt tokens served from the cache),
    /// ``lookup_tokens`` (prompt tokens looked up), ``evictions``, and ``reuse`` (moving average
    /// of the share of recent prompts the cache served, or an entry it evicted would have; about
    /// the last 10 prompts count); and of the host tier (:attr:`host_budget`): ``host_entries``
    /// and ``host_bytes`` (copies kept now), ``host_kept`` (entries copied as they were
    /// evicted), ``host_restored`` (copies written back), ``host_restored_tokens`` (prompt
    /// tokens they served) and ``host_dropped`` (copies dropped for the budget).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, h) = {
            let ix = self.index();
            (ix.stats(), ix.host.stats())
        };
        let out = PyDict::new(py);
        out.set_item("entries", s.entries)?;
        out.set_item("released", s.released)?;
        out.set_item("hit_tokens", s.hit_tokens)?;
        out.set_item("lookup_tokens", s.lookup_tokens)?;
        out.set_item("evictions", s.evictions)?;
        out.set_item("reuse", s.reuse)?;
        out.set_item("host_entries", h.entries)?;
        out.set_item("host_bytes", h.bytes)?;
        out.set_item("host_kept", h.kept)?;
        out.set_item("host_restored", h.restored)?;
        out.set_item("host_restored_tokens", h.restored_tokens)?;
        out.set_item("host_dropped", h.dropped)?;
        Ok(out)
    }
}
