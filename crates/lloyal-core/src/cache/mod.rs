//! The prefix cache: finished requests' branches kept for their KV, found by token prefix,
//! and evicted by the engine when admission needs room (as SGLang's RadixCache is).
//!
//! [`PrefixIndex`] is the bookkeeping, behind a lock of its own so a scheduler's lookups never
//! wait for a tick: a radix tree from tokens to cached branches, their recency, pins (requests
//! about to fork a branch), released branches to prune once nothing depends on them, and the
//! reuse statistics. Pruning needs the context, so it happens in `evict.rs`, from admission
//! (a lease, a prompt's or a commit's cells that are not free) and at the end of each tick
//! (released branches, the budget). An entry is evictable when it is a leaf (no live fork of
//! it) and unpinned; evicting it frees its lease and its own cells (after its fork point).

pub mod admission;
pub(crate) mod evict;
pub mod host;
pub mod radix;
pub mod stow;

pub use evict::{lock, SharedIndex};

use std::collections::{HashMap, VecDeque};

use crate::tenancy::Handle;
use host::HostTier;
use radix::RadixTree;
use stow::Stowed;

/// Fewest tokens a request reuses from an entry it does not match whole: sharing less (the
/// BOS token, a chat template's opening) saves next to no prefill, yet ties the new branch to
/// the entry (a parent with a live child is never evicted).
pub const MIN_SHARED: usize = 16;

/// Keys of evicted entries remembered (without their KV): a prompt one of them would have
/// served counts as reuse, so a cache trimmed too far grows back (as ARC's ghost lists do).
pub const GHOSTS: usize = 64;

/// Weight of the newest request in [`PrefixIndex::reuse`] (about the last 10 requests count).
pub const REUSE_WEIGHT: f64 = 0.1;

/// Hits whose reach [`PrefixIndex::entry_limit`] remembers (the newest).
pub const REACH_HITS: usize = 16;

/// One cached branch.
#[derive(Debug, Clone)]
struct Entry {
    tokens: Vec<i32>,
    last_used: u64,
}

/// A lookup's answer: the entry to fork, how many of its tokens to reuse, and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub handle: Handle,
    /// Tokens to reuse (`== len`: fork it whole, with its logits; less: `fork(at=used)`).
    pub used: usize,
    /// Tokens the entry holds.
    pub len: usize,
}

/// Counters of a prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheStats {
    pub entries: usize,
    pub released: usize,
    pub hit_tokens: u64,
    pub lookup_tokens: u64,
    pub evictions: u64,
    /// Moving average of the share of a prompt the cache served (or an evicted entry would have).
    pub reuse: f64,
}

/// The prefix cache's bookkeeping (see the module).
#[derive(Debug)]
pub struct PrefixIndex {
    tree: RadixTree<Handle>,
    entries: HashMap<Handle, Entry>,
    released: Vec<Handle>,
    /// Released branches that were added holding the same tokens as an entry: `(released,
    /// entry)`. The two swap when the released one has forks (it stays anyway) and the entry
    /// has none ([`PrefixIndex::swap_dupes`]), so the one that goes can go now.
    dupes: Vec<(Handle, Handle)>,
    pins: HashMap<Handle, u32>,
    ghosts: RadixTree<()>,
    ghost_order: VecDeque<Vec<i32>>,
    clock: u64,
    stats: CacheStats,
    /// Most cells the entries keep of their own (`None`: no limit).
    budget: Option<usize>,
    /// The budget is `n_ctx` times [`CacheStats::reuse`] instead ([`PrefixIndex::follow_reuse`]).
    follow_reuse: bool,
    /// The reach of the newest hits: 1 + the entries used more recently than the newest one
    /// holding what the hit reused (an evicted entry's ghost: every entry + 1), at most
    /// [`REACH_HITS`] of them.
    reach: VecDeque<usize>,
    /// Requests admitted on a miss (they fork nothing) and not yet ended: each will add an
    /// entry nothing forks, so the entry limit makes room for them at once ([`Self::expect_tip`]).
    incoming: usize,
    /// Copies of evicted entries in host memory (none until a budget is set).
    pub host: HostTier<Stowed>,
    /// For branches whose sliding-window cells start late (written back from a copy, loaded
    /// from a state, or forked from one: llama.cpp saves only a sequence's last window of
    /// them), the lowest position a fork of them continues exactly; see
    /// [`crate::context::state::ContextState::fork_exact_from`].
    exact_from: HashMap<Handle, usize>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex {
            tree: RadixTree::default(),
            entries: HashMap::new(),
            released: Vec::new(),
            dupes: Vec::new(),
            pins: HashMap::new(),
            ghosts: RadixTree::default(),
            ghost_order: VecDeque::new(),
            clock: 0,
            stats: CacheStats { reuse: 1.0, ..CacheStats::default() },
            budget: None,
            follow_reuse: false,
            reach: VecDeque::new(),
            incoming: 0,
            host: HostTier::default(),
            exact_from: HashMap::new(),
        }
    }
}

