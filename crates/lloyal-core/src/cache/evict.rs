//! The prefix cache's pruning, on the locked context: released branches swept, entries evicted
//! when admission needs room, and trimmed to the budget at the end of each tick.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::PrefixIndex;
use crate::context::state::ContextState;
use crate::error::Result;
use crate::tenancy::Handle;

/// A context's prefix cache, shared by its state (which prunes) and its callers (who look up).
pub type SharedIndex = Arc<Mutex<PrefixIndex>>;

/// Lock a prefix cache's bookkeeping (a poisoned lock is taken over: the index stays consistent
/// between its calls).
pub fn lock(index: &SharedIndex) -> MutexGuard<'_, PrefixIndex> {
    index.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ContextState {
    /// The context's prefix cache.
    pub fn prefix_index(&self) -> &SharedIndex {
        &self.cache
    }

    /// Whether `h` is a live branch with no live fork that no engine request uses.
    fn is_leaf(&self, h: Handle) -> bool {
        self.is_live(h) && self.topology.children(h).is_empty() && !self.in_engine.contains(&h)
    }

    /// The branches the engine's requests use now: the cache leaves them alone.
    pub(crate) fn cache_keep(&mut self, handles: Vec<Handle>) {
        self.in_engine = handles;
    }

    /// Cells `h`'s branch holds of its own (after its fork point): what pruning it frees.
    fn own_cells(&self, h: Handle) -> usize {
        self.branch(h).map_or(0, |b| (b.position - b.fork_head).max(0) as usize)
    }

    /// Prune the released branches nothing depends on any more (leaves without pins), until
    /// none is left (pruning one may make its parent a leaf; a released parent first takes the
    /// place of a leaf entry holding its tokens), but none of `keep` (the branches a
    /// caller is about to use: a released parent being forked stays, to be pruned once its forks
    /// are gone). The count pruned.
    fn cache_sweep(&mut self, keep: &[Handle]) -> usize {
        let cache = Arc::clone(&self.cache);
        let stays = |h: Handle| self.is_live(h) && !self.topology.children(h).is_empty();
        lock(&cache).swap_dupes(stays, |h| !keep.contains(&h) && self.is_leaf(h));
        let mut pruned = 0;
        loop {
            let ready = lock(&cache).take_prunable(|h| !keep.contains(&h) && self.is_leaf(h));
            if ready.is_empty() {
                return pruned;
            }
            for h in ready {
                let _ = self.branch_prune(h); // a leaf: cannot fail; it forgets `h` in the index
                pruned += 1;
            }
        }
    }

    /// Evict one entry (least recently used unpinned leaf, none of `keep`); false when none can go.
    fn evict_one(&mut self, keep: &[Handle]) -> bool {
        let cache = Arc::clone(&self.cache);
        let victim = {
            // chosen and taken out under one lock: a lookup cannot pin it in between
            let mut ix = lock(&cache);
            let victim = ix.victim(|h| !keep.contains(&h) && self.is_leaf(h));
            victim.and_then(|h| Some((h, ix.evicted(h)?)))
        };
        let Some((h, tokens)) = victim else { return false };
        self.stow(h, &tokens);
        let _ = self.branch_prune(h);
        true
    }

    /// Leases and cells that pruning every released branch and evicting every entry could
    /// free (unpinned, none of `keep`, and with no live fork but ones that could go too).
    fn freeable(&self, keep: &[Handle]) -> (u32, usize) {
        let ix = lock(&self.cache);
        let candidate = |h: Handle| {
            (ix.entries.contains_key(&h) || ix.released.contains(&h)) && !ix.pinned(h) && !keep.contains(&h)
        };
        let mut known: HashMap<Handle, bool> = HashMap::new();
        let mut total = (0, 0);
        for &h in ix.entries.keys().chain(ix.released.iter()) {
            if self.goes(h, &candidate, &mut known) {
                total = (total.0 + 1, total.1 + self.own_cells(h));
            }
        }
        total
    }

    /// Whether `h` could be pruned once its forks are (memoised in `known`).
    fn goes(&self, h: Handle, candidate: &dyn Fn(Handle) -> bool, known: &mut HashMap<Handle, bool>) -> bool {
        if let Some(&k) = known.get(&h) {
            return k;
        }
        let ok = self.is_live(h)
            && candidate(h)
            && !self.in_engine.contains(&h)
            && self.topology.children(h).to_vec().into_iter().all(|c| self.goes(c, candidate, known));
        known.insert(h, ok);
        ok
    }

    /// Make `leases` leases and `cells` cells (beyond `reserved`) free by pruning released
    /// branches, then evicting entries (none of `keep`: the branches the caller is about to
    /// use); true when they are free. When even all of that would not free them, nothing is
    /// pruned.
    pub fn cache_make_room(&mut self, leases: u32, cells: usize, reserved: usize, keep: &[Handle]) -> bool {
        let short = |s: &Self| s.available() < leases || s.room(reserved) < cells;
        if !short(self) {
            return true;
        }
        let (more_leases, more_cells) = self.freeable(keep);
        if self.available() + more_leases < leases || self.room(reserved) + more_cells < cells {
            return false;
        }
        self.cache_sweep(keep);
        while short(self) {
            if !self.evict_one(keep) {
                return false;
            }
            self.cache_sweep(keep);
        }
        true
    }

    /// [`ContextState::cache_make_room`] for a caller: `Ok` when `leases` leases and `cells`
    /// cells are free, else the error a branch needing them would meet (`LeaseExhausted`,
    /// `KvCacheFull`).
    pub fn cache_ensure_room(&mut self, leases: u32, cells: usize) -> Result<()> {
        if self.cache_make_room(leases, cells, 0, &[]) {
            return Ok(());
        }
        if self.available() < leases {
            return Err(self.ledger.lease_exhausted());
        }
        self.check_room(cells)
    }

    /// Sweep released branches and keep the cells the entries hold of their own within the
    /// budget (least recently used first): the end of each tick.
    pub fn cache_tidy(&mut self) {
        let cache = Arc::clone(&self.cache);
        let (budget, busy) = {
            let mut ix = lock(&cache);
            ix.drop_dead(|h| self.is_live(h));
            let busy = !ix.released.is_empty() || !ix.entries.is_empty();
            (ix.budget(self.shape().n_ctx as usize), busy)
        };
        if !busy {
            return;
        }
        self.cache_sweep(&[]);
        let over = |s: &Self| -> bool {
            let ix = lock(&cache);
            let cells = || ix.entries.keys().map(|&h| s.own_cells(h)).sum::<usize>();
            // Entries nothing forks: a conversation's turns (each a fork of the last) count once.
            let tips = ix.entries.keys().filter(|&&h| s.is_leaf(h)).count();
            ix.tips_over(tips) || budget.is_some_and(|b| cells() > b)
        };
        while over(self) && self.evict_one(&[]) {
            self.cache_sweep(&[]);
        }
    }

    /// Prune every entry and released branch (children first).
    pub fn cache_clear(&mut self) {
        let all = lock(&self.cache).take_all();
        for h in all {
            let _ = self.branch_prune_subtree(h);
        }
    }

    /// A branch is gone: the cache forgets it.
    pub(crate) fn cache_forget(&mut self, h: Handle) {
        lock(&self.cache).forget(h);
    }
}
