//! A radix tree over token ids: which stored sequence is the longest prefix of a prompt, and
//! which shares the most tokens with it. Edges hold runs of tokens, so a 2,000-token prompt
//! shared by many requests is one edge, not 2,000 nodes. Nodes live in an arena (indices, a
//! free list), values are the caller's.

use std::collections::HashMap;

#[derive(Debug)]
struct Node<V> {
    edge: Vec<i32>,
    children: HashMap<i32, usize>,
    value: Option<V>,
}

/// Token-sequence keys to values.
#[derive(Debug)]
pub struct RadixTree<V> {
    /// The root (index 0) and every node below it; removed ones wait in `free` for reuse.
    nodes: Vec<Node<V>>,
    free: Vec<usize>,
}

impl<V> Default for RadixTree<V> {
    fn default() -> Self {
        let root = Node { edge: Vec::new(), children: HashMap::new(), value: None };
        RadixTree { nodes: vec![root], free: Vec::new() }
    }
}

/// Length of the common prefix of `a` and `b`.
fn common(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<V> RadixTree<V> {
    /// Values stored (counted: a walk over the tree).
    pub fn len(&self) -> usize {
        self.values().count()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.values().next().is_none()
    }

    fn alloc(&mut self, edge: Vec<i32>) -> usize {
        let node = Node { edge, children: HashMap::new(), value: None };
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Store `value` under `key`; the value it replaces, if any.
    pub fn insert(&mut self, key: &[i32], value: V) -> Option<V> {
        let (mut node, mut i) = (0, 0);
        while i < key.len() {
            let Some(&child) = self.nodes[node].children.get(&key[i]) else {
                let leaf = self.alloc(key[i..].to_vec());
                self.nodes[node].children.insert(key[i], leaf);
                node = leaf;
                break;
            };
            let k = common(&key[i..], &self.nodes[child].edge);
            let child = if k < self.nodes[child].edge.len() {
                // split the edge at k: node -> mid (edge[..k]) -> child (edge[k..])
                let rest = self.nodes[child].edge.split_off(k);
                let head = std::mem::replace(&mut self.nodes[child].edge, rest);
                let mid = self.alloc(head);
                let first = self.nodes[child].edge[0];
                self.nodes[mid].children.insert(first, child);
                self.nodes[node].children.insert(key[i], mid);
                mid
            } else {
                child
            };
            node = child;
            i += k;
        }
        self.nodes[node].value.replace(value)
    }

    /// The nodes from the root down to the one whose edges spell exactly `key`.
    fn path(&self, key: &[i32]) -> Option<Vec<usize>> {
        let (mut path, mut i) = (vec![0], 0);
        while i < key.len() {
            let child = *self.nodes[*path.last()?].children.get(&key[i])?;
            let edge = &self.nodes[child].edge;
            if common(&key[i..], edge) < edge.len() {
                return None;
            }
            i += edge.len();
            path.push(child);
        }
        Some(path)
    }

    /// The value stored under exactly `key`.
    pub fn get(&self, key: &[i32]) -> Option<&V> {
        self.nodes[*self.path(key)?.last()?].value.as_ref()
    }

    /// `(length, value)` of the longest stored key that is a prefix of `key`.
    pub fn longest_prefix(&self, key: &[i32]) -> Option<(usize, &V)> {
        let (mut best, mut node, mut i) = (None, 0, 0);
        while i < key.len() {
            let Some(&child) = self.nodes[node].children.get(&key[i]) else { break };
            let edge = &self.nodes[child].edge;
            if common(&key[i..], edge) < edge.len() {
                break;
            }
            (node, i) = (child, i + edge.len());
            if let Some(v) = &self.nodes[node].value {
                best = Some((i, v));
            }
        }
        best
    }

    /// `(d, value)`: the most tokens `d` that `key` shares with any stored key, and the value
    /// of the shortest stored key below that point; None when nothing shares a token.
    pub fn deepest_match(&self, key: &[i32]) -> Option<(usize, &V)> {
        let (mut node, mut i) = (0, 0);
        while i < key.len() {
            let Some(&child) = self.nodes[node].children.get(&key[i]) else { break };
            let k = common(&key[i..], &self.nodes[child].edge);
            (node, i) = (child, i + k);
            if k < self.nodes[child].edge.len() {
                break;
            }
        }
        if i == 0 {
            return None;
        }
        let mut level = vec![node]; // breadth first: the shortest stored key below
        while !level.is_empty() {
            if let Some(v) = level.iter().find_map(|&n| self.nodes[n].value.as_ref()) {
                return Some((i, v));
            }
            level = level.iter().flat_map(|&n| self.nodes[n].children.values().copied()).collect();
        }
        None
    }

    /// Drop the value stored under `key` and return it; empty leaves are removed and
    /// pass-through nodes merged into their one child.
    pub fn remove(&mut self, key: &[i32]) -> Option<V> {
        let mut path = self.path(key)?;
        let value = self.nodes[*path.last()?].value.take()?;
        while path.len() > 1 {
            let (n, parent) = (path[path.len() - 1], path[path.len() - 2]);
            if self.nodes[n].value.is_some() || self.nodes[n].children.len() > 1 {
                break;
            }
            let first = self.nodes[n].edge[0];
            if let Some(&only) = self.nodes[n].children.values().next() {
                let mut edge = std::mem::take(&mut self.nodes[n].edge);
                edge.extend_from_slice(&self.nodes[only].edge);
                self.nodes[only].edge = edge;
                self.nodes[parent].children.insert(first, only);
            } else {
                self.nodes[parent].children.remove(&first);
            }
            self.nodes[n].children.clear();
            self.free.push(n);
            path.pop();
        }
        Some(value)
    }

    /// Every stored value, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        let mut stack = vec![0];
        std::iter::from_fn(move || {
            while let Some(n) = stack.pop() {
                stack.extend(self.nodes[n].children.values().copied());
                if let Some(v) = &self.nodes[n].value {
                    return Some(v);
                }
            }
            None
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_matches_and_removal() {
        let mut t = RadixTree::default();
        assert_eq!(t.insert(&[1, 2, 3], "a"), None);
        t.insert(&[1, 2, 3, 4, 5], "b");
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4, 9]), Some((3, &"a")));
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4, 5, 6]), Some((5, &"b")));
        assert_eq!(t.deepest_match(&[1, 2, 3, 4, 7]), Some((4, &"b")));
        assert_eq!(t.deepest_match(&[1, 2, 7]), Some((2, &"a")), "the shortest key below the split");
        assert_eq!(t.deepest_match(&[9]), None);
        assert_eq!(t.insert(&[1, 2, 3], "c"), Some("a"));
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove(&[1, 2, 3]), Some("c"));
        assert_eq!(t.remove(&[1, 2]), None, "no key ends there");
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4]), None);
        assert_eq!(t.get(&[1, 2, 3, 4, 5]), Some(&"b"));
        assert_eq!(t.remove(&[1, 2, 3, 4, 5]), Some("b"));
        assert!(t.is_empty() && t.values().next().is_none());
    }

    #[test]
    fn split_edges_merge_back_and_nodes_are_reused() {
        let mut t = RadixTree::default();
        t.insert(&[1, 2, 3, 4], 1);
        t.insert(&[1, 2, 9], 2); // splits [1,2,3,4] at 2
        t.insert(&[1, 2], 3);
        let mut all: Vec<i32> = t.values().copied().collect();
        all.sort_unstable();
        assert_eq!(all, [1, 2, 3]);
        t.remove(&[1, 2]);
        t.remove(&[1, 2, 9]); // [1,2] passes through to [3,4] alone: merged
        assert_eq!(t.nodes[0].children.len(), 1);
        let only = t.nodes[0].children[&1];
        assert_eq!(t.nodes[only].edge, [1, 2, 3, 4]);
        let before = t.nodes.len();
        t.insert(&[5, 6], 4);
        t.insert(&[5, 7], 5);
        assert_eq!(t.nodes.len(), before + 1, "the two freed nodes are reused, one is new");
        assert_eq!(t.get(&[1, 2, 3, 4]), Some(&1));
        assert_eq!(t.insert(&[], 6), None, "the empty key is the root's");
        assert_eq!(t.longest_prefix(&[8]), None, "the root's value is no prefix match");
    }

    /// Random inserts and removals over a 4-token alphabet against a map searched by brute
    /// force (a small xorshift generator: no dependency).
    #[test]
    fn random_programs_match_a_brute_force_map() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..200 {
            let mut t = RadixTree::default();
            let mut model: std::collections::HashMap<Vec<i32>, usize> = Default::default();
            let key = |next: &mut dyn FnMut(u64) -> u64| -> Vec<i32> {
                (0..1 + next(8)).map(|_| next(4) as i32).collect()
            };
            for i in 0..40 {
                let k = key(&mut next);
                if next(3) > 0 {
                    assert_eq!(t.insert(&k, i), model.insert(k, i));
                } else {
                    assert_eq!(t.remove(&k), model.remove(&k));
                }
                assert_eq!(t.len(), model.len());
            }
            for _ in 0..20 {
                let p = key(&mut next);
                let lcp = |k: &[i32]| k.iter().zip(&p).take_while(|(a, b)| a == b).count();
                let longest = model.iter().filter(|(k, _)| p.starts_with(k)).max_by_key(|(k, _)| k.len());
                assert_eq!(t.longest_prefix(&p), longest.map(|(k, v)| (k.len(), v)));
                assert_eq!(t.get(&p), model.get(&p));
                let deepest = model.keys().map(|k| lcp(k)).max().filter(|&d| d > 0);
                let got = t.deepest_match(&p);
                assert_eq!(got.map(|g| g.0), deepest);
                if let Some((d, v)) = got {
                    assert!(model.iter().any(|(k, w)| w == v && lcp(k) == d), "a key sharing {d}");
                }
            }
        }
    }
}
