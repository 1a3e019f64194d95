//! Generation requests: the engine runs produce→commit for a branch each tick its consumer
//! asks for a token, and streams the committed tokens (with stop strings, stop tokens,
//! `max_tokens` and logprobs applied in Rust) to a [`GenStream`].
//!
//! A request is demand-driven: the consumer asks for the next token ([`GenStream::poll`]),
//! the next tick samples it (all asking requests in one pass), commits it in the tick's
//! packed decode, and pushes it. So a consumer that stops asking (breaks out of its loop)
//! leaves the branch exactly at the last token it received. A stream with a lookahead of
//! `k > 1` ([`GenStream::with_lookahead`]) is stepped while fewer than `k` of its tokens wait
//! unread, so the engine decodes the next token while the consumer handles this one (and a
//! consumer that stops leaves the branch up to `k - 1` tokens past the last it read). With
//! [`GenSpec::commit_last`] off, the first token after a prompt is pushed as the prompt is
//! written and committed when the consumer wants the next one (a consumer that stops at it
//! leaves the branch before it), and the last one is never committed.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

/// The most top logprobs a request may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Why a generation request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token or a stop string.
    Stop,
    /// `max_tokens` tokens were generated.
    Length,
    /// The model produced an end-of-generation token.
    Eog,
}

impl Finish {
    /// `"stop"`, `"length"` or `"eog"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Eog => "eog",
        }
    }
}

/// One generated (committed) token.
#[derive(Debug, Clone, PartialEq)]
pub struct GenItem {
    /// Token id.
    pub token: i32,
    /// Text released with this token (UTF-8 safe; text that may begin a stop string is held
    /// back until it cannot, and a matched stop string is never released).
    pub text: String,
    /// `log_softmax(logits)[token]` of the logits it was sampled from, when asked.
    pub logprob: Option<f64>,
    /// The `k` most likely tokens and their logprobs, best first, when asked.
    pub top_logprobs: Option<Vec<(i32, f64)>>,
}

/// What a consumer gets from [`GenStream::poll`].
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// A token.
    Item(GenItem),
    /// The request ended (repeats on every later poll).
    End(std::result::Result<Finish, LloyalError>),
    /// Nothing yet: the next token was asked for; wait and poll again.
    Pending,
}

/// A waker called (once) on the engine thread when an item or the end arrives.
pub type Wake = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct StreamState {
    items: VecDeque<GenItem>,
    end: Option<std::result::Result<Finish, LloyalError>>,
    /// The consumer asked for one more token and the engine has not taken the request yet.
    wanted: bool,
    /// The consumer's request is unanswered (taken or not): asking again adds nothing.
    asked: bool,
    wake: Option<Wake>,
    /// Tokens the engine may generate ahead of the consumer (0 and 1: one per ask).
    lookahead: usize,
    /// The branch's perplexity when the request ended.
    perplexity: Option<f64>,
    /// How many of the yielded tokens the branch holds, when the request ended.
    committed: Option<usize>,
}

impl StreamState {
    /// Whether the engine should step the request: the consumer asked, or the read-ahead
    /// buffer has room.
    fn wants(&self) -> bool {
        self.wanted || (self.lookahead > 1 && self.end.is_none() && self.items.len() < self.lookahead)
    }
}

/// The channel between a generation request in the engine and its consumer.
#[derive(Default)]
pub struct GenStream {
    state: Mutex<StreamState>,
    cv: Condvar,
    /// Events delivered so far (a consumer spins on it before it sleeps).
    delivered: std::sync::atomic::AtomicU64,
}