/// `(tokens reused, value)` of the key in `tree` a request for `tokens` would fork: a whole
/// key that prefixes `tokens`, or a longer shared run of a diverging key (one token at least
/// left to prefill: a fork at a position has no logits); None below [`MIN_SHARED`] shared
/// tokens (unless that is all of `tokens`).
pub fn reusable<'a, V>(tree: &'a RadixTree<V>, tokens: &[i32]) -> Option<(usize, &'a V)> {
    let full = tree.longest_prefix(tokens);
    let part = tree.deepest_match(tokens).map(|(d, v)| (d.min(tokens.len().saturating_sub(1)), v));
    let best = match (full, part) {
        (Some(f), Some(p)) if p.0 > f.0 => Some(p),
        (None, p) => p,
        (f, _) => f,
    };
    best.filter(|(n, _)| *n >= MIN_SHARED.min(tokens.len()) && *n > 0)
}

impl PrefixIndex {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The entry a request for `tokens` forks, pinned (see [`PrefixIndex::unpin`]).
    pub fn lookup(&mut self, tokens: &[i32]) -> Option<Found> {
        let (used, &handle) = reusable(&self.tree, tokens)?;
        let len = self.entries.get(&handle)?.tokens.len();
        if used < len && used < self.exact_from(handle) {
            return None; // a fork there would miss sliding-window cells
        }
        let since = self.entries.get(&handle)?.last_used;
        self.reached(self.reach_of(&tokens[..used], since));
        let now = self.tick();
        let entry = self.entries.get_mut(&handle)?;
        entry.last_used = now;
        *self.pins.entry(handle).or_default() += 1;
        Some(Found { handle, used, len })
    }

    /// Count a request's prompt: `hit` of its tokens came from the cache (the reuse average
    /// also counts what an evicted entry would have served).
    pub fn record(&mut self, hit: usize, prompt: &[i32]) {
        self.stats.hit_tokens += hit as u64;
        self.stats.lookup_tokens += prompt.len() as u64;
        let ghost = reusable(&self.ghosts, prompt).map_or(0, |(n, _)| n);
        if ghost > hit {
            self.reached(self.entries.len() + 1);
        }
        let share = hit.max(ghost) as f64 / prompt.len().max(1) as f64;
        self.stats.reuse += REUSE_WEIGHT * (share - self.stats.reuse);
    }

    /// Keep `handle` (a branch holding exactly `tokens`) as an entry. When an entry already
    /// holds these tokens, the older one stays (others may depend on it) and `handle` is
    /// released instead; false then.
    pub fn add(&mut self, handle: Handle, tokens: &[i32]) -> bool {
        if self.entries.contains_key(&handle) {
            return true;
        }
        let now = self.tick();
        if let Some(&old) = self.tree.get(tokens) {
            if let Some(e) = self.entries.get_mut(&old) {
                e.last_used = now;
            }
            self.release(handle);
            self.dupes.push((handle, old));
            return false;
        }
        self.tree.insert(tokens, handle);
        self.entries.insert(handle, Entry { tokens: tokens.to_vec(), last_used: now });
        true
    }

    /// Prune `handle`, which the cache does not keep, once nothing depends on it (a leaf with
    /// no pins): at the next sweep (the end of a tick, or an admission that needs room).
    pub fn release(&mut self, handle: Handle) {
        if !self.released.contains(&handle) {
            self.released.push(handle);
        }
    }

