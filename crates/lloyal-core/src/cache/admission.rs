//! Admission of generation requests (a server's, Ray Data's): each request runs `best_of`
//! choices of one prompt, and [`Admission`] decides when it may start and from what.
//!
//! A request starts when a slot is free (at most `max_running` choices run) and, for its prompt,
//! forks the longest cached prefix ([`PrefixIndex::lookup`]) or, when a running request is still
//! writing a prompt that shares more, that prompt once it is written: a burst of requests with a
//! new system prompt prefills it once. The leases and cells a request needs are reserved from
//! its admission until its branches exist, so two admissions never count the same free room.
//!
//! The caller awaits the room a [`Plan`] names (the engine evicts for it) and makes the
//! branches; this is the bookkeeping, under the caller's lock and the prefix index's.

use std::collections::HashMap;

use super::radix::RadixTree;
use super::stow::Stowed;
use super::{reusable, PrefixIndex, MIN_SHARED};
use crate::error::{LloyalError, Result};
use crate::tenancy::Handle;

/// Choices, leases and KV cells.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Need {
    pub choices: usize,
    pub leases: usize,
    pub cells: usize,
}

impl Need {
    fn plus(self, o: Need) -> Need {
        Need {
            choices: self.choices + o.choices,
            leases: self.leases + o.leases,
            cells: self.cells + o.cells,
        }
    }

    fn minus(self, o: Need) -> Need {
        Need {
            choices: self.choices.saturating_sub(o.choices),
            leases: self.leases.saturating_sub(o.leases),
            cells: self.cells.saturating_sub(o.cells),
        }
    }
}

/// Where a request's first branch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// A new branch at position 0.
    New,
    /// A fork of `handle`: whole, with its logits, when `at` is `None`; else its first `at`
    /// positions (the rest of the prompt is prefilled).
    Fork { handle: Handle, at: Option<usize> },
    /// A fork, as `Fork`, of an evicted entry the host tier kept, once written back into the
    /// context ([`Admission::take_restore`]).
    Restore { at: Option<usize> },
}

/// The terms a request is admitted on ([`Admission::plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub id: u64,
    pub best_of: usize,
    pub start: Start,
    /// Prompt tokens reused (from the cache, or from a prompt in flight).
    pub reused: usize,
    /// The prompt is exactly a cached entry, forked whole: nothing to prefill.
    pub exact: bool,
    /// The room to await before starting: what this request needs (`need`) and what
    /// admissions before it reserved.
    pub room: Need,
    /// What this request needs: a lease per branch (`best_of` choices, and a root that holds
    /// the prompt unless it is `exact`, when `best_of > 1`) and the prompt's new cells plus one.
    pub need: Need,
}

/// A prompt a running request writes, which others may fork before it is cached.
#[derive(Debug)]
struct Writing {
    /// Its first tokens, forked from the cache or from `parent`.
    base: usize,
    /// The prompt in flight it forked, if any.
    parent: Option<Vec<i32>>,
    /// The branch holding it (the request's one choice, or its `best_of` root), once made.
    handle: Option<Handle>,
    /// Its tokens are in the branch's KV.
    ready: bool,
}

/// What a plan holds until it is released.
#[derive(Debug)]
struct Held {
    prompt: Vec<i32>,
    need: Need,
    /// The in-flight prompt it forks (`Writing`'s key), if any.
    source: Option<Vec<i32>>,
    reused: usize,
    exact: bool,
    /// The branch it forks, pinned until admitted or released.
    pin: Option<Handle>,
    reserved: bool,
    /// It registered its prompt as in flight.
    writes: bool,
    running: bool,
    /// It forks nothing: counted by [`PrefixIndex::expect_tip`] until released.
    new_tip: bool,
    /// The host tier's copy it writes back (`Start::Restore`) until taken: its tokens and
    /// size in bytes.
    restore: Option<(Vec<i32>, Stowed, usize)>,
}

/// Where a request reusing `used` of an entry's `len` tokens forks it (`None`: whole, with its
/// logits), and whether its prompt of `prompt_len` tokens is exactly the entry.
fn fork_terms(used: usize, len: usize, prompt_len: usize) -> (Option<usize>, bool) {
    let whole = used == len;
    (if whole { None } else { Some(used) }, whole && len == prompt_len)
}

