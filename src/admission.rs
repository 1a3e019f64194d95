//! `lloyal._lloyal.Admission`: a scheduler's admission bookkeeping (`lloyal_core::cache::admission`)
//! over its context's prefix cache. Every call takes the book's lock and the cache's, never
//! the context's: admission decides on the event loop without waiting for a tick.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lloyal_core::cache::admission::{self, Start};
use lloyal_core::cache::{self, PrefixIndex};
use lloyal_core::{Context, ContextState};
use pyo3::prelude::*;

use crate::branch::PyBranch;
use crate::context::PyContext;
use crate::error::to_py;
use crate::lease;

/// When and from what generation requests start: at most ``max_running`` choices run; a
/// request forks the longest cached prefix of its prompt or, when a running request is still
/// writing a prompt that shares more, that prompt once written; what it needs is reserved
/// from :meth:`plan` until its branches exist.
///
/// Example:
///     >>> from lloyal._lloyal import Admission
///     >>> with Context(default_model_path(), n_seq_max=4) as ctx:
///     ...     book = Admission(ctx, 3)
///     ...     plan = book.plan(list(range(100, 120)), 2)
///     ...     book.reserve(plan)
///     ...     (plan.base, plan.leases, plan.cells, book.plan([1, 2], 2))
///     (None, 3, 21, None)
#[pyclass(name = "Admission", module = "lloyal._lloyal", frozen)]
pub struct PyAdmission {
    /// The most choices running at once.
    #[pyo3(get)]
    max_running: usize,
    ctx: Py<PyContext>,
    core: Arc<Context>,
    /// Shared with the engine, which records a copy written back ([`PyAdmission::arestore`]).
    book: Arc<Mutex<admission::Admission>>,
}

/// The terms a request is admitted on (:meth:`Admission.plan`).
#[pyclass(name = "AdmissionPlan", module = "lloyal._lloyal", frozen)]
pub struct PyPlan {
    plan: admission::Plan,
    /// The branch it forks, if any.
    base: Option<Py<PyBranch>>,
}

/// Register the classes with the native module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAdmission>()?;
    m.add_class::<PyPlan>()
}

/// Lock an admission book (a poisoned lock is taken over: the book stays consistent between
/// its calls).
fn lock_book(book: &Mutex<admission::Admission>) -> MutexGuard<'_, admission::Admission> {
    book.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PyAdmission {
    fn book(&self) -> MutexGuard<'_, admission::Admission> {
        lock_book(&self.book)
    }

    /// Run `f` on the book and the context's prefix index, locked in that order.
    fn with_index<T>(&self, f: impl FnOnce(&mut admission::Admission, &mut PrefixIndex) -> T) -> T {
        let mut book = self.book();
        f(&mut book, &mut cache::lock(self.core.prefix_index()))
    }

    /// Prune what unpinning let go, without the GIL.
    fn tidy(&self, py: Python<'_>) {
        crate::cache::tidy(py, &self.core);
    }
}

#[pymethods]
impl PyAdmission {
    #[new]
    fn new(ctx: Py<PyContext>, max_running: usize) -> PyResult<Self> {
        let core = Arc::clone(&ctx.get().inner);
        core.check_open().map_err(to_py)?;
        let book = admission::Admission::new(max_running);
        Ok(PyAdmission { max_running: book.max_running(), ctx, core, book: Arc::new(Mutex::new(book)) })
    }

    /// Choices running now (admitted, not yet released).
    #[getter]
    fn running(&self) -> usize {
        self.book().running()
    }

    /// ``(choices, leases, cells)`` reserved by requests being admitted.
    #[getter]
    fn reserved(&self) -> (usize, usize, usize) {
        let r = self.book().reserved();
        (r.choices, r.leases, r.cells)
    }

    /// Raise ``ValueError`` when a request of ``best_of`` choices can never run here.
    fn check(&self, best_of: usize) -> PyResult<()> {
        self.book().check(best_of, self.core.shape().n_seq_max as usize).map_err(to_py)
    }

    /// Whether a request of ``best_of`` choices would queue: behind ``waiting`` others, or for
    /// a free slot.
    fn must_wait(&self, best_of: usize, waiting: usize) -> bool {
        self.book().must_wait(best_of, waiting)
    }

    /// The terms on which a request for ``prompt`` with ``best_of`` choices starts now, the
    /// branch it forks pinned; ``None`` when it must wait (no free slot, or the prompt in
    /// flight it would fork is not written yet). Await room for the plan's ``leases`` and
    /// ``cells``, then :meth:`reserve` it; :meth:`release` it in every case. ``share=False``:
    /// the request forks nothing and writes its whole prompt (one scored token by token).
    #[pyo3(signature = (prompt, best_of, share = true))]
    fn plan(
        &self,
        py: Python<'_>,
        prompt: Vec<i32>,
        best_of: usize,
        share: bool,
    ) -> PyResult<Option<PyPlan>> {
        let Some(plan) = self.with_index(|book, index| book.plan_shared(index, &prompt, best_of, share))
        else {
            return Ok(None);
        };
        let base = match plan.start {
            Start::New | Start::Restore { .. } => None,
            Start::Fork { handle, .. } => {
                Some(Py::new(py, PyBranch { ctx: self.ctx.clone_ref(py), handle })?)
            }
        };
        Ok(Some(PyPlan { plan, base }))
    }

