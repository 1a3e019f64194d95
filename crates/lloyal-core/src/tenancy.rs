//! KV tenancy data structures: the lease table (the scarce seq ids) and slots (generation-checked
//! branch handles). A context changes its lease table only through `ledger.rs`.

/// A branch handle: slot index in the low 32 bits, slot generation in the high 32 bits,
/// so a handle to a freed slot never reaches the slot's next tenant.
pub type Handle = u64;

fn pack(index: u32, generation: u32) -> Handle {
    (u64::from(generation) << 32) | u64::from(index)
}

fn unpack(handle: Handle) -> (u32, u32) {
    (handle as u32, (handle >> 32) as u32)
}

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// Slot storage with generation-checked handles; freed slots are reused.
pub struct Slots<T> {
    entries: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
}

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Slots { entries: Vec::new(), free: Vec::new(), live: 0 }
    }
}

impl<T> Slots<T> {
    /// Store `value`; return its handle.
    pub fn insert(&mut self, value: T) -> Handle {
        self.live += 1;
        if let Some(index) = self.free.pop() {
            let slot = &mut self.entries[index as usize];
            slot.value = Some(value);
            return pack(index, slot.generation);
        }
        self.entries.push(Slot { generation: 1, value: Some(value) });
        pack((self.entries.len() - 1) as u32, 1)
    }

    fn slot(&self, handle: Handle) -> Option<&Slot<T>> {
        let (index, generation) = unpack(handle);
        self.entries.get(index as usize).filter(|s| s.generation == generation)
    }

    /// The value behind a live handle.
    pub fn get(&self, handle: Handle) -> Option<&T> {
        self.slot(handle)?.value.as_ref()
    }

    /// The value behind a live handle, mutably.
    pub fn get_mut(&mut self, handle: Handle) -> Option<&mut T> {
        let (index, generation) = unpack(handle);
        let slot = self.entries.get_mut(index as usize).filter(|s| s.generation == generation)?;
        slot.value.as_mut()
    }

    /// Free a handle's slot (bumping its generation); return the value.
    pub fn remove(&mut self, handle: Handle) -> Option<T> {
        let (index, generation) = unpack(handle);
        let slot = self.entries.get_mut(index as usize).filter(|s| s.generation == generation)?;
        let value = slot.value.take()?;
        slot.generation = slot.generation.wrapping_add(1).max(1);
        self.free.push(index);
        self.live -= 1;
        Some(value)
    }

    /// Whether the handle is live.
    pub fn contains(&self, handle: Handle) -> bool {
        self.get(handle).is_some()
    }

    /// Live values.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no value is live.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// The values behind the live handles among `handles`, mutably, in slot order.
    pub fn get_many_mut(&mut self, handles: &[Handle]) -> Vec<&mut T> {
        let wanted: Vec<(u32, u32)> = handles.iter().map(|&h| unpack(h)).collect();
        let slots = self.entries.iter_mut().enumerate();
        let picked = slots.filter(|(i, s)| wanted.contains(&(*i as u32, s.generation)));
        picked.filter_map(|(_, s)| s.value.as_mut()).collect()
    }

    /// Every live value.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.entries.iter().filter_map(|s| s.value.as_ref())
    }

    /// Every live value, mutably.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.entries.iter_mut().filter_map(|s| s.value.as_mut())
    }

    /// Handles of every live value.
    pub fn handles(&self) -> Vec<Handle> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, s)| s.value.is_some())
            .map(|(i, s)| pack(i as u32, s.generation))
            .collect()
    }
}

/// The seq-id leases of one context: a LIFO free list (seq 0 handed out first).
#[derive(Debug, Clone)]
pub struct Leases {
    n_seq_max: u32,
    free: Vec<i32>,
}

impl Leases {
    /// All `n_seq_max` ids free.
    pub fn new(n_seq_max: u32) -> Self {
        Leases { n_seq_max, free: (0..n_seq_max as i32).rev().collect() }
    }

    /// Take the most recently freed id (or the lowest never-used one).
    pub fn acquire(&mut self) -> Option<i32> {
        self.free.pop()
    }

    /// Take the most recently freed id for which `usable` holds (see [`Self::acquire`]).
    pub fn acquire_where(&mut self, mut usable: impl FnMut(i32) -> bool) -> Option<i32> {
        let at = self.free.iter().rposition(|&s| usable(s))?;
        Some(self.free.remove(at))
    }

    /// The free ids, most recently freed last.
    pub fn free_ids(&self) -> &[i32] {
        &self.free
    }

    /// Return an id.
    pub fn release(&mut self, seq_id: i32) {
        debug_assert!(!self.free.contains(&seq_id), "double release of seq {seq_id}");
        self.free.push(seq_id);
    }

    /// Rebuild so that only `held` ids are taken.
    pub fn rebuild(&mut self, held: &[i32]) {
        self.free = (0..self.n_seq_max as i32).rev().filter(|s| !held.contains(s)).collect();
    }

    /// Free ids.
    pub fn available(&self) -> u32 {
        self.free.len() as u32
    }

    /// Ids held.
    pub fn live(&self) -> u32 {
        self.n_seq_max - self.available()
    }

    /// Total ids.
    pub fn n_seq_max(&self) -> u32 {
        self.n_seq_max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_handles_never_reach_reused_slots() {
        let mut s = Slots::default();
        let a = s.insert("a");
        assert_eq!(s.remove(a), Some("a"));
        let b = s.insert("b");
        assert_eq!(a as u32, b as u32, "slot index reused");
        assert_ne!(a, b, "generation differs");
        assert_eq!(s.get(a), None);
        assert_eq!(s.remove(a), None);
        assert_eq!(s.get(b), Some(&"b"));
        assert_eq!(s.len(), 1);
        assert_eq!(s.handles(), vec![b]);
    }

    #[test]
    fn leases_are_lifo_from_zero() {
        let mut l = Leases::new(3);
        assert_eq!(l.acquire(), Some(0));
        assert_eq!(l.acquire(), Some(1));
        l.release(0);
        assert_eq!(l.acquire(), Some(0));
        assert_eq!(l.acquire(), Some(2));
        assert_eq!(l.acquire(), None);
        assert_eq!((l.available(), l.live()), (0, 3));
        l.rebuild(&[2]);
        assert_eq!((l.available(), l.live()), (2, 1));
        assert_eq!(l.acquire(), Some(0));
    }

    #[test]
    fn acquire_where_skips_unusable_ids() {
        let mut l = Leases::new(4);
        assert_eq!(l.acquire_where(|s| s != 0 && s != 1), Some(2));
        assert_eq!(l.acquire(), Some(0));
        assert_eq!(l.acquire_where(|s| s == 1), Some(1));
        assert_eq!(l.acquire_where(|s| s == 1), None);
        assert_eq!((l.available(), l.free_ids()), (1, &[3][..]));
    }
}
