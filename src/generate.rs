//! `Branch.generate()` and ``for tok in branch``: the token iterator over a generation
//! request the engine runs in Rust, and the `Token` it yields.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lloyal_core::engine::gen::{Finish, GenItem, GenSpec, GenStream, Next};
use lloyal_core::{Context, Handle, Ticket};
use pyo3::prelude::*;

use crate::aio;
use crate::context::to_i32;
use crate::convert::Tokens;
use crate::detach::on_main_thread;
use crate::error::IntoPyResult;
use crate::waker::wake_for;

/// A generated (committed) token with its UTF-8-safe text.
#[pyclass(name = "Token", module = "lloyal._lloyal", frozen, get_all, eq)]
#[derive(Clone, PartialEq)]
pub struct PyToken {
    /// Token id.
    pub token: i32,
    /// The text it completes (UTF-8 safe: may be empty mid-character or while it may begin
    /// a stop string; a matched stop string is included only with
    /// ``generate(include_stop_str=True)``).
    pub text: String,
    /// ``log_softmax(logits)[token]`` of the logits it was sampled from (``Branch.logits``),
    /// when ``generate(logprobs=True)``; else None.
    pub logprob: Option<f64>,
    /// The ``top_logprobs`` most likely ``(token, logprob)`` pairs, best first, when asked;
    /// else None.
    pub top_logprobs: Option<Vec<(i32, f64)>>,
}

#[pymethods]
impl PyToken {
    fn __repr__(&self) -> String {
        match self.logprob {
            Some(lp) => format!("Token(token={}, text={:?}, logprob={lp:.4})", self.token, self.text),
            None => format!("Token(token={}, text={:?})", self.token, self.text),
        }
    }
}

/// Iterator behind ``for tok in branch``, ``branch.generate()`` and ``async for``: a
/// generation request the engine runs in Rust (sampling, stops, logprobs), one token each
/// time the iterator is asked for one.
#[pyclass(name = "TokenIterator", module = "lloyal._lloyal", frozen)]
pub struct PyTokenIter {
    core: Arc<Context>,
    handle: Handle,
    args: GenArgs,
    state: Mutex<IterState>,
}

/// What `generate()` was called with.
#[derive(Clone)]
pub(crate) struct GenArgs {
    max_tokens: Option<usize>,
    prompt: Vec<i32>,
    stop: Vec<String>,
    stop_tokens: Vec<i32>,
    min_tokens: usize,
    include_stop: bool,
    logprobs: bool,
    top_logprobs: usize,
    timeout: Option<Duration>,
    lookahead: usize,
    reserve: bool,
    arrived: Option<Instant>,
    commit_last: bool,
}

impl Default for GenArgs {
    fn default() -> Self {
        GenArgs {
            max_tokens: None,
            prompt: Vec::new(),
            stop: Vec::new(),
            stop_tokens: Vec::new(),
            min_tokens: 0,
            include_stop: false,
            logprobs: false,
            top_logprobs: 0,
            timeout: None,
            lookahead: 1,
            reserve: true,
            arrived: None,
            commit_last: true,
        }
    }
}

#[derive(Default)]
struct IterState {
    stream: Option<Arc<GenStream>>,
    ticket: Option<Ticket>,
    finish: Option<&'static str>,
    done: bool,
}