fn held(plans: &mut HashMap<u64, Held>, plan: u64) -> Result<&mut Held> {
    plans
        .get_mut(&plan)
        .ok_or_else(|| LloyalError::invalid(format!("admission plan {plan} was released already")))
}

/// The admission bookkeeping of one scheduler (see the module).
#[derive(Debug)]
pub struct Admission {
    max_running: usize,
    running: usize,
    reserved: Need,
    /// Prompts being written, by their tokens.
    writing: RadixTree<Vec<i32>>,
    flights: HashMap<Vec<i32>, Writing>,
    plans: HashMap<u64, Held>,
    next: u64,
}

impl Admission {
    /// Bookkeeping for at most `max_running` running choices.
    pub fn new(max_running: usize) -> Self {
        Admission {
            max_running: max_running.max(1),
            running: 0,
            reserved: Need::default(),
            writing: RadixTree::default(),
            flights: HashMap::new(),
            plans: HashMap::new(),
            next: 0,
        }
    }

    /// The most choices running at once.
    pub fn max_running(&self) -> usize {
        self.max_running
    }

    /// Choices running now (admitted, not yet released).
    pub fn running(&self) -> usize {
        self.running
    }

    /// What requests being admitted have reserved.
    pub fn reserved(&self) -> Need {
        self.reserved
    }

    /// Refuse a request of `best_of` choices that can never run on a context of `n_seq_max`
    /// sequences here (each choice a branch, and one more for the root).
    pub fn check(&self, best_of: usize, n_seq_max: usize) -> Result<()> {
        if best_of == 0 {
            return Err(LloyalError::invalid("best_of/n must be at least 1"));
        }
        if best_of > self.max_running {
            return Err(LloyalError::invalid(format!(
                "best_of/n = {best_of} choices, but at most {} decode at once here: lower n/best_of, \
                 or run more at once (the server's --parallel)",
                self.max_running
            )));
        }
        if best_of + 1 > n_seq_max {
            return Err(LloyalError::invalid(format!(
                "best_of/n = {best_of} needs {} sequences (a root and its choices) but the context \
                 has {n_seq_max}: lower n/best_of, or make the context with more (n_seq_max)",
                best_of + 1
            )));
        }
        Ok(())
    }

    fn has_slots(&self, best_of: usize) -> bool {
        self.running + self.reserved.choices + best_of <= self.max_running
    }

    /// Whether a request of `best_of` choices would queue: behind `waiting` others, or for a slot.
    pub fn must_wait(&self, best_of: usize, waiting: usize) -> bool {
        waiting > 0 || !self.has_slots(best_of)
    }

    /// The terms on which a request for `prompt` with `best_of` choices starts now, what it
    /// forks pinned in `index`; `None` when it must wait: no slot is free, or a prompt in
    /// flight it would fork is not written yet. Hold the plan until [`Admission::release`].
    pub fn plan(&mut self, index: &mut PrefixIndex, prompt: &[i32], best_of: usize) -> Option<Plan> {
        self.plan_shared(index, prompt, best_of, true)
    }