    /// A request is about to fork `handle`: it is not pruned or evicted until unpinned.
    pub fn pin(&mut self, handle: Handle) {
        *self.pins.entry(handle).or_default() += 1;
    }

    /// Undo one [`PrefixIndex::pin`] (or a lookup's).
    pub fn unpin(&mut self, handle: Handle) {
        if let Some(n) = self.pins.get_mut(&handle) {
            *n -= 1;
            if *n == 0 {
                self.pins.remove(&handle);
            }
        }
    }

    fn pinned(&self, handle: Handle) -> bool {
        self.pins.contains_key(&handle)
    }

    /// `handle`'s branch is gone (pruned by anyone): drop what the cache knew of it; the
    /// tokens it held when it was an entry.
    /// The lowest position a fork of branch `handle` continues exactly (0: any).
    pub fn exact_from(&self, handle: Handle) -> usize {
        self.exact_from.get(&handle).copied().unwrap_or(0)
    }

    /// Record that forks of `handle` below `position` would not be exact (0: forget it).
    pub(crate) fn set_exact_from(&mut self, handle: Handle, position: usize) {
        if position == 0 {
            self.exact_from.remove(&handle);
        } else {
            self.exact_from.insert(handle, position);
        }
    }

    /// `retain_only`: only `winner` lives on, with `position` as its exact-fork floor.
    pub(crate) fn retain_exact_from(&mut self, winner: Handle, position: usize) {
        self.exact_from.clear();
        self.set_exact_from(winner, position);
    }

    pub(crate) fn forget(&mut self, handle: Handle) -> Option<Vec<i32>> {
        self.exact_from.remove(&handle);
        self.released.retain(|&h| h != handle);
        self.dupes.retain(|&(r, e)| r != handle && e != handle);
        self.pins.remove(&handle);
        let e = self.entries.remove(&handle)?;
        self.tree.remove(&e.tokens);
        Some(e.tokens)
    }

    /// Let each released branch that duplicates an entry and `must_stay` (it has forks) hold
    /// that entry instead, when the entry `can_go` (a leaf, unpinned by a caller): the entry's
    /// branch is released in its place. Two requests with one prompt that forked each other
    /// end with the same tokens; whichever finishes second is released, and when that is the
    /// parent, it would hold its lease and cells as long as its fork is cached.
    fn swap_dupes(&mut self, must_stay: impl Fn(Handle) -> bool, can_go: impl Fn(Handle) -> bool) {
        for (released, entry) in std::mem::take(&mut self.dupes) {
            if !self.released.contains(&released) || !self.entries.contains_key(&entry) {
                continue; // pruned, or no longer an entry: nothing to swap
            }
            if !(must_stay(released) && can_go(entry) && !self.pinned(entry)) {
                self.dupes.push((released, entry));
                continue;
            }
            let Some(e) = self.entries.remove(&entry) else { continue };
            self.tree.insert(&e.tokens, released);
            self.entries.insert(released, e);
            self.released.retain(|&h| h != released);
            self.released.push(entry);
        }
    }

    /// Forget the branches `live` says are gone (added after they were pruned).
    fn drop_dead(&mut self, live: impl Fn(Handle) -> bool) {
        let dead: Vec<Handle> =
            self.entries.keys().chain(&self.released).copied().filter(|&h| !live(h)).collect();
        for h in dead {
            self.forget(h);
        }
    }

    /// Entries the cache holds, with the tokens each holds (any order).
    pub fn entries(&self) -> Vec<(Handle, Vec<i32>)> {
        self.entries.iter().map(|(&h, e)| (h, e.tokens.clone())).collect()
    }

    /// Counters.
    pub fn stats(&self) -> CacheStats {
        CacheStats { entries: self.entries.len(), released: self.released.len(), ..self.stats }
    }

    /// Keep the cells the entries hold of their own within `budget` (`None`: no limit),
    /// trimming least recently used entries at the end of each tick.
    pub fn set_budget(&mut self, budget: Option<usize>) {
        self.budget = budget;
        self.follow_reuse = false;
    }

