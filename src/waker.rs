//! Waking an asyncio loop from the engine thread without taking the GIL.
//!
//! A token stream's waker used to run `loop.call_soon_threadsafe` on the engine thread, which
//! needs the GIL: whenever the event loop held it (formatting the previous token's SSE chunk,
//! say), the engine stopped between two decodes until the loop let go, once per stream and
//! tick. A [`PyLoopWaker`] takes the futures to settle into a queue and writes one byte to a
//! socket pair that the loop watches (`loop.add_reader(waker.fileno(), waker.drain)`); the
//! loop settles every queued future in one `drain()` call. The engine thread never waits for
//! Python. Unix only: elsewhere (Windows' proactor loop cannot watch a socket)
//! `lloyal.aio` keeps `call_soon_threadsafe`.

#[cfg(unix)]
pub use self::unix::PyLoopWaker;

use pyo3::prelude::*;
use pyo3::types::{PyWeakrefMethods, PyWeakrefReference};

use lloyal_core::engine::gen::Wake;

use crate::aio;

#[cfg(unix)]
mod unix {
    use std::io::{ErrorKind, Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use pyo3::prelude::*;
    use pyo3::types::{PyWeakrefMethods, PyWeakrefReference};

    use crate::aio;

    /// The queue and the socket pair of one event loop's waker (shared with the wake closures).
    pub struct WakerCore {
        ready: Mutex<Vec<Py<PyWeakrefReference>>>,
        /// A byte is on its way (or in the socket) since the last drain.
        signalled: AtomicBool,
        tx: UnixStream,
        rx: UnixStream,
    }

    impl WakerCore {
        /// Queue `future` to be settled (result None) on the loop's thread; the first push after a
        /// drain writes the one byte that wakes the loop. Never takes the GIL.
        pub fn push(&self, future: Py<PyWeakrefReference>) {
            self.ready.lock().unwrap_or_else(|p| p.into_inner()).push(future);
            if !self.signalled.swap(true, Ordering::AcqRel) {
                // Non-blocking: a full socket already holds a wake-up for the loop.
                let _ = (&self.tx).write(&[1]);
            }
        }
    }

    /// Wakes one asyncio event loop from lloyal's engine thread without the GIL: the engine
    /// queues the futures to settle and writes a byte to a socket the loop watches; the loop
    /// calls ``drain()`` when ``fileno()`` is readable. Made by ``lloyal.aio``; Unix only.
    #[pyclass(name = "LoopWaker", module = "lloyal._lloyal", frozen)]
    pub struct PyLoopWaker {
        core: Arc<WakerCore>,
    }

    impl PyLoopWaker {
        /// The shared core, for wake closures.
        pub fn core(&self) -> Arc<WakerCore> {
            Arc::clone(&self.core)
        }
    }

    #[pymethods]
    impl PyLoopWaker {
        #[new]
        fn new() -> PyResult<Self> {
            let (tx, rx) = UnixStream::pair()?;
            tx.set_nonblocking(true)?;
            rx.set_nonblocking(true)?;
            let core = WakerCore { ready: Mutex::new(Vec::new()), signalled: AtomicBool::new(false), tx, rx };
            Ok(PyLoopWaker { core: Arc::new(core) })
        }

        /// The file descriptor the event loop watches for reading.
        fn fileno(&self) -> i32 {
            self.core.rx.as_raw_fd()
        }

        /// Settle every queued future (called by the event loop when ``fileno()`` is readable).
        fn drain(&self, py: Python<'_>) -> PyResult<()> {
            let core = &self.core;
            // Order matters: empty the socket, then clear the flag, then take the queue. A push
            // after the clear writes a byte that stays in the socket for the next drain; had
            // the flag been cleared before the read, a byte written for a push taken here could
            // be read too, leaving the flag set with no byte on its way (every later push lost).
            let mut buf = [0u8; 64];
            loop {
                match (&core.rx).read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => continue,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => break, // WouldBlock: drained
                }
            }
            core.signalled.store(false, Ordering::Release);
            let ready = std::mem::take(&mut *core.ready.lock().unwrap_or_else(|p| p.into_inner()));
            if ready.is_empty() {
                return Ok(());
            }
            let settle = aio::settle(py)?;
            for future in ready {
                // Gone: nobody awaits it (its task was collected). `_settle` skips a future
                // already done (cancelled); one failure must not strand the others.
                if let Some(future) = future.bind(py).upgrade() {
                    let _ = settle.call1((future, py.None()));
                }
            }
            Ok(())
        }
    }
}

/// The engine-side waker that settles `future` through `waker`: a [`PyLoopWaker`] (no GIL
/// on the engine thread), or else an event loop, through `loop.call_soon_threadsafe`.
///
/// The engine holds `future` weakly: its awaiting task holds it while it waits. Held strongly,
/// the engine's stream kept the future, so the task, its coroutine and the token iterator in it
/// (a cycle through Rust that Python's collector cannot see): a stream whose event loop was
/// closed mid-read was never freed, nor its branch's generation request.
pub fn wake_for(waker: Bound<'_, PyAny>, future: &Bound<'_, PyAny>) -> PyResult<Wake> {
    let future = PyWeakrefReference::new(future)?.unbind();
    #[cfg(unix)]
    if let Ok(w) = waker.cast::<PyLoopWaker>() {
        let core = w.get().core();
        return Ok(Box::new(move || core.push(future)));
    }
    let lp = waker.unbind();
    Ok(Box::new(move || {
        crate::exit::attach(|py| {
            let Some(future) = future.bind(py).upgrade() else {
                return; // nobody awaits it any more
            };
            if let Ok(settle) = aio::settle(py) {
                // A closed loop cannot take the wake-up, and then nobody awaits it.
                let _ = lp.bind(py).call_method1("call_soon_threadsafe", (settle, future, py.None()));
            }
        });
    }))
}