impl GenStream {
    /// A stream the engine fills up to `lookahead` unread tokens ahead of its consumer
    /// (`lookahead <= 1`: one token per ask, like [`GenStream::default`]).
    pub fn with_lookahead(lookahead: usize) -> Self {
        GenStream {
            state: Mutex::new(StreamState { lookahead, ..StreamState::default() }),
            cv: Condvar::new(),
            delivered: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the engine must be woken after the consumer took an item: the read-ahead
    /// buffer was full (the engine stopped stepping this request) and now has room.
    pub fn needs_refill(&self) -> bool {
        let st = self.lock();
        st.lookahead > 1 && st.end.is_none() && st.items.len() + 1 == st.lookahead
    }

    /// The next item, the end, or `Pending` after asking the engine for one more token
    /// (`wake`, if given, replaces any earlier waker). The caller then notifies the engine.
    pub fn poll(&self, wake: Option<Wake>) -> Next {
        let mut st = self.lock();
        if let Some(item) = st.items.pop_front() {
            return Next::Item(item);
        }
        if let Some(end) = &st.end {
            return Next::End(end.clone());
        }
        if !st.asked {
            st.asked = true;
            st.wanted = true;
        }
        if wake.is_some() {
            st.wake = wake;
        }
        Next::Pending
    }

    /// Events delivered so far: read before [`GenStream::poll`], then [`GenStream::spin`] on it.
    pub fn delivered(&self) -> u64 {
        self.delivered.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Spin up to `budget` for an event after `seen` ([`GenStream::delivered`]) before a wait
    /// sleeps ([`super::spin`]).
    pub fn spin(&self, seen: u64, budget: std::time::Duration) {
        super::spin::until(budget, || self.delivered() != seen);
    }

    /// Block until an item or the end is available (or `timeout` passes).
    pub fn wait_timeout(&self, timeout: Duration) {
        let st = self.lock();
        let _ = self
            .cv
            .wait_timeout_while(st, timeout, |s| s.items.is_empty() && s.end.is_none())
            .unwrap_or_else(|p| p.into_inner());
    }

    /// Whether the request ended.
    pub fn ended(&self) -> bool {
        self.lock().end.is_some()
    }

    /// The branch's model perplexity over everything it committed, as the request ended (a
    /// stop, `max_tokens`, EOG, or an error at a step); `None` before, or when it was
    /// cancelled or its branch is gone. Read without the context's lock.
    pub fn perplexity(&self) -> Option<f64> {
        self.lock().perplexity
    }

    /// Note the branch's perplexity at its end (engine side, before the end is delivered).
    pub(crate) fn set_perplexity(&self, perplexity: f64) {
        self.lock().perplexity = Some(perplexity);
    }

    /// How many of the tokens yielded the branch holds, as the request ended (`None` before,
    /// or when it was dropped without an end from the engine). All of them unless
    /// [`GenSpec::commit_last`] is off: then a token may be yielded before its commit, and the
    /// one that reached `max_tokens` (or a first token that matched a stop string), or one
    /// yielded as the request failed or was cancelled, is not held.
    /// Read without the context's lock.
    pub fn committed(&self) -> Option<usize> {
        self.lock().committed
    }

    /// Note how many yielded tokens the branch holds at the request's end (engine side).
    pub(crate) fn set_committed(&self, committed: usize) {
        self.lock().committed = Some(committed);
    }

    /// Take the consumer's request for a token (engine side).
    pub(crate) fn take_wanted(&self) -> bool {
        let mut st = self.lock();
        let wants = st.wants();
        st.wanted = false;
        wants
    }

    /// Whether the consumer asked for a token or the read-ahead has room (engine side, no change).
    pub(crate) fn is_wanted(&self) -> bool {
        self.lock().wants()
    }

    /// End the stream with `err` unless it already ended.
    pub(crate) fn fail(&self, err: LloyalError) {
        self.deliver(Event::End(Err(err)));
    }

    /// Deliver an event (engine side, outside the context lock: the waker may take the GIL).
    pub(crate) fn deliver(&self, event: Event) {
        let wake = {
            let mut st = self.lock();
            match event {
                Event::Item(item) => {
                    st.items.push_back(item);
                    // answered (an item yielded before its step answers the want it left)
                    st.asked = false;
                    st.wanted = false;
                }
                Event::End(end) => {
                    if st.end.is_none() {
                        st.end = Some(end);
                    }
                }
            }
            st.wake.take()
        };
        self.delivered.fetch_add(1, std::sync::atomic::Ordering::Release);
        self.cv.notify_all();
        if let Some(wake) = wake {
            wake();
        }
    }
}

/// An event for a stream, collected during a tick and delivered after it.
#[derive(Debug)]
pub(crate) enum Event {
    Item(GenItem),
    End(std::result::Result<Finish, LloyalError>),
}

/// What a generation request asks for.
#[derive(Clone)]
pub struct GenSpec {
    /// The branch to generate on.
    pub handle: Handle,
    /// Tokens the engine prefills on the branch first (chunked like any prefill); empty: the
    /// branch's prompt is already written and it has logits.
    pub prompt: Vec<i32>,
    /// Most tokens to generate (`None`: until a stop).
    pub max_tokens: Option<usize>,
    /// Token ids that end generation (not committed, not yielded), besides the model's EOG.
    pub stop_tokens: Vec<i32>,
    /// Strings that end generation when they appear in the text (not released, unless
    /// `include_stop`).
    pub stop: Vec<String>,
    /// Tokens made before the model's end-of-generation tokens and `stop_tokens` may end the
    /// request, which are banned until then, and before stop strings are looked for (vLLM's
    /// `min_tokens`: a stop string that ends before then does not count; one that begins
    /// before and ends after does).
    pub min_tokens: usize,
    /// Release a matched stop string, ending the text (vLLM's `include_stop_str_in_output`).
    pub include_stop: bool,
    /// Whether each item carries its logprob.
    pub logprobs: bool,
    /// How many top logprobs each item carries (0: none).
    pub top_logprobs: usize,
    /// How long the request may wait in the queue for room in the cache (`None`: no limit).
    pub timeout: Option<Duration>,
    /// Reserve `max_tokens` cells when admitted (`false`: take one cell per step, like an
    /// unbounded request, and end with `KvCacheFull` when a step finds none free).
    pub reserve: bool,
    /// When the request arrived, if it waited before the engine got it (in a server's queue):
    /// its prompt is paced as that old, so it goes first past streams that started after it
    /// (`None`: when its prompt starts).
    pub arrived: Option<Instant>,
    /// Commit the token that reaches `max_tokens` (`false`: it is yielded as soon as it is
    /// sampled and never decoded, saving a decode per request whose branch goes on only as a
    /// cached prefix; the branch ends one token short of what was yielded). Off, the first
    /// token after a prompt is also yielded as the prompt's tick ends, a tick before its commit
    /// ([`GenStream::committed`] then says how many yielded tokens the branch holds).
    pub commit_last: bool,
    /// Where the tokens go.
    pub stream: Arc<GenStream>,
}

impl std::fmt::Debug for GenSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenSpec")
            .field("handle", &self.handle)
            .field("prompt", &self.prompt.len())
            .field("max_tokens", &self.max_tokens)
            .field("stop_tokens", &self.stop_tokens)
            .field("stop", &self.stop)
            .field("min_tokens", &self.min_tokens)
            .field("include_stop", &self.include_stop)
            .field("logprobs", &self.logprobs)
            .field("top_logprobs", &self.top_logprobs)
            .field("timeout", &self.timeout)
            .field("reserve", &self.reserve)
            .field("commit_last", &self.commit_last)
            .field("arrived", &self.arrived)
            .finish()
    }
}

impl PartialEq for GenSpec {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.stream, &other.stream)
    }
}