    /// [`Admission::plan`]; with `share` false the request forks nothing (it writes its whole
    /// prompt: a prompt scored token by token, say).
    pub fn plan_shared(
        &mut self,
        index: &mut PrefixIndex,
        prompt: &[i32],
        best_of: usize,
        share: bool,
    ) -> Option<Plan> {
        if !self.has_slots(best_of) {
            return None;
        }
        let entry = if share { index.lookup(prompt) } else { None };
        let hit = entry.map_or(0, |f| f.used);
        // (a fork is made only where it continues exactly: state::window)
        let exact_at = |index: &PrefixIndex, handle: Option<Handle>, at: usize| {
            handle.is_none_or(|h| at >= index.exact_from(h))
        };
        let shared = if share { self.in_flight(prompt, hit) } else { None }
            .filter(|(key, at)| exact_at(index, self.flights[key].handle, *at));
        // an evicted entry's copy that serves more than the live entries (and no prompt in flight
        // shares more), taken out of the host tier for this request to write back
        let copy = if share && shared.is_none() { index.host.lookup(prompt, hit) } else { None }
            .filter(|c| c.used == c.len || index.host.get(c.key).is_some_and(|s| c.used >= s.exact_from()));
        let restore = copy.and_then(|c| {
            index.host.take(c.key).map(|(tokens, value, bytes)| (c.used, tokens, value, bytes))
        });
        if shared.is_some() || restore.is_some() {
            if let Some(f) = entry {
                index.unpin(f.handle); // not the live entry after all
            }
        }
        let (start, reused, exact, source) = match (shared, &restore) {
            (Some((key, shared)), _) => {
                let w = &self.flights[&key];
                let handle = w.handle.filter(|_| w.ready)?; // forked once written
                index.pin(handle);
                (Start::Fork { handle, at: Some(shared) }, shared, false, Some(key))
            }
            (None, Some((used, tokens, _, _))) => {
                let (at, exact) = fork_terms(*used, tokens.len(), prompt.len());
                (Start::Restore { at }, *used, exact, None)
            }
            (None, None) => match entry {
                Some(f) => {
                    let (at, exact) = fork_terms(f.used, f.len, prompt.len());
                    (Start::Fork { handle: f.handle, at }, f.used, exact, None)
                }
                None => (Start::New, 0, false, None),
            },
        };
        let leases = if best_of == 1 { 1 } else { best_of + usize::from(!exact) };
        let mut need = Need { choices: best_of, leases, cells: prompt.len() - reused + 1 };
        if let Some((_, _, copy, _)) = &restore {
            // the copy written back is an entry of its own: a lease and its cells more
            need.leases += 1;
            need.cells += copy.cells();
        }
        let pin = match start {
            Start::Fork { handle, .. } => Some(handle),
            Start::New | Start::Restore { .. } => None,
        };
        self.next += 1;
        let id = self.next;
        let held = Held {
            prompt: prompt.to_vec(),
            need,
            source,
            reused,
            exact,
            pin,
            reserved: false,
            writes: false,
            running: false,
            new_tip: start == Start::New,
            restore: restore.map(|(_, tokens, value, bytes)| (tokens, value, bytes)),
        };
        if held.new_tip {
            index.expect_tip();
        }
        self.plans.insert(id, held);
        Some(Plan { id, best_of, start, reused, exact, room: need.plus(self.reserved), need })
    }

    /// The prompt in flight a request for `prompt` forks, and how many of its tokens (one at
    /// least is left to prefill: the fork has no logits): one sharing more than the cache's
    /// `hit` tokens. A prompt not written yet that adds fewer than [`MIN_SHARED`] tokens to what
    /// it forked itself (a burst's questions that begin alike) gives way to what it forked.
    fn in_flight(&self, prompt: &[i32], hit: usize) -> Option<(Vec<i32>, usize)> {
        let (shared, key) = reusable(&self.writing, prompt)?;
        let mut shared = shared.min(prompt.len().saturating_sub(1));
        let mut key = key.clone();
        loop {
            let w = &self.flights[&key];
            let parent = w.parent.as_ref().filter(|p| self.flights.contains_key(*p));
            match parent {
                Some(p) if !w.ready && shared - w.base.min(shared) < MIN_SHARED => {
                    shared = shared.min(w.base);
                    key = p.clone();
                }
                _ => break,
            }
        }
        let least = if self.flights[&key].ready { 1 } else { MIN_SHARED };
        (shared >= hit + least).then_some((key, shared))
    }

    /// The room was found: reserve the plan's need, and register its prompt as in flight
    /// (unless it is exactly a cached entry, or another request writes the same prompt):
    /// requests arriving meanwhile fork it once written ([`Admission::written`]) rather than
    /// write it again.
    pub fn reserve(&mut self, plan: u64) -> Result<()> {
        let held = held(&mut self.plans, plan)?;
        if held.reserved {
            return Ok(());
        }
        held.reserved = true;
        let need = held.need;
        let writes = !held.exact && !self.flights.contains_key(&held.prompt);
        held.writes = writes;
        let (key, base, parent) = (held.prompt.clone(), held.reused, held.source.clone());
        self.reserved = self.reserved.plus(need);
        if writes {
            self.writing.insert(&key, key.clone());
            self.flights.insert(key, Writing { base, parent, handle: None, ready: false });
        }
        Ok(())
    }

