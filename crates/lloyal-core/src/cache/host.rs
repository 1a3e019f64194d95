//! The prefix cache's host-memory tier: entries the context evicted, kept as copies of their
//! KV in host memory within a byte budget, found by token prefix like the live entries, and
//! written back into the context when a request would reuse more of one than of any live entry
//! (llama-server's `--cache-ram`).
//!
//! A copy costs one pass over the entry's cells to take and one to write back, against a
//! prefill of every token it serves: a returning conversation evicted for room starts from its
//! copy. This is the bookkeeping (least recently used copies go first to keep within the
//! budget); the copies are taken and written back in `evict.rs` and `restore.rs`.

use std::collections::HashMap;

use super::radix::RadixTree;
use super::reusable;

/// One kept copy.
#[derive(Debug)]
struct Kept<T> {
    tokens: Vec<i32>,
    bytes: usize,
    last_used: u64,
    value: T,
}

/// A lookup's answer: the copy to write back, how many of its tokens a request reuses, and
/// its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostFound {
    pub key: u64,
    pub used: usize,
    pub len: usize,
}

/// Counters of the host tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Copies kept now, and their bytes.
    pub entries: usize,
    pub bytes: usize,
    /// Copies taken (entries evicted with a budget), written back, and dropped for the budget.
    pub kept: u64,
    pub restored: u64,
    pub dropped: u64,
    /// Prompt tokens served by copies written back.
    pub restored_tokens: u64,
}

/// Copies of evicted entries within a byte budget (see the module); `T` is what a copy holds.
#[derive(Debug)]
pub struct HostTier<T> {
    tree: RadixTree<u64>,
    kept: HashMap<u64, Kept<T>>,
    budget: usize,
    clock: u64,
    next: u64,
    stats: HostStats,
}

impl<T> Default for HostTier<T> {
    fn default() -> Self {
        HostTier {
            tree: RadixTree::default(),
            kept: HashMap::new(),
            budget: 0,
            clock: 0,
            next: 0,
            stats: HostStats::default(),
        }
    }
}

impl<T> HostTier<T> {
    /// Most bytes the copies hold (0: none are kept); copies over it go, least recently used
    /// first.
    pub fn set_budget(&mut self, bytes: usize) {
        self.budget = bytes;
        self.trim(0);
    }