    /// Await the prefix cache's host-memory copy that a plan with :attr:`AdmissionPlan.restores`
    /// reuses, written back into the context after its room was found and reserved: the branch
    /// holding it (a cache entry again, pinned until the plan is admitted or released), to fork
    /// as another plan forks :attr:`AdmissionPlan.base`. Once per plan.
    fn arestore<'py>(&self, py: Python<'py>, plan: &PyPlan) -> PyResult<Bound<'py, PyAny>> {
        let id = plan.plan.id;
        let (tokens, copy, bytes) = self.book().take_restore(id).map_err(to_py)?;
        let book = Arc::clone(&self.book);
        let make = Box::new(move |s: &mut ContextState| {
            let index = Arc::clone(s.prefix_index());
            match s.cache_restore(&tokens, copy) {
                Ok(handle) => {
                    lock_book(&book).restored(&mut cache::lock(&index), id, handle);
                    Ok(handle)
                }
                Err((e, copy)) => {
                    // the copy is kept (the plan holds it again), not lost with the error
                    lock_book(&book).restore_failed(&mut cache::lock(&index), id, (tokens, *copy, bytes));
                    Err(e)
                }
            }
        });
        lease::awaitable_branch(py, &self.ctx, None, Some(0.0), make)
    }

    /// The room was found: hold the plan's need from later requests, and make its prompt one
    /// that arriving requests fork once written rather than write again.
    fn reserve(&self, plan: &PyPlan) -> PyResult<()> {
        self.book().reserve(plan.plan.id).map_err(to_py)
    }

    /// ``branch`` will hold the plan's prompt (its one choice, or its ``best_of`` root).
    fn holds(&self, plan: &PyPlan, branch: &PyBranch) -> PyResult<()> {
        let handle = branch.handle_in(&self.core, "this Admission")?;
        self.book().holds(plan.plan.id, handle).map_err(to_py)
    }

    /// The plan's prompt is written: whether requests wait for it (wake them).
    fn written(&self, plan: &PyPlan) -> bool {
        self.book().written(plan.plan.id)
    }

    /// The plan's branches exist: its pins and reservation go, its choices count as running.
    fn admitted(&self, py: Python<'_>, plan: &PyPlan) -> PyResult<()> {
        self.with_index(|book, index| book.admitted(index, plan.plan.id)).map_err(to_py)?;
        self.tidy(py);
        Ok(())
    }

    /// The request ended with ``choices`` (each ``(branch, generated tokens, perplexity)``):
    /// ``(kept, perplexities)``, the ``n`` choice indices it returns, best first, and the
    /// perplexities it ranked by (empty when unranked). Ranked by perplexity (lowest first; one
    /// that generated nothing last) when ``rank`` or more than ``n`` ran. The best choice's
    /// branch stays in the prefix cache holding the prompt and its tokens (unless not
    /// ``keep_best``: a cancelled request), the others are released, ``root`` (holding just the
    /// prompt) is cached, and the plan is released.
    #[pyo3(signature = (plan, choices, root, *, n, rank, keep_best))]
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        py: Python<'_>,
        plan: &PyPlan,
        choices: Vec<(PyRef<'_, PyBranch>, Vec<i32>, f64)>,
        root: Option<PyRef<'_, PyBranch>>,
        n: usize,
        rank: bool,
        keep_best: bool,
    ) -> PyResult<(Vec<usize>, Vec<f64>)> {
        let owner = "this Admission";
        let choices = choices
            .into_iter()
            .map(|(b, generated, ppl)| Ok((b.handle_in(&self.core, owner)?, generated, ppl)))
            .collect::<PyResult<Vec<_>>>()?;
        let root = root.map(|b| b.handle_in(&self.core, owner)).transpose()?;
        let id = plan.plan.id;
        let out = self.with_index(|book, index| book.finish(index, id, &choices, root, (n, rank, keep_best)));
        self.tidy(py);
        Ok(out)
    }

    /// The request finished or failed: whatever its plan holds goes (pins, reservation,
    /// running choices, its prompt in flight). Whether it held anything still.
    fn release(&self, py: Python<'_>, plan: &PyPlan) -> bool {
        let held = self.with_index(|book, index| book.release(index, plan.plan.id));
        self.tidy(py);
        held
    }
}

#[pymethods]
impl PyPlan {
    /// The branch to fork (``None``: a new branch).
    #[getter]
    fn base(&self, py: Python<'_>) -> Option<Py<PyBranch>> {
        self.base.as_ref().map(|b| b.clone_ref(py))
    }

    /// Fork :attr:`base` at this position (``None``: whole, with its logits).
    #[getter]
    fn at(&self) -> Option<usize> {
        match self.plan.start {
            Start::Fork { at, .. } | Start::Restore { at } => at,
            Start::New => None,
        }
    }

    /// The request starts from a prefix cache entry evicted to host memory, written back by
    /// :meth:`Admission.arestore` (:attr:`base` is ``None`` until then).
    #[getter]
    fn restores(&self) -> bool {
        matches!(self.plan.start, Start::Restore { .. })
    }

    /// Prompt tokens reused (from the cache, or from a prompt in flight).
    #[getter]
    fn reused(&self) -> usize {
        self.plan.reused
    }

    /// The prompt is exactly a cached entry, forked whole: nothing to prefill.
    #[getter]
    fn exact(&self) -> bool {
        self.plan.exact
    }

    /// Choices the request runs.
    #[getter]
    fn best_of(&self) -> usize {
        self.plan.best_of
    }

    /// Leases to have free before starting (this request's and those reserved before it).
    #[getter]
    fn leases(&self) -> usize {
        self.plan.room.leases
    }

    /// KV cells to have free before starting (this request's and those reserved before it).
    #[getter]
    fn cells(&self) -> usize {
        self.plan.room.cells
    }
}
