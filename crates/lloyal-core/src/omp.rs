//! OpenMP thread pools: llama.cpp computes on GNU OpenMP, and each thread that starts a parallel
//! region gets a pool of its own workers, which lives as long as that thread.
//!
//! libgomp counts the threads of every pool in the process, and when they outnumber the CPUs it
//! "throttles": a worker waiting at one of a decode's hundreds of barriers spins 100 times
//! instead of ~300,000, then sleeps in the kernel. On a 2-vCPU Xeon one engine thread's pool (2
//! threads) is within bounds, but a second pool left behind by a model load (llama.cpp's AMX
//! repack runs a parallel loop on the loading thread) pushed the count to 3: every decode then
//! made ~1,300 context switches and took 25-35% longer (`benches/RESULTS.md`, "OpenMP pools").
//!
//! So work that may start a parallel region off the engine threads (loading a model) runs on a
//! thread of its own, whose pool ends with it; every decode runs on its context's engine thread
//! (the flat path's and embeddings' too: `Context::apply_decoding`); and lloyal's own parallel
//! host work ([`parallel_for`]: the rows of a decode) runs on an engine thread's pool, whose
//! workers are still spinning from the decode: no thread is started and none is woken.
//!
//! An engine thread's pool counts too while its context sits idle: a second context open in the
//! process, not decoding, made the first one's decodes 6-19% slower (medians; 350-490 sleeps a
//! tick instead of 0-4) on that Xeon (`benches/bench_idle_context.py`). So an engine that has
//! idled for a while hands its workers back ([`release_pool`]: OpenMP 5's
//! `omp_pause_resource_all`), and its next decode starts them again.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    static ENGINE: Cell<bool> = const { Cell::new(false) };
}

/// Mark this thread as an engine thread: [`parallel_for`] may use its OpenMP pool, and it may
/// decode ([`on_engine_thread`]).
pub fn mark_engine_thread() {
    ENGINE.with(|e| e.set(true));
}

/// Whether this thread is an engine thread: the only threads that call `llama_decode`
/// (`ContextState::run_batch` refuses elsewhere).
pub fn on_engine_thread() -> bool {
    ENGINE.with(Cell::get)
}

/// Run `job(i)` for every `i` in `0..n`, on `threads` threads of this engine thread's OpenMP
/// pool (each index once, dynamically balanced), or on this thread alone elsewhere, with one
/// item, or without OpenMP (not Linux). A panic in `job` is caught and resumed here.
pub fn parallel_for(n: usize, threads: usize, job: &(dyn Fn(usize) + Sync)) {
    let threads = threads.min(n);
    if threads <= 1 || !ENGINE.with(Cell::get) || !gomp::AVAILABLE {
        (0..n).for_each(job);
        return;
    }
    let next = AtomicUsize::new(0);
    let panicked = std::sync::Mutex::new(None);
    let work = || {
        while let Some(i) = Some(next.fetch_add(1, Ordering::Relaxed)).filter(|&i| i < n) {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(i))) {
                *panicked.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(p);
                next.store(n, Ordering::Relaxed);
            }
        }
    };
    gomp::parallel(threads, &work);
    if let Some(p) = panicked.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
        std::panic::resume_unwind(p);
    }
}

/// End this thread's OpenMP pool (its workers exit; the next parallel region this thread
/// starts makes a new one), so that it no longer counts against libgomp's throttle while this
/// thread has nothing to compute. Returns whether a pool was ended: `false` without libgomp's
/// `omp_pause_resource_all` (GCC < 9, not Linux). Call it outside any parallel region.
pub fn release_pool() -> bool {
    gomp::pause_pool()
}

/// Run `f` on a new thread and return its result (a panic in `f` resumes on the caller):
/// any OpenMP pool `f` starts ends when the thread does.
pub fn on_own_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| match scope.spawn(f).join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

#[cfg(test)]
mod tests {
    use super::{mark_engine_thread, on_own_thread, parallel_for};
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn parallel_for_runs_each_index_once_on_the_pool() {
        on_own_thread(|| {
            mark_engine_thread();
            for n in [0usize, 1, 2, 7, 100] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                parallel_for(n, 2, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
            }
            let caught = std::panic::catch_unwind(|| parallel_for(4, 2, &|i| assert!(i != 2, "job 2 fails")));
            assert!(caught.is_err(), "a panic in a job reaches the caller");
        });
    }

    /// The kernel ids of the threads that ran two jobs that wait for each other (so two threads).
    #[cfg(target_os = "linux")]
    fn team_of_two() -> Vec<i32> {
        let arrived = AtomicUsize::new(0);
        let tids = std::sync::Mutex::new(Vec::new());
        parallel_for(2, 2, &|_| {
            tids.lock().unwrap().push(libc_gettid());
            arrived.fetch_add(1, Ordering::SeqCst);
            let start = std::time::Instant::now();
            while arrived.load(Ordering::SeqCst) < 2 && start.elapsed().as_secs() < 10 {
                std::hint::spin_loop();
            }
        });
        tids.into_inner().unwrap()
    }