    /// Keep the budget at `n_ctx` times the share of recent prompts the cache served or, trimmed
    /// less, would have ([`CacheStats::reuse`]), recomputed at every trim: a cache that serves
    /// prompts (multi-turn chat, shared system prompts) keeps what it can, one whose prompts
    /// share nothing keeps little (every kept cell slows every decode).
    pub fn follow_reuse(&mut self) {
        self.follow_reuse = true;
    }

    /// The budget in force on a context of `n_ctx` cells.
    pub fn budget(&self, n_ctx: usize) -> Option<usize> {
        if self.follow_reuse {
            return Some((n_ctx as f64 * self.stats.reuse) as usize);
        }
        self.budget
    }

    /// How far back in recency a hit that reuses `shared` reached: 1 + the entries used more
    /// recently than the most recent one holding `shared` (the entry hit, last used at `since`,
    /// or a newer one: the forks of a shared system prompt hold it too, and an LRU cache that
    /// kept any of them would have served the hit).
    fn reach_of(&self, shared: &[i32], since: u64) -> usize {
        let mut newer: Vec<&Entry> = self.entries.values().filter(|e| e.last_used > since).collect();
        newer.sort_unstable_by_key(|e| std::cmp::Reverse(e.last_used));
        1 + newer.iter().take_while(|e| !e.tokens.starts_with(shared)).count()
    }

    fn reached(&mut self, reach: usize) {
        self.reach.push_back(reach);
        if self.reach.len() > REACH_HITS {
            self.reach.pop_front();
        }
    }

    /// Most entries that no branch forks (a conversation's turns, each a fork of the last,
    /// count once) a budget that follows reuse keeps: the farthest reach of the last
    /// [`REACH_HITS`] hits, the capacity at which a least-recently-used cache would have served
    /// them all (None before the first hit, and under a budget set by hand). Every
    /// cell the cache keeps slows every decode and prefill a little (llama.cpp attends over
    /// the cells up to the highest one in use, masking other sequences'), so entries that no
    /// recent hit needed go: a shared system prompt is hit at reach 1 or 2, and the prompts
    /// used once before it are evicted; users taking turns reach as far as their number.
    pub fn entry_limit(&self) -> Option<usize> {
        self.reach.iter().max().filter(|_| self.follow_reuse).copied()
    }

    /// A request was admitted on a miss: its end adds an entry nothing forks, and the least
    /// recently used one over [`Self::entry_limit`] would go then. It goes now instead
    /// ([`Self::tips_over`]), before the request's prompt: every cell kept slows a prompt
    /// (llama.cpp attends over the cells up to the highest one in use), and at concurrency 1
    /// the previous request's ~1,100 cells cost a 1,000-token prompt ~35 ms.
    pub fn expect_tip(&mut self) {
        self.incoming += 1;
    }

    /// A request [`Self::expect_tip`] counted ended (its entry added, or none).
    pub fn tip_settled(&mut self) {
        self.incoming = self.incoming.saturating_sub(1);
    }

    /// Whether `tips` entries nothing forks, with the requests on their way that will add
    /// more ([`Self::expect_tip`]), are over the [`Self::entry_limit`].
    pub fn tips_over(&self, tips: usize) -> bool {
        self.entry_limit().is_some_and(|n| tips + self.incoming > n)
    }

    /// The least recently used unpinned entry for which `leaf` holds.
    fn victim(&self, leaf: impl Fn(Handle) -> bool) -> Option<Handle> {
        let candidates = self.entries.iter().filter(|(&h, _)| !self.pinned(h) && leaf(h));
        candidates.min_by_key(|(&h, e)| (e.last_used, h)).map(|(&h, _)| h)
    }

    /// Released branches that can go now (unpinned and `leaf`), taken off the released list
    /// (their pruning is the caller's).
    fn take_prunable(&mut self, leaf: impl Fn(Handle) -> bool) -> Vec<Handle> {
        let ready: Vec<Handle> =
            self.released.iter().copied().filter(|&h| !self.pinned(h) && leaf(h)).collect();
        self.released.retain(|h| !ready.contains(h));
        ready
    }