impl GenSpec {
    /// Cells the request needs free to be admitted: `max_tokens` when it reserves them, else
    /// one (it then takes one per step).
    pub fn cells(&self) -> usize {
        self.reservation(0).max(1)
    }

    /// Cells the request holds back from others while it runs (`max_tokens` less what it
    /// generated; 0 when it does not reserve).
    pub fn reservation(&self, generated: usize) -> usize {
        match self.max_tokens {
            Some(m) if self.reserve => m.saturating_sub(generated),
            _ => 0,
        }
    }

    /// Check the arguments a caller can get wrong (before queuing).
    pub fn validate(&self, model: &crate::model::Model) -> Result<()> {
        model.check_tokens(&self.stop_tokens)?;
        model.check_tokens(&self.prompt)?;
        if self.stop.iter().any(String::is_empty) {
            return Err(LloyalError::invalid("a stop string is empty; give non-empty strings"));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(LloyalError::invalid(format!(
                "top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {}",
                self.top_logprobs
            )));
        }
        Ok(())
    }
}

/// Stop-string matching over streamed text: releases text that cannot begin a stop string,
/// holds back a tail that might, and reports a match (whose text is released only when the
/// matcher includes stop strings).
#[derive(Debug, Default, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    include: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (non-empty strings); `include`: a matched stop string ends the
    /// released text.
    pub fn new(stops: Vec<String>, include: bool) -> Self {
        StopMatcher { stops, held: String::new(), include }
    }

    /// Add `text`; returns the text now safe to release and whether a stop string matched
    /// (then the returned text is everything before the match, and the match too when the
    /// matcher includes it: the earliest, the first of the stops given at one place; the rest
    /// is dropped). A match reaches into `text`: one wholly inside text held before (by
    /// [`StopMatcher::hold`]) does not count.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        let before = self.held.len();
        self.held.push_str(text);
        let held = &self.held;
        let first = self
            .stops
            .iter()
            .filter_map(|s| {
                let from = char_floor(held, (before + 1).saturating_sub(s.len()));
                Some((from + held[from..].find(s.as_str())?, s.len()))
            })
            .min_by_key(|m| m.0);
        if let Some((at, len)) = first {
            let out = self.held[..at + if self.include { len } else { 0 }].to_string();
            self.held.clear();
            return (out, true);
        }
        (self.release_unmatchable(), false)
    }

    /// Add `text` without looking for stop strings in it (text before a request's
    /// `min_tokens`): returns what cannot begin a stop string and holds the rest, so a stop
    /// string that begins here and ends in a later [`StopMatcher::push`] still matches (as
    /// vLLM's, which looks back over the stop string's length once `min_tokens` is reached).
    pub fn hold(&mut self, text: &str) -> String {
        self.held.push_str(text);
        self.release_unmatchable()
    }

    /// Release the held text up to its longest suffix that is a proper prefix of some stop
    /// string (all of it when there are none).
    fn release_unmatchable(&mut self) -> String {
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        out
    }

    /// Release whatever is held (the request ended for another reason).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether text that may begin a stop string is held back.
    pub fn holds(&self) -> bool {
        !self.held.is_empty()
    }
}