    /// The byte budget (0: off).
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Whether an entry of about `bytes` would be kept: a budget is set and holds it.
    pub fn takes(&self, bytes: usize) -> bool {
        bytes > 0 && bytes <= self.budget
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Drop least recently used copies until `room` more bytes fit in the budget.
    fn trim(&mut self, room: usize) {
        while self.stats.bytes + room > self.budget {
            let Some(key) = self.kept.iter().min_by_key(|(&k, c)| (c.last_used, k)).map(|(&k, _)| k) else {
                return;
            };
            self.remove(key);
            self.stats.dropped += 1;
        }
    }

    fn remove(&mut self, key: u64) -> Option<Kept<T>> {
        let c = self.kept.remove(&key)?;
        self.tree.remove(&c.tokens);
        self.stats.bytes -= c.bytes;
        Some(c)
    }

    /// Keep `value`, a copy of `bytes` bytes of an entry holding `tokens` (one already kept for
    /// the same tokens is replaced); false when it does not fit in the budget (dropped).
    pub fn keep(&mut self, tokens: &[i32], value: T, bytes: usize) -> bool {
        if !self.takes(bytes) {
            return false;
        }
        if let Some(&old) = self.tree.get(tokens) {
            self.remove(old);
        }
        self.trim(bytes);
        self.next += 1;
        let key = self.next;
        let last_used = self.tick();
        self.tree.insert(tokens, key);
        self.kept.insert(key, Kept { tokens: tokens.to_vec(), bytes, last_used, value });
        self.stats.bytes += bytes;
        self.stats.kept += 1;
        true
    }

    /// The copy a request for `tokens` would reuse more of than `live` tokens (what the
    /// context's own entries serve), as [`reusable`] finds a live entry.
    pub fn lookup(&self, tokens: &[i32], live: usize) -> Option<HostFound> {
        let (used, &key) = reusable(&self.tree, tokens)?;
        let len = self.kept.get(&key)?.tokens.len();
        (used > live).then_some(HostFound { key, used, len })
    }

    /// Copy `key`'s value, while it is kept.
    pub fn get(&self, key: u64) -> Option<&T> {
        self.kept.get(&key).map(|k| &k.value)
    }

    /// Take copy `key` out to write it back: its tokens, value and bytes (`None`: gone since
    /// the lookup).
    pub fn take(&mut self, key: u64) -> Option<(Vec<i32>, T, usize)> {
        let c = self.remove(key)?;
        Some((c.tokens, c.value, c.bytes))
    }

    /// A copy taken that was not written back (its request ended first): kept again, as
    /// recently used.
    pub fn put_back(&mut self, tokens: &[i32], value: T, bytes: usize) {
        if self.keep(tokens, value, bytes) {
            self.stats.kept -= 1; // not a new copy
        }
    }

    /// A copy taken was written back, serving `used` prompt tokens.
    pub fn restored(&mut self, used: usize) {
        self.stats.restored += 1;
        self.stats.restored_tokens += used as u64;
    }

    /// Counters.
    pub fn stats(&self) -> HostStats {
        HostStats { entries: self.kept.len(), ..self.stats }
    }

    /// Drop every copy.
    pub fn clear(&mut self) {
        self.tree = RadixTree::default();
        self.kept.clear();
        self.stats.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(first: i32, n: i32) -> Vec<i32> {
        (first..first + n).collect()
    }

    #[test]
    fn copies_are_kept_within_the_budget_least_recently_used_going_first() {
        let mut tier: HostTier<&str> = HostTier::default();
        assert!(!tier.keep(&tokens(0, 20), "a", 10), "no budget: nothing kept");
        tier.set_budget(25);
        assert!(!tier.keep(&tokens(0, 20), "big", 26), "larger than the budget");
        assert!(tier.keep(&tokens(0, 20), "a", 10));
        assert!(tier.keep(&tokens(100, 20), "b", 10));
        assert!(tier.keep(&tokens(200, 20), "c", 10), "a goes to make room");
        let s = tier.stats();
        assert_eq!((s.entries, s.bytes, s.kept, s.dropped), (2, 20, 3, 1));
        assert_eq!(tier.lookup(&tokens(0, 30), 0), None, "a was dropped");
        let found = tier.lookup(&tokens(100, 30), 0).unwrap();
        assert_eq!((found.used, found.len), (20, 20));
        assert_eq!(tier.lookup(&tokens(100, 30), 20), None, "the live entries serve as much");
        assert!(tier.keep(&tokens(100, 20), "b2", 12), "the same tokens: replaced");
        assert_eq!(tier.stats().bytes, 22);
        assert_eq!(tier.take(found.key), None, "replaced: the old key is gone");
        let again = tier.lookup(&tokens(100, 30), 0).unwrap();
        assert_eq!(tier.take(again.key), Some((tokens(100, 20), "b2", 12)));
        assert_eq!(tier.stats().bytes, 10);
        tier.set_budget(5);
        assert_eq!(tier.stats().entries, 0, "a lower budget drops what no longer fits");
    }

    #[test]
    fn a_lookup_reuses_a_shared_run_and_a_copy_put_back_is_recent() {
        let mut tier: HostTier<u8> = HostTier::default();
        tier.set_budget(100);
        tier.keep(&tokens(0, 40), 1, 40);
        tier.keep(&tokens(500, 40), 2, 40);
        let mut diverging = tokens(0, 50);
        diverging[30] = -1;
        let f = tier.lookup(&diverging, 0).unwrap();
        assert_eq!((f.used, f.len), (30, 40), "the first 30 of a longer copy");
        assert_eq!(tier.lookup(&tokens(0, 10), 0), None, "below MIN_SHARED");
        let (t, v, bytes) = tier.take(f.key).unwrap();
        tier.put_back(&t, v, bytes);
        tier.keep(&tokens(900, 20), 3, 30);
        assert!(tier.lookup(&tokens(0, 41), 0).is_some(), "put back as recently used: 500.. went");
        assert!(tier.lookup(&tokens(500, 41), 0).is_none());
        tier.restored(30);
        let s = tier.stats();
        assert_eq!((s.kept, s.restored, s.restored_tokens, s.dropped), (3, 1, 30, 1));
    }
}
