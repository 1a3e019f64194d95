//! The branch tree: parent/children links, RESTRICT checks and iterative post-order walks.

use std::collections::HashMap;

use crate::tenancy::Handle;

#[derive(Debug, Clone, Default)]
struct Node {
    parent: Option<Handle>,
    children: Vec<Handle>,
}

/// Parent/children links of every live branch.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    nodes: HashMap<Handle, Node>,
}

impl Topology {
    /// Add a node under `parent` (or as a root).
    pub fn add(&mut self, handle: Handle, parent: Option<Handle>) {
        if let Some(p) = parent {
            if let Some(n) = self.nodes.get_mut(&p) {
                n.children.push(handle);
            }
        }
        self.nodes.insert(handle, Node { parent, children: Vec::new() });
    }

    /// Parent of a node.
    pub fn parent(&self, handle: Handle) -> Option<Handle> {
        self.nodes.get(&handle).and_then(|n| n.parent)
    }

    /// Children of a node, in creation order.
    pub fn children(&self, handle: Handle) -> &[Handle] {
        self.nodes.get(&handle).map(|n| n.children.as_slice()).unwrap_or(&[])
    }

    /// Remove a leaf (callers enforce RESTRICT first); unlinks it from its parent.
    pub fn remove(&mut self, handle: Handle) {
        if let Some(node) = self.nodes.remove(&handle) {
            if let Some(p) = node.parent.and_then(|p| self.nodes.get_mut(&p)) {
                p.children.retain(|&c| c != handle);
            }
        }
    }

    /// `root` and every descendant, children before parents (iterative: no recursion limit).
    pub fn post_order(&self, root: Handle) -> Vec<Handle> {
        let mut out = Vec::new();
        let mut stack = vec![(root, false)];
        while let Some((h, expanded)) = stack.pop() {
            if expanded {
                out.push(h);
                continue;
            }
            stack.push((h, true));
            for &c in self.children(h).iter().rev() {
                stack.push((c, false));
            }
        }
        out
    }

    /// Keep only `root` as a parentless, childless node.
    pub fn retain_only(&mut self, root: Handle) {
        self.nodes.clear();
        self.nodes.insert(root, Node::default());
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn post_order_children_first() {
        let mut t = Topology::default();
        t.add(1, None);
        t.add(2, Some(1));
        t.add(3, Some(2));
        t.add(4, Some(1));
        assert_eq!(t.post_order(1), vec![3, 2, 4, 1]);
        assert_eq!(t.children(1), &[2, 4]);
        t.remove(3);
        assert!(t.children(2).is_empty());
        assert_eq!(t.parent(2), Some(1));
    }

    #[test]
    fn deep_chain_has_no_recursion_limit() {
        let mut t = Topology::default();
        t.add(0, None);
        for i in 1..200_000u64 {
            t.add(i, Some(i - 1));
        }
        let order = t.post_order(0);
        assert_eq!(order.len(), 200_000);
        assert_eq!(order[0], 199_999);
        assert_eq!(*order.last().unwrap(), 0);
    }

    #[test]
    fn retain_only_makes_a_root() {
        let mut t = Topology::default();
        t.add(1, None);
        t.add(2, Some(1));
        t.retain_only(2);
        assert_eq!(t.parent(2), None);
        assert_eq!(t.len(), 1);
    }
}