/// The largest char boundary of `s` at or below `i`.
fn char_floor(s: &str, i: usize) -> usize {
    (0..=i.min(s.len())).rev().find(|&j| s.is_char_boundary(j)).unwrap_or(0)
}

/// `log_softmax(logits)[token]` and, if `k > 0`, the `k` best `(token, logprob)` pairs (ties:
/// the lower id first; NaN never), where `lse` is `log_sum_exp(logits)` (a snapshot's
/// [`crate::metrics::RowStats`]) and `maxima` the row's span maxima when known (a snapshot's:
/// the best `k` are then found from the spans that reach them, not a pass over the row; empty:
/// computed when the row is large, [`crate::sampler::top_candidates_in`]).
pub fn logprobs(logits: &[f32], maxima: &[f32], lse: f64, token: i32, k: usize) -> (f64, Vec<(i32, f64)>) {
    let lp = |l: f32| f64::from(l) - lse;
    let top = if k > 0 { crate::sampler::top_candidates_in(logits, maxima, &[], k) } else { Vec::new() };
    let own = logits.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
    (lp(own), top.into_iter().map(|(t, l)| (t, lp(l))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::log_sum_exp;

    #[test]
    fn stop_strings_match_across_pushes_and_are_not_released() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "END".into()], false);
        assert_eq!(m.push("Hello"), ("Hello".into(), false));
        assert_eq!(m.push(" wor\n"), (" wor".into(), false));
        assert_eq!(m.push("x E"), ("\nx ".into(), false));
        assert_eq!(m.push("N"), ("".into(), false));
        assert_eq!(m.push("Dtail"), ("".into(), true));
        let mut m = StopMatcher::new(vec!["ab".into()], false);
        assert_eq!(m.push("xa"), ("x".into(), false));
        assert_eq!(m.flush(), "a");
        let mut m = StopMatcher::new(vec!["bc".into(), "abcd".into()], false);
        assert_eq!(m.push("zab"), ("z".into(), false));
        assert_eq!(m.push("c"), ("a".into(), true), "the earliest match wins");
        let mut m = StopMatcher::new(Vec::new(), false);
        assert_eq!(m.push("any"), ("any".into(), false));
    }

    #[test]
    fn an_including_matcher_releases_the_stop_string_and_nothing_after() {
        let mut m = StopMatcher::new(vec!["bc".into(), "abcd".into()], true);
        assert_eq!(m.push("zab"), ("z".into(), false));
        assert_eq!(m.push("ctail"), ("abc".into(), true), "the earliest match, to its end");
        let mut m = StopMatcher::new(vec!["END".into(), "E".into()], true);
        assert_eq!(m.push("xENDy"), ("xEND".into(), true), "at one place, the first stop given");
    }

    #[test]
    fn text_held_before_min_tokens_matches_a_stop_string_that_ends_after_it() {
        let mut m = StopMatcher::new(vec!["END".into()], false);
        assert_eq!(m.hold("aEND bE"), "aEND b", "not looked at; a possible beginning kept");
        assert!(m.holds());
        assert_eq!(m.push("ND z"), (String::new(), true), "begun before, ended after");
        let mut m = StopMatcher::new(vec!["END".into()], true);
        assert_eq!(m.hold("éE"), "é");
        assert_eq!(m.push("NDx"), ("END".into(), true));
        let mut m = StopMatcher::new(vec!["ab".into(), "xabc".into()], false);
        assert_eq!(m.hold("xab"), "", "held: it may begin xabc");
        assert_eq!(m.push("d"), ("xabd".into(), false), "ab ended in held text: not a match");
        assert!(!m.holds());
        let mut m = StopMatcher::new(Vec::new(), false);
        assert_eq!(m.hold("any"), "any");
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_sorted_top_k() {
        let logits = [1.0f32, 3.0, 2.0, f32::NEG_INFINITY];
        let (lp, top) = logprobs(&logits, &[], log_sum_exp(&logits), 2, 3);
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        assert!((lp - (2.0 - z.ln())).abs() < 1e-6, "f32 exponentials");
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        assert!((top[0].1 - (3.0 - z.ln())).abs() < 1e-6);
        assert_eq!(logprobs(&logits, &[], log_sum_exp(&logits), 3, 0), (f64::NEG_INFINITY, vec![]));
    }

    #[test]
    fn a_stream_asks_then_delivers_then_ends() {
        let s = GenStream::default();
        assert_eq!(s.poll(None), Next::Pending);
        assert!(s.take_wanted() && !s.take_wanted());
        assert_eq!(s.poll(None), Next::Pending);
        assert!(!s.take_wanted(), "asking again before the answer adds no token");
        let item = GenItem { token: 5, text: "a".into(), logprob: None, top_logprobs: None };
        s.deliver(Event::Item(item.clone()));
        s.deliver(Event::End(Ok(Finish::Length)));
        s.deliver(Event::End(Ok(Finish::Eog)));
        assert_eq!(s.poll(None), Next::Item(item));
        assert_eq!(s.poll(None), Next::End(Ok(Finish::Length)));
        assert_eq!(s.poll(None), Next::End(Ok(Finish::Length)), "the first end stays");
        assert!(!s.is_wanted());
    }

    #[test]
    fn a_lookahead_stream_is_stepped_until_its_buffer_is_full() {
        let s = GenStream::with_lookahead(2);
        let item = |t| GenItem { token: t, text: String::new(), logprob: None, top_logprobs: None };
        assert!(s.is_wanted() && s.take_wanted() && s.take_wanted(), "room ahead: wanted unasked");
        s.deliver(Event::Item(item(1)));
        assert!(s.take_wanted(), "one unread of two");
        s.deliver(Event::Item(item(2)));
        assert!(!s.is_wanted() && !s.take_wanted(), "full: the engine waits for the consumer");
        assert_eq!(s.poll(None), Next::Item(item(1)));
        assert!(s.needs_refill() && s.is_wanted(), "the first read makes room: wake the engine");
        s.deliver(Event::Item(item(3)));
        assert_eq!(s.poll(None), Next::Item(item(2)));
        assert_eq!(s.poll(None), Next::Item(item(3)));
        assert!(!s.needs_refill(), "only the read that makes room asks for a wake-up");
        s.deliver(Event::End(Ok(Finish::Stop)));
        assert!(!s.is_wanted(), "an ended stream is never stepped");
        let one = GenStream::with_lookahead(1);
        assert!(!one.is_wanted() && !one.needs_refill(), "lookahead 1: only when asked");
    }

    #[test]
    fn a_spec_without_reservation_needs_one_cell_and_holds_none() {
        let spec = |max_tokens, reserve| GenSpec {
            handle: 1,
            prompt: Vec::new(),
            max_tokens,
            stop_tokens: Vec::new(),
            stop: Vec::new(),
            min_tokens: 0,
            include_stop: false,
            logprobs: false,
            top_logprobs: 0,
            timeout: None,
            reserve,
            arrived: None,
            commit_last: true,
            stream: Arc::new(GenStream::default()),
        };
        assert_eq!((spec(Some(8), true).cells(), spec(Some(8), true).reservation(3)), (8, 5));
        assert_eq!((spec(Some(8), false).cells(), spec(Some(8), false).reservation(3)), (1, 0));
        assert_eq!((spec(None, true).cells(), spec(None, true).reservation(3)), (1, 0));
    }
}
