//! Calls into Python from lloyal's own threads, stopped before the interpreter exits.
//!
//! The engine thread answers awaited operations and wakes token streams through
//! `loop.call_soon_threadsafe`. CPython ends a foreign thread that wants the GIL while the
//! interpreter finalizes with `pthread_exit`, which cannot unwind through Rust frames: the
//! process aborted when an asyncio program exited right after its last await (the engine
//! thread was still inside `call_soon_threadsafe`, between its socket write and taking the GIL
//! back). `lloyal` registers [`quiesce_callbacks`] with `atexit`: from then on these calls are
//! skipped (no event loop is left to take them), and the ones under way are waited for.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// (exiting, calls under way).
static STATE: Mutex<(bool, usize)> = Mutex::new((false, 0));
static LEFT: Condvar = Condvar::new();

/// The longest `atexit` waits for callbacks under way.
const EXIT_WAIT: Duration = Duration::from_secs(5);

/// The longest `atexit` waits for the engines' decodes under way (a tick of one batch).
const ENGINE_WAIT: Duration = Duration::from_secs(10);

fn state() -> MutexGuard<'static, (bool, usize)> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Run `f` with the GIL from a native thread, unless the interpreter is exiting.
pub fn attach(f: impl FnOnce(Python<'_>)) {
    {
        let mut s = state();
        if s.0 {
            return;
        }
        s.1 += 1;
    }
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            let mut s = state();
            s.1 -= 1;
            if s.1 == 0 {
                LEFT.notify_all();
            }
        }
    }
    let _leave = Leave;
    Python::attach(f);
}

/// Stop lloyal's threads from calling into Python and wait (GIL released, at most 5 s) for
/// the calls under way, and shut every context's engine down, waiting (at most 10 s) for the
/// decodes under way; registered with ``atexit`` by ``import lloyal``.
#[pyfunction]
pub fn quiesce_callbacks(py: Python<'_>) {
    py.detach(|| {
        state().0 = true;
        lloyal_core::engine::quiesce_all(ENGINE_WAIT);
        let deadline = Instant::now() + EXIT_WAIT;
        let mut s = state();
        while s.1 > 0 {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            s = LEFT.wait_timeout(s, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    });
}