    #[cfg(target_os = "linux")]
    fn libc_gettid() -> i32 {
        // SAFETY: gettid has no preconditions.
        unsafe { libc::gettid() }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_released_pool_ends_its_workers_and_the_next_region_starts_new_ones() {
        on_own_thread(|| {
            mark_engine_thread();
            let me = libc_gettid();
            let first = team_of_two();
            let worker = *first.iter().find(|&&t| t != me).expect("a second thread ran a job");
            let alive = |tid: i32| std::path::Path::new(&format!("/proc/self/task/{tid}")).exists();
            assert!(alive(worker));
            assert!(super::release_pool(), "libgomp has omp_pause_resource_all");
            // Joined, the worker may still be listed for a moment (the kernel wakes the joiner
            // before it reaps the thread).
            let joined = std::time::Instant::now();
            while alive(worker) && joined.elapsed().as_secs() < 5 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            assert!(!alive(worker), "the pool's worker ended");
            let second = team_of_two();
            assert_eq!(second.len(), 2);
            assert!(second.iter().any(|&t| t != me && t != worker), "a new worker: {second:?}");
        });
    }

    #[test]
    fn runs_elsewhere_and_returns_or_rethrows() {
        let here = std::thread::current().id();
        assert_ne!(on_own_thread(|| std::thread::current().id()), here);
        assert_eq!(on_own_thread(|| 6 * 7), 42);
        let caught = std::panic::catch_unwind(|| on_own_thread(|| panic!("boom")));
        assert!(caught.is_err());
    }
}

/// The GNU OpenMP entry point llama.cpp's parallel regions compile to.
#[cfg(target_os = "linux")]
mod gomp {
    use std::ffi::{c_uint, c_void};

    pub(super) const AVAILABLE: bool = true;

    extern "C" {
        fn GOMP_parallel(
            f: unsafe extern "C" fn(*mut c_void),
            data: *mut c_void,
            threads: c_uint,
            flags: c_uint,
        );
    }

    unsafe extern "C" fn trampoline(data: *mut c_void) {
        // SAFETY: `data` is the `&&dyn Fn` `parallel` passed, alive until GOMP_parallel returns.
        let work = unsafe { &*(data as *const &(dyn Fn() + Sync)) };
        work();
    }

    /// Run `work` on `threads` threads of this thread's OpenMP team (this one included), and
    /// return when all are done. `work` must not unwind (parallel_for catches panics).
    pub(super) fn parallel(threads: usize, work: &(dyn Fn() + Sync)) {
        let mut data: &(dyn Fn() + Sync) = work;
        let threads = c_uint::try_from(threads).unwrap_or(c_uint::MAX);
        // SAFETY: libgomp calls `trampoline(data)` on each team thread and returns after all
        // have; `data` points at `work`, borrowed for the whole call, and `work` is Sync.
        unsafe { GOMP_parallel(trampoline, (&mut data as *mut &(dyn Fn() + Sync)).cast(), threads, 0) };
    }

    /// `int omp_pause_resource_all(omp_pause_resource_t kind)` (OpenMP 5.0, libgomp since GCC 9).
    type PauseAll = unsafe extern "C" fn(kind: std::ffi::c_int) -> std::ffi::c_int;

    /// `omp_pause_soft`: the pool's threads end; the next parallel region starts new ones.
    const OMP_PAUSE_SOFT: std::ffi::c_int = 1;

    /// libgomp's `omp_pause_resource_all`, looked up once: an older libgomp (a wheel may carry
    /// GCC 8's) lacks it, and linking it by name would fail to load there.
    fn pause_all() -> Option<PauseAll> {
        static FOUND: std::sync::OnceLock<Option<PauseAll>> = std::sync::OnceLock::new();
        *FOUND.get_or_init(|| {
            // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads the loaded
            // objects' symbol tables.
            let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"omp_pause_resource_all".as_ptr()) };
            // SAFETY: the symbol, when present, is libgomp's function of exactly this signature.
            (!f.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, PauseAll>(f) })
        })
    }

    /// End this thread's pool (libgomp's `gomp_pause_host`: joins its workers and takes them
    /// off the count of managed threads).
    pub(super) fn pause_pool() -> bool {
        let Some(pause) = pause_all() else { return false };
        // SAFETY: called outside any parallel region (the engine between ticks); libgomp then
        // frees only this thread's own pool and returns 0.
        unsafe { pause(OMP_PAUSE_SOFT) == 0 }
    }
}

#[cfg(not(target_os = "linux"))]
mod gomp {
    pub(super) const AVAILABLE: bool = false;

    pub(super) fn pause_pool() -> bool {
        false
    }

    pub(super) fn parallel(_threads: usize, work: &(dyn Fn() + Sync)) {
        work();
    }
}