impl PyTokenIter {
    pub(crate) fn new(core: &Arc<Context>, handle: Handle, args: GenArgs) -> Self {
        PyTokenIter { core: Arc::clone(core), handle, args, state: Mutex::new(IterState::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, IterState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The request's stream (queued on first use), or `None` once the iterator is done.
    fn stream(&self) -> PyResult<Option<Arc<GenStream>>> {
        let mut st = self.lock();
        if st.done {
            return Ok(None);
        }
        if let Some(s) = &st.stream {
            return Ok(Some(Arc::clone(s)));
        }
        if self.args.max_tokens == Some(0) && self.args.prompt.is_empty() {
            st.done = true;
            st.finish = Some(Finish::Length.as_str());
            return Ok(None);
        }
        let a = &self.args;
        let stream = Arc::new(GenStream::with_lookahead(a.lookahead));
        let spec = GenSpec {
            handle: self.handle,
            prompt: a.prompt.clone(),
            max_tokens: a.max_tokens,
            stop_tokens: a.stop_tokens.clone(),
            stop: a.stop.clone(),
            min_tokens: a.min_tokens,
            include_stop: a.include_stop,
            logprobs: a.logprobs,
            top_logprobs: a.top_logprobs,
            timeout: a.timeout,
            reserve: a.reserve,
            arrived: a.arrived,
            commit_last: a.commit_last,
            stream: Arc::clone(&stream),
        };
        let ticket = self.core.generate(spec).py();
        let ticket = match ticket {
            Ok(t) => t,
            Err(e) => {
                st.done = true;
                return Err(e);
            }
        };
        st.ticket = Some(ticket);
        st.stream = Some(Arc::clone(&stream));
        Ok(Some(stream))
    }

    /// Record the end: `None` (stop iterating) or the request's error.
    fn end(&self, end: std::result::Result<Finish, lloyal_core::LloyalError>) -> PyResult<Option<PyToken>> {
        let mut st = self.lock();
        st.done = true;
        st.ticket = None;
        match end {
            Ok(f) => {
                st.finish = Some(f.as_str());
                Ok(None)
            }
            // Closed by the caller.
            Err(lloyal_core::LloyalError::Interrupted) => Ok(None),
            Err(e) => Err(e).py(),
        }
    }

    /// The token for a read `item`, waking the engine if the read made room in a full
    /// read-ahead buffer.
    fn taken(&self, stream: &GenStream, item: GenItem) -> PyToken {
        if stream.needs_refill() {
            self.core.notify_engine();
        }
        py_token(item)
    }

    fn cancel(&self) {
        let mut st = self.lock();
        st.done = true;
        if let Some(t) = st.ticket.take() {
            t.cancel();
        }
    }
}

impl Drop for PyTokenIter {
    fn drop(&mut self) {
        self.cancel();
    }
}

fn py_token(item: GenItem) -> PyToken {
    PyToken { token: item.token, text: item.text, logprob: item.logprob, top_logprobs: item.top_logprobs }
}

#[pymethods]
impl PyTokenIter {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyToken>> {
        let Some(stream) = self.stream()? else { return Ok(None) };
        let main = on_main_thread(py);
        loop {
            let seen = stream.delivered();
            match stream.poll(None) {
                Next::Item(item) => return Ok(Some(self.taken(&stream, item))),
                Next::End(end) => return self.end(end),
                Next::Pending => {}
            }
            self.core.notify_engine();
            // One GIL release a wait: the spin (none without a spare core) then the sleep.
            let spin = self.core.engine_spin();
            let wait = |timeout| {
                stream.spin(seen, spin);
                stream.wait_timeout(timeout)
            };
            if !main {
                py.detach(|| wait(Duration::from_secs(3600)));
                continue;
            }
            // On the main thread, wake every 50 ms for signal handlers: Ctrl-C frees the
            // request (the branch stays at its last committed token) and raises.
            py.detach(|| wait(Duration::from_millis(50)));
            if let Err(e) = py.check_signals() {
                self.cancel();
                self.core.notify_engine();
                py.detach(|| {
                    while !stream.ended() {
                        stream.wait_timeout(Duration::from_secs(1));
                    }
                });
                return Err(e);
            }
        }
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        aio::Coroutine::StreamNext.call(slf.py(), slf.clone().into_any(), Vec::new())
    }

    /// The next token now, or None after arranging for ``future`` to be settled when one
    /// arrives, through ``waker`` (the running loop's ``LoopWaker``, or the loop itself:
    /// ``call_soon_threadsafe``); raises ``StopAsyncIteration`` at the end.
    fn _poll(
        &self,
        py: Python<'_>,
        waker: Bound<'_, PyAny>,
        fut: Bound<'_, PyAny>,
    ) -> PyResult<Option<PyToken>> {
        let Some(stream) = self.stream()? else {
            return Err(pyo3::exceptions::PyStopAsyncIteration::new_err(()));
        };
        let wake = wake_for(waker, &fut)?;
        match stream.poll(Some(wake)) {
            Next::Item(item) => Ok(Some(self.taken(&stream, item))),
            Next::End(end) => match self.end(end)? {
                Some(t) => Ok(Some(t)),
                None => Err(pyo3::exceptions::PyStopAsyncIteration::new_err(())),
            },
            Next::Pending => {
                let _ = py;
                self.core.notify_engine();
                Ok(None)
            }
        }
    }

    /// Stop generating: the request is freed at the engine's next tick and the branch stays
    /// at the last token yielded. Idempotent; ``break`` and dropping the iterator do the same.
    /// (A task cancelled while it awaits a token can leave the branch one token past: the
    /// engine may have committed the token it asked for; ``lookahead=k`` up to ``k``.)
    fn close(&self) {
        self.cancel();
    }

    /// Why generation ended: ``"stop"`` (a stop token or stop string), ``"length"``
    /// (``max_tokens``) or ``"eog"`` (the model's end-of-generation token); None while
    /// running or after ``close()``.
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.lock().finish
    }

    /// The branch's perplexity (as :attr:`Branch.perplexity`) when its generation request ended
    /// (with a :attr:`finish_reason`, or with an error such as ``KvCacheFullError``), read without
    /// waiting for the engine; None while running or when closed before its end.
    #[getter]
    fn perplexity(&self) -> Option<f64> {
        let st = self.lock();
        st.stream.as_ref().filter(|_| st.done)?.perplexity()
    }

    /// How many of the yielded tokens the branch holds when its generation request ended: all
    /// of them, unless ``commit_last=False`` (then a token may be yielded before its decode,
    /// and the one that reaches ``max_tokens`` is never decoded); None while running or when
    /// closed before its end.
    #[getter]
    fn committed(&self) -> Option<usize> {
        let st = self.lock();
        st.stream.as_ref().filter(|_| st.done)?.committed()
    }
}

impl GenArgs {
    /// `Branch.generate()`'s arguments, checked.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn parse(
        model: &lloyal_core::Model,
        max_tokens: Option<usize>,
        prompt: Option<Tokens>,
        stop: Option<Vec<String>>,
        stop_tokens: Option<Tokens>,
        (min_tokens, include_stop): (usize, bool),
        logprobs: bool,
        top_logprobs: usize,
        timeout: Option<f64>,
        lookahead: usize,
        reserve: bool,
        waited: f64,
        commit_last: bool,
    ) -> PyResult<Self> {
        if lookahead == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "lookahead must be at least 1 (1: generate each token when it is asked for)",
            ));
        }
        let prompt = to_i32(model, &prompt.unwrap_or_default())?;
        let stop_tokens = stop_tokens.unwrap_or_default();
        let stop_tokens: Vec<i32> =
            stop_tokens.iter().map(|&t| model.check_token(t)).collect::<lloyal_core::Result<_>>().py()?;
        let timeout = match timeout {
            Some(t) if t.is_nan() || t < 0.0 => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout must be a number of seconds >= 0 or None, got {t}"
                )))
            }
            // a wait longer than any clock can count (inf, 1e300) is no limit
            t => t.and_then(|t| Duration::try_from_secs_f64(t).ok()),
        };
        if !(waited >= 0.0 && waited.is_finite()) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "waited must be a finite number of seconds >= 0, got {waited}"
            )));
        }
        let arrived = Duration::try_from_secs_f64(waited)
            .ok()
            .filter(|w| !w.is_zero())
            .and_then(|w| Instant::now().checked_sub(w));
        Ok(GenArgs {
            max_tokens,
            prompt,
            stop: stop.unwrap_or_default(),
            stop_tokens,
            min_tokens,
            include_stop,
            logprobs,
            top_logprobs,
            timeout,
            lookahead,
            reserve,
            arrived,
            commit_last,
        })
    }
}