    /// `handle` is the branch that will hold the plan's prompt (its one choice, or its root).
    pub fn holds(&mut self, plan: u64, handle: Handle) -> Result<()> {
        let held = held(&mut self.plans, plan)?;
        if held.writes {
            if let Some(w) = self.flights.get_mut(&held.prompt) {
                w.handle = Some(handle);
            }
        }
        Ok(())
    }

    /// The host tier's copy a `Start::Restore` plan writes back, with the tokens it holds and
    /// its bytes, taken once (the caller writes it back: [`crate::ContextState::cache_restore`],
    /// then [`Admission::restored`], or [`Admission::restore_failed`]).
    pub fn take_restore(&mut self, plan: u64) -> Result<(Vec<i32>, Stowed, usize)> {
        let held = held(&mut self.plans, plan)?;
        held.restore.take().ok_or_else(|| {
            LloyalError::invalid(format!("admission plan {plan} writes back no cached copy, or did already"))
        })
    }

    /// The plan's copy could not be written back (no lease or room for it then): the plan holds
    /// it again (a release puts it back in the host tier, where a later plan finds it), or, the
    /// plan released meanwhile, the host tier does.
    pub fn restore_failed(&mut self, index: &mut PrefixIndex, plan: u64, taken: (Vec<i32>, Stowed, usize)) {
        match self.plans.get_mut(&plan) {
            Some(held) if held.restore.is_none() => held.restore = Some(taken),
            _ => index.host.put_back(&taken.0, taken.1, taken.2),
        }
    }

    /// The plan's copy was written back as entry `handle`: pinned until the plan is admitted or
    /// released (an entry of the cache like any other if the plan was released meanwhile).
    pub fn restored(&mut self, index: &mut PrefixIndex, plan: u64, handle: Handle) {
        let Some(held) = self.plans.get_mut(&plan) else { return };
        index.pin(handle);
        index.host.restored(held.reused);
        held.pin = Some(handle);
    }

    /// The plan's prompt is in its branch's KV: requests waiting to fork it may go on. Whether
    /// it was news (wake the waiters).
    pub fn written(&mut self, plan: u64) -> bool {
        let Some(held) = self.plans.get(&plan).filter(|h| h.writes) else { return false };
        match self.flights.get_mut(&held.prompt) {
            Some(w) if !w.ready && w.handle.is_some() => {
                w.ready = true;
                true
            }
            _ => false,
        }
    }

    /// The plan's branches exist: its pins and reservation go, and its choices count as running.
    pub fn admitted(&mut self, index: &mut PrefixIndex, plan: u64) -> Result<()> {
        let held = held(&mut self.plans, plan)?;
        let pin = held.pin.take();
        let was_reserved = std::mem::replace(&mut held.reserved, false);
        let counts = !std::mem::replace(&mut held.running, true);
        let need = held.need;
        if let Some(h) = pin {
            index.unpin(h);
        }
        if was_reserved {
            self.reserved = self.reserved.minus(need);
        }
        if counts {
            self.running += need.choices;
        }
        Ok(())
    }

    /// The request finished or failed: whatever its plan still holds goes (pins, reservation,
    /// running choices, its prompt in flight). Whether waiting requests should look again.
    pub fn release(&mut self, index: &mut PrefixIndex, plan: u64) -> bool {
        let Some(held) = self.plans.remove(&plan) else { return false };
        if let Some(h) = held.pin {
            index.unpin(h);
        }
        if let Some((tokens, copy, bytes)) = held.restore {
            index.host.put_back(&tokens, copy, bytes); // never written back
        }
        if held.reserved {
            self.reserved = self.reserved.minus(held.need);
        }
        if held.running {
            self.running = self.running.saturating_sub(held.need.choices);
        }
        if held.writes {
            self.writing.remove(&held.prompt);
            self.flights.remove(&held.prompt);
        }
        if held.new_tip {
            index.tip_settled();
        }
        true
    }