    /// `handle` is evicted: forgotten, counted, and its key remembered as a ghost; the tokens
    /// it held (`None`: not an entry).
    fn evicted(&mut self, handle: Handle) -> Option<Vec<i32>> {
        let tokens = self.forget(handle)?;
        self.stats.evictions += 1;
        if self.ghosts.get(&tokens).is_none() {
            self.ghosts.insert(&tokens, ());
            self.ghost_order.push_back(tokens.clone());
            while self.ghost_order.len() > GHOSTS {
                if let Some(old) = self.ghost_order.pop_front() {
                    self.ghosts.remove(&old);
                }
            }
        }
        Some(tokens)
    }

    /// Forget every entry and released branch (their branches are pruned by the caller), and
    /// drop the host tier's copies.
    pub(crate) fn take_all(&mut self) -> Vec<Handle> {
        let mut all: Vec<(usize, Handle)> = self.entries.iter().map(|(&h, e)| (e.tokens.len(), h)).collect();
        all.sort_unstable_by(|a, b| b.cmp(a)); // longest first: forks before what they forked
        let mut out: Vec<Handle> = std::mem::take(&mut self.released);
        self.dupes.clear();
        out.extend(all.into_iter().map(|(_, h)| h));
        self.entries.clear();
        self.tree = RadixTree::default();
        self.pins.clear();
        self.exact_from.clear();
        self.host.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn h(i: u64) -> Handle {
        i
    }

    fn prompt(n: i32) -> Vec<i32> {
        (0..n).collect()
    }

    #[test]
    fn lookup_prefers_a_whole_prefix_then_a_longer_shared_run_and_pins() {
        let mut ix = PrefixIndex::default();
        assert!(ix.add(h(1), &prompt(20)));
        let mut long = prompt(30);
        long[25] = -1; // diverges at 25
        assert!(ix.add(h(2), &long));
        let f = ix.lookup(&prompt(40)).unwrap();
        assert_eq!(f, Found { handle: h(2), used: 25, len: 30 }, "25 shared beats 20 whole");
        let f = ix.lookup(&prompt(21)).unwrap();
        assert_eq!((f.handle, f.used), (h(1), 20), "20 whole beats 20 shared");
        let f = ix.lookup(&prompt(24)).unwrap();
        assert_eq!(f, Found { handle: h(2), used: 23, len: 30 }, "one token is left to prefill");
        assert!(ix.lookup(&prompt(10)).is_none(), "9 reusable tokens are below MIN_SHARED");
        assert!(ix.lookup(&[5, 6, 7]).is_none());
        assert_eq!(ix.victim(|_| true), None, "lookups pinned both");
        for _ in 0..4 {
            ix.unpin(h(1));
            ix.unpin(h(2));
        }
        assert_eq!(ix.victim(|_| true), Some(h(1)), "least recently used first");
        assert_eq!(ix.victim(|x| x != h(1)), Some(h(2)), "only leaves");
    }

    #[test]
    fn a_second_entry_for_the_same_tokens_is_released_and_ghosts_count_as_reuse() {
        let mut ix = PrefixIndex::default();
        assert!(ix.add(h(1), &prompt(20)));
        assert!(!ix.add(h(2), &prompt(20)));
        ix.pin(h(2));
        assert!(ix.take_prunable(|_| true).is_empty(), "pinned");
        assert!(ix.take_prunable(|x| x != h(2)).is_empty(), "not a leaf");
        ix.unpin(h(2));
        assert_eq!(ix.take_prunable(|_| true), [h(2)]);
        assert_eq!(ix.stats().released, 0, "taken off the list");
        ix.release(h(2));
        assert_eq!(ix.forget(h(2)), None, "released, never an entry");
        assert_eq!(ix.stats().released, 0);
        ix.record(0, &prompt(20));
        assert!((ix.stats().reuse - 0.9).abs() < 1e-9);
        ix.evicted(h(1));
        assert_eq!((ix.stats().entries, ix.stats().evictions), (0, 1));
        ix.record(0, &prompt(30)); // the evicted entry would have served 20 of 30
        assert!((ix.stats().reuse - (0.9 + 0.1 * (20.0 / 30.0 - 0.9))).abs() < 1e-9);
        assert_eq!((ix.stats().hit_tokens, ix.stats().lookup_tokens), (0, 50));
    }

    #[test]
    fn a_released_duplicate_with_forks_takes_the_place_of_a_leaf_entry() {
        let mut ix = PrefixIndex::default();
        assert!(ix.add(h(3), &prompt(20))); // a fork of 1 that finished first
        assert!(!ix.add(h(1), &prompt(20)));
        ix.pin(h(3));
        ix.swap_dupes(|x| x == h(1), |x| x == h(3));
        assert_eq!((ix.entries().len(), ix.stats().released), (1, 1), "a pinned entry stays");
        ix.unpin(h(3));
        ix.swap_dupes(|_| false, |_| true);
        assert!(ix.entries.contains_key(&h(3)), "the released one has no forks: no swap");
        ix.swap_dupes(|x| x == h(1), |x| x == h(3));
        assert_eq!(ix.entries(), vec![(h(1), prompt(20))], "1 holds the entry now");
        assert_eq!(ix.take_prunable(|_| true), [h(3)], "and 3 is released");
        assert_eq!(ix.lookup(&prompt(30)).map(|f| f.handle), Some(h(1)));
        assert!(ix.dupes.is_empty(), "swapped once");
        assert!(ix.add(h(4), &prompt(25)));
        assert!(!ix.add(h(5), &prompt(25)));
        assert_eq!(ix.forget(h(4)), Some(prompt(25)));
        assert!(ix.dupes.is_empty(), "a forgotten entry takes its pair along");
    }

    #[test]
    fn a_budget_that_follows_reuse_moves_with_it_until_one_is_set() {
        let mut ix = PrefixIndex::default();
        assert_eq!(ix.budget(1000), None, "no limit at first");
        ix.follow_reuse();
        assert_eq!(ix.budget(1000), Some(1000), "reuse starts at 1");
        ix.record(0, &prompt(20)); // a prompt nothing served: reuse 0.9
        assert_eq!(ix.budget(1000), Some(900));
        ix.set_budget(Some(5));
        assert_eq!(ix.budget(1000), Some(5));
    }

    /// A prompt of `n` tokens starting at `first` (entries that share nothing).
    fn family(first: i32, n: i32) -> Vec<i32> {
        (first..first + n).collect()
    }

    #[test]
    fn the_entry_limit_is_the_farthest_reach_of_the_recent_hits() {
        let mut ix = PrefixIndex::default();
        for i in 0..6 {
            ix.add(h(i as u64), &family(1000 * i, 20));
        }
        assert!(ix.lookup(&family(5000, 30)).is_some(), "the newest entry: reach 1");
        assert_eq!(ix.entry_limit(), None, "no limit under a budget set by hand (or none)");
        ix.follow_reuse();
        assert_eq!(ix.entry_limit(), Some(1));
        assert!(ix.lookup(&family(2000, 30)).is_some(), "entries 3, 4, 5 were used since entry 2");
        assert_eq!(ix.entry_limit(), Some(4));
        for _ in 0..REACH_HITS {
            assert!(ix.lookup(&family(2000, 30)).is_some()); // entry 2 again: reach 1
        }
        assert_eq!(ix.entry_limit(), Some(1), "the far hit left the window");
        // Forks of a shared prefix, newer than the entry hit, hold what it reuses: reach 1 + the
        // entries newer than the newest of them.
        let shared = family(7000, 40);
        ix.add(h(10), &shared);
        for (k, handle) in [(11, 11), (12, 12)] {
            ix.add(h(handle), &[&shared[..30], &family(100 * k, 20)].concat());
        }
        ix.add(h(13), &family(8000, 20));
        assert!(ix.lookup(&[&shared[..30], &family(50, 5)].concat()).is_some());
        assert_eq!(ix.entry_limit(), Some(2), "entry 13 is newer than entry 12, which holds the 30");
        ix.evicted(h(0));
        ix.record(0, &family(0, 30)); // entry 0 would have served it: one more entry than now
        assert_eq!(ix.entry_limit(), Some(5 + 4 + 1));
    }

    #[test]
    fn take_all_orders_longer_entries_first() {
        let mut ix = PrefixIndex::default();
        ix.add(h(1), &prompt(20));
        ix.add(h(2), &prompt(40));
        ix.release(h(3));
        assert_eq!(ix.take_all(), [h(3), h(2), h(1)]);
        assert!(ix.lookup(&prompt(40)).is_none() && ix.stats().entries == 0);
    }
}