    /// The request of `plan` ended with `choices` (each its branch, the tokens it generated and
    /// its perplexity then): the `n` it returns, best first, and the perplexities it ranked by.
    ///
    /// Choices are ranked by perplexity (lowest first; one that generated nothing, or whose
    /// perplexity is not finite, last) when `rank` or there are more than `n`, else kept in
    /// order. The best one's branch stays in the cache as an entry holding the prompt and its
    /// tokens (unless `keep_best` is false: a cancelled or failed request), the others are
    /// released, and `root` (a branch holding just the prompt, the choices forked it) is kept
    /// as an entry. Then the plan is released ([`Admission::release`]).
    pub fn finish(
        &mut self,
        index: &mut PrefixIndex,
        plan: u64,
        choices: &[(Handle, Vec<i32>, f64)],
        root: Option<Handle>,
        (n, rank, keep_best): (usize, bool, bool),
    ) -> (Vec<usize>, Vec<f64>) {
        let mut order: Vec<usize> = (0..choices.len()).collect();
        let mut ppls = Vec::new();
        if rank || choices.len() > n {
            let score = |(_, gen, p): &(Handle, Vec<i32>, f64)| {
                if gen.is_empty() || !p.is_finite() {
                    f64::INFINITY
                } else {
                    *p
                }
            };
            ppls = choices.iter().map(score).collect();
            order.sort_by(|&a, &b| ppls[a].total_cmp(&ppls[b]));
        }
        order.truncate(n);
        // a plan released already (finished twice) knows no prompt: nothing is kept
        let prompt = self.plans.get(&plan).map(|h| h.prompt.clone());
        let keep = prompt.is_some();
        let prompt = prompt.unwrap_or_default();
        match root {
            Some(root) if keep => {
                index.add(root, &prompt);
            }
            Some(root) => index.release(root),
            None => {}
        }
        let best = order.first().copied().filter(|_| keep_best && keep);
        for (i, (handle, generated, _)) in choices.iter().enumerate() {
            if Some(i) == best {
                index.add(*handle, &[prompt.as_slice(), generated].concat());
            } else {
                index.release(*handle);
            }
        }
        self.release(index, plan);
        (order, ppls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> Handle {
        i
    }

    fn toks(from: i32, n: i32) -> Vec<i32> {
        (from..from + n).collect()
    }

    fn cat(a: &[i32], b: &[i32]) -> Vec<i32> {
        [a, b].concat()
    }

    /// A plan for `prompt` made and its room reserved.
    fn reserved(ix: &mut PrefixIndex, book: &mut Admission, prompt: &[i32], best_of: usize) -> Plan {
        let p = book.plan(ix, prompt, best_of).expect("admitted now");
        book.reserve(p.id).unwrap();
        p
    }

    #[test]
    fn a_request_on_a_miss_counts_against_the_entry_limit_until_released() {
        let (mut ix, mut book) = (PrefixIndex::default(), Admission::new(4));
        ix.follow_reuse();
        assert!(ix.add(h(1), &toks(0, 20)));
        let hit = book.plan(&mut ix, &toks(0, 30), 1).unwrap(); // reach 1: a limit of 1
        assert!(matches!(hit.start, Start::Fork { .. }) && ix.entry_limit() == Some(1));
        assert!(!ix.tips_over(1), "a fork adds no entry nothing forks");
        let miss = book.plan(&mut ix, &toks(500, 30), 1).unwrap();
        assert_eq!(miss.start, Start::New);
        assert!(ix.tips_over(1) && !ix.tips_over(0), "the miss's entry is on its way");
        let other = book.plan(&mut ix, &toks(900, 30), 1).unwrap();
        assert!(ix.tips_over(0), "two on their way");
        book.admitted(&mut ix, miss.id).unwrap();
        assert!(ix.tips_over(0), "counted while it runs");
        assert!(book.release(&mut ix, miss.id) && book.release(&mut ix, other.id));
        assert!(!ix.tips_over(1) && !book.release(&mut ix, miss.id), "counted once");
    }

    #[test]
    fn an_unshared_plan_forks_nothing_however_much_is_cached() {
        let (mut ix, mut book) = (PrefixIndex::default(), Admission::new(4));
        assert!(ix.add(h(1), &toks(0, 20)));
        let plan = book.plan_shared(&mut ix, &toks(0, 30), 1, false).unwrap();
        assert_eq!((plan.start, plan.reused, plan.exact), (Start::New, 0, false));
        assert_eq!(plan.need.cells, 31, "the whole prompt and a token");
        let shared = book.plan(&mut ix, &toks(0, 30), 1).unwrap();
        assert_eq!((shared.start, shared.reused), (Start::Fork { handle: h(1), at: None }, 20));
    }

    #[test]
    fn slots_and_reservations_hold_back_later_requests_until_released() {
        let (mut ix, mut book) = (PrefixIndex::default(), Admission::new(3));
        let a = book.plan(&mut ix, &toks(0, 10), 2).unwrap();
        assert_eq!((a.start, a.reused, a.exact), (Start::New, 0, false));
        assert_eq!(a.need, Need { choices: 2, leases: 3, cells: 11 }, "a root and two choices");
        book.reserve(a.id).unwrap();
        assert!(book.must_wait(2, 0) && !book.must_wait(1, 0) && book.must_wait(1, 1));
        assert!(book.plan(&mut ix, &toks(100, 10), 2).is_none(), "2 + 2 choices > 3");
        let b = book.plan(&mut ix, &toks(100, 10), 1).unwrap();
        assert_eq!(b.need, Need { choices: 1, leases: 1, cells: 11 });
        assert_eq!(b.room, Need { choices: 3, leases: 4, cells: 22 }, "a's reservation counts");
        assert!(book.release(&mut ix, b.id), "a plan never reserved goes too");
        book.admitted(&mut ix, a.id).unwrap();
        assert_eq!((book.running(), book.reserved()), (2, Need::default()));
        assert!(book.plan(&mut ix, &toks(100, 10), 2).is_none(), "running choices hold slots");
        assert!(book.release(&mut ix, a.id) && !book.release(&mut ix, a.id));
        assert_eq!(book.running(), 0);
        assert!(book.reserve(a.id).is_err(), "a released plan is gone");
        assert!(book.check(3, 4).is_ok() && book.check(3, 3).is_err() && book.check(4, 9).is_err());
        assert!(book.check(0, 9).is_err());
    }

    #[test]
    fn a_cached_entry_is_forked_pinned_and_an_exact_one_needs_no_root() {
        let (mut ix, mut book) = (PrefixIndex::default(), Admission::new(8));
        ix.add(7, &toks(0, 20));
        let p = book.plan(&mut ix, &toks(0, 20), 3).unwrap();
        assert_eq!((p.start, p.reused, p.exact), (Start::Fork { handle: 7, at: None }, 20, true));
        assert_eq!(p.need, Need { choices: 3, leases: 3, cells: 1 });
        assert_eq!(ix.victim(|_| true), None, "pinned while the request is admitted");
        book.reserve(p.id).unwrap();
        book.admitted(&mut ix, p.id).unwrap();
        assert_eq!(ix.victim(|_| true), Some(7), "unpinned once its branches exist");
        let q = book.plan(&mut ix, &toks(0, 30), 1).unwrap();
        assert_eq!((q.start, q.exact, q.need.cells), (Start::Fork { handle: 7, at: None }, false, 11));
        let mut other = toks(0, 30);
        other[25] = -1;
        ix.add(8, &other);
        let r = book.plan(&mut ix, &toks(0, 30), 1).unwrap();
        assert_eq!((r.start, r.reused), (Start::Fork { handle: 8, at: Some(25) }, 25), "a longer run");
        book.release(&mut ix, q.id);
        book.release(&mut ix, r.id);
        assert_eq!(ix.victim(|_| true), Some(7));
    }

    #[test]
    fn a_prompt_in_flight_is_waited_for_then_forked_and_an_exact_one_is_not_in_flight() {
        let (mut ix, mut book) = (PrefixIndex::default(), Admission::new(8));
        let system = toks(0, 40);
        let a = reserved(&mut ix, &mut book, &system, 1);
        let q = cat(&system, &toks(500, 10));
        assert!(book.plan(&mut ix, &q, 1).is_none(), "a's branch is not made yet");
        book.holds(a.id, 5).unwrap();
        assert!(book.plan(&mut ix, &q, 1).is_none(), "not written yet");
        assert!(book.written(a.id) && !book.written(a.id));
        let b = book.plan(&mut ix, &q, 1).unwrap();
        assert_eq!((b.start, b.reused, b.need.cells), (Start::Fork { handle: 5, at: Some(40) }, 40, 11));
        assert_eq!(ix.victim(|_| true), None);
        ix.add(5, &system);
        assert_eq!(ix.victim(|_| true), None, "the in-flight source is pinned by b's plan");
        book.release(&mut ix, b.id);
        assert_eq!(ix.victim(|_| true), Some(5));
        book.release(&mut ix, a.id);
        let c = book.plan(&mut ix, &q, 1).unwrap();
        assert_eq!(c.start, Start::Fork { handle: 5, at: None }, "a's prompt is cached now");
        let d = book.plan(&mut ix, &system, 2).unwrap();
        assert!(d.exact);
        book.reserve(d.id).unwrap();
        assert!(book.flights.is_empty(), "an exact entry is not written again");
    }

    #[test]
    fn a_burst_forks_what_a_prompt_in_flight_forked_when_it_adds_little() {
        let (mut ix, mut book) = (PrefixIndex::default(), Admission::new(8));
        let system = toks(0, 30);
        let a = reserved(&mut ix, &mut book, &cat(&system, &toks(900, 5)), 1);
        book.holds(a.id, 1).unwrap();
        book.written(a.id);
        let q2 = cat(&system, &cat(&[7, 7, 7], &toks(600, 17)));
        let b = book.plan(&mut ix, &q2, 1).unwrap();
        assert_eq!((b.start, b.reused), (Start::Fork { handle: 1, at: Some(30) }, 30));
        book.reserve(b.id).unwrap();
        book.holds(b.id, 2).unwrap();
        let c = book.plan(&mut ix, &cat(&system, &[7, 7, 7, 3, 4]), 1).unwrap();
        assert_eq!(
            (c.start, c.reused),
            (Start::Fork { handle: 1, at: Some(30) }, 30),
            "c shares 3 of b's 20 new tokens, and b is not written: c forks a without waiting"
        );
        assert!(book.plan(&mut ix, &cat(&q2, &[1]), 1).is_none(), "sharing 20 more with b: wait for it");
        book.written(b.id);
        let d = book.plan(&mut ix, &cat(&q2, &[1]), 1).unwrap();
        assert_eq!(d.start, Start::Fork { handle: 2, at: Some(50) });
    }

    #[test]
    fn a_finished_request_keeps_its_best_choice_and_root_and_releases_the_rest() {
        let (mut ix, mut book) = (PrefixIndex::default(), Admission::new(8));
        let prompt = toks(0, 20);
        let p = reserved(&mut ix, &mut book, &prompt, 3);
        book.admitted(&mut ix, p.id).unwrap();
        let choices = [(11, vec![1, 2], 4.0), (12, vec![], 1.0), (13, vec![3], 2.5)];
        let (order, ppls) = book.finish(&mut ix, p.id, &choices, Some(10), (2, false, true));
        assert_eq!(order, [2, 0], "lowest perplexity first; nothing generated ranks last");
        assert_eq!(ppls, [4.0, f64::INFINITY, 2.5]);
        assert_eq!(book.running(), 0, "released");
        let mut kept = ix.entries();
        kept.sort();
        assert_eq!(kept, [(10, prompt.clone()), (13, cat(&prompt, &[3]))]);
        assert_eq!(ix.take_prunable(|_| true), [11, 12]);
        let q = book.plan(&mut ix, &toks(100, 20), 2).unwrap();
        let (order, ppls) =
            book.finish(&mut ix, q.id, &[(21, vec![5], 9.0), (22, vec![6], 1.0)], None, (2, false, false));
        assert_eq!((order, ppls.is_empty()), (vec![0, 1], true), "best_of == n unranked: in order");
        assert_eq!(ix.take_prunable(|_| true), [21, 22], "not kept: a cancelled request");
        assert_eq!(ix.stats().entries, 2);
        let again = book.finish(&mut ix, q.id, &[(31, vec![5], 1.0)], Some(30), (1, false, true));
        assert_eq!(again.0, [0]);
        assert_eq!(ix.take_prunable(|_| true), [30, 31], "a plan finished twice keeps nothing");
        assert_eq!(ix.stats().entries, 2);
    }
}
