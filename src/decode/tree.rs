//! The candidate tree of one speculative step and the verifier's walk down it: plain data, no tensors.
//!
//! Row 0 of a step's block is the root (the last committed token, not yet in the KV cache); the other tree
//! rows are draft tokens, each with a parent. [`accept`] walks from the root along the model's picks and
//! returns the accepted path and the bonus token. The tree keeps its child lists as intrusive linked lists,
//! so a step allocates no per-node vectors.

/// Sentinel for "no node" in the intrusive child lists (node 0 is a real node, so 0 cannot be used).
const NONE: usize = usize::MAX;

/// Candidate tree. Node 0 is the root: the last committed token, not yet in the KV cache.
///
/// Nodes are numbered in insertion order and a parent is always inserted before its children, so
/// `parent(n) < n`: row `n` of the block is node `n`, and ancestor rows always come first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenTree {
    tokens: Vec<u32>,
    /// `parents[0] == 0` (unused: the root has no parent).
    parents: Vec<usize>,
    depths: Vec<usize>,
    // Child lists in insertion order, as intrusive linked lists: `children` and `child_with_token` then cost
    // O(number of children) instead of a scan over the whole tree, with no per-node allocation.
    first_child: Vec<usize>,
    last_child: Vec<usize>,
    next_sibling: Vec<usize>,
}

impl TokenTree {
    /// A tree holding only the root token.
    pub fn new(root: u32) -> Self {
        TokenTree {
            tokens: vec![root],
            parents: vec![0],
            depths: vec![0],
            first_child: vec![NONE],
            last_child: vec![NONE],
            next_sibling: vec![NONE],
        }
    }

    /// A lone root with room for `capacity` nodes (root included).
    pub fn with_capacity(root: u32, capacity: usize) -> Self {
        let mut tree = TokenTree::new(root);
        let extra = capacity.saturating_sub(1);
        tree.tokens.reserve(extra);
        tree.parents.reserve(extra);
        tree.depths.reserve(extra);
        tree.first_child.reserve(extra);
        tree.last_child.reserve(extra);
        tree.next_sibling.reserve(extra);
        tree
    }

    /// Appends `token` as the last child of `parent` and returns the new node's index.
    ///
    /// Duplicate sibling tokens are allowed here (the builders below never create them); the walk then
    /// follows the first one.
    ///
    /// # Panics
    /// If `parent >= self.len()`.
    pub fn push(&mut self, parent: usize, token: u32) -> usize {
        assert!(
            parent < self.len(),
            "TokenTree::push: parent {parent} out of range (tree has {} nodes)",
            self.len()
        );
        let n = self.tokens.len();
        self.tokens.push(token);
        self.parents.push(parent);
        self.depths.push(self.depths[parent] + 1);
        self.first_child.push(NONE);
        self.last_child.push(NONE);
        self.next_sibling.push(NONE);
        match self.last_child[parent] {
            NONE => self.first_child[parent] = n,
            last => self.next_sibling[last] = n,
        }
        self.last_child[parent] = n;
        n
    }

    /// Number of nodes, root included (so never 0).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Always false: a tree holds at least its root. Present for API symmetry (and clippy).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The token of node `n`.
    pub fn token(&self, n: usize) -> u32 {
        self.tokens[n]
    }

    /// The parent of node `n`; `None` for the root.
    pub fn parent(&self, n: usize) -> Option<usize> {
        assert!(n < self.len(), "TokenTree::parent: node {n} out of range");
        (n != 0).then(|| self.parents[n])
    }

    /// Depth of node `n` (root = 0): also its position relative to the root.
    pub fn depth(&self, n: usize) -> usize {
        self.depths[n]
    }

    /// The deepest depth in the tree (0 for a lone root).
    pub fn max_depth(&self) -> usize {
        self.depths.iter().copied().max().unwrap_or(0)
    }

    /// All node tokens, in node (= row) order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The children of node `n`, in insertion order.
    pub fn children(&self, n: usize) -> impl Iterator<Item = usize> + '_ {
        let first = self.first_child[n];
        std::iter::successors((first != NONE).then_some(first), move |&c| {
            let next = self.next_sibling[c];
            (next != NONE).then_some(next)
        })
    }

    /// Node indices from the root to `n`, both included.
    pub fn path(&self, n: usize) -> Vec<usize> {
        let mut path = Vec::with_capacity(self.depths[n] + 1);
        let mut cur = n;
        path.push(cur);
        while cur != 0 {
            cur = self.parents[cur];
            path.push(cur);
        }
        path.reverse();
        path
    }

    /// The first child of `n` (in insertion order) carrying `token`.
    pub fn child_with_token(&self, n: usize, token: u32) -> Option<usize> {
        self.children(n).find(|&c| self.tokens[c] == token)
    }

    /// The parent of every node (`parents()[0] == 0` for the root): the tree's shape without its tokens,
    /// the key of a cached mask.
    pub fn parents(&self) -> &[usize] {
        &self.parents
    }
}

/// The verifier's walk, greedy or sample-matching: `target(n)` is the token the model picks after node `n`
/// (argmax, or a sample), computed lazily: it is called once for each node on the accepted path, root first,
/// so logits and random draws are spent only there. While some child of the current node carries the
/// target, move to it. Returns the accepted nodes (root excluded, in order) and the bonus token (the
/// target after the deepest accepted node, or after the root when nothing was accepted).
pub fn accept<E>(
    tree: &TokenTree,
    mut target: impl FnMut(usize) -> Result<u32, E>,
) -> Result<(Vec<usize>, u32), E> {
    let mut accepted = Vec::new();
    let mut cur = 0;
    loop {
        let t = target(cur)?;
        match tree.child_with_token(cur, t) {
            Some(child) => {
                accepted.push(child);
                cur = child;
            }
            None => return Ok((accepted, t)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_basics() {
        // root(10) -> a(11) -> c(13); root -> b(12)
        let mut t = TokenTree::new(10);
        assert_eq!(t.len(), 1);
        assert!(!t.is_empty());
        let a = t.push(0, 11);
        let b = t.push(0, 12);
        let c = t.push(a, 13);
        assert_eq!((a, b, c), (1, 2, 3));
        assert_eq!(t.tokens(), &[10, 11, 12, 13]);
        assert_eq!(t.parent(0), None);
        assert_eq!(t.parent(c), Some(a));
        assert_eq!(t.parent(b), Some(0));
        assert_eq!([t.depth(0), t.depth(a), t.depth(b), t.depth(c)], [0, 1, 1, 2]);
        assert_eq!(t.max_depth(), 2);
        assert_eq!(t.children(0).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(t.children(a).collect::<Vec<_>>(), vec![3]);
        assert_eq!(t.children(b).count(), 0);
        assert_eq!(t.path(c), vec![0, 1, 3]);
        assert_eq!(t.path(0), vec![0]);
        assert_eq!(t.child_with_token(0, 12), Some(2));
        assert_eq!(t.child_with_token(0, 13), None);
        assert_eq!(t.parents(), &[0, 0, 0, 1]);
    }

    #[test]
    fn child_with_token_takes_first_duplicate() {
        let mut t = TokenTree::new(1);
        let x = t.push(0, 5);
        let _y = t.push(0, 5);
        assert_eq!(t.child_with_token(0, 5), Some(x));
    }

    #[test]
    #[should_panic]
    fn push_rejects_missing_parent() {
        TokenTree::new(1).push(1, 2);
    }

    /// root(10) -> a(11) -> c(13); root -> b(12) -> d(14)
    fn walk_tree() -> TokenTree {
        let mut t = TokenTree::new(10);
        let a = t.push(0, 11);
        let b = t.push(0, 12);
        t.push(a, 13);
        t.push(b, 14);
        t
    }

    #[test]
    fn accept_no_acceptance() {
        let t = walk_tree();
        // The root's target 50 is no child: nothing accepted, 50 is the bonus token.
        assert_eq!(walk(&t, &[50, 0, 0, 0, 0]), (vec![], 50));
    }

    #[test]
    fn accept_full_path() {
        let t = walk_tree();
        // root -> 11 (a, node 1) -> 13 (c, node 3) -> leaf; the target after c (77) is the bonus.
        assert_eq!(walk(&t, &[11, 13, 0, 77, 0]), (vec![1, 3], 77));
    }

    #[test]
    fn accept_non_first_child() {
        let t = walk_tree();
        // root -> 12 (b, node 2, the second child) -> 14 (d, node 4) -> bonus 99.
        assert_eq!(walk(&t, &[12, 0, 14, 0, 99]), (vec![2, 4], 99));
        // Partial: b accepted, but b's target 15 matches no child of b.
        assert_eq!(walk(&t, &[12, 0, 15, 0, 99]), (vec![2], 15));
    }

    /// The walk with every node's target known in advance.
    fn walk(t: &TokenTree, targets: &[u32]) -> (Vec<usize>, u32) {
        accept(t, |n| Ok::<u32, ()>(targets[n])).unwrap()
    }

    #[test]
    fn accept_visits_only_the_path() {
        let t = walk_tree();
        let targets = [12, 13, 14, 0, 99];
        let mut visited = Vec::new();
        let res = accept(&t, |n| {
            visited.push(n);
            Ok::<u32, ()>(targets[n])
        });
        assert_eq!(res, Ok((vec![2, 4], 99)));
        assert_eq!(visited, vec![0, 2, 4]);
    }

    #[test]
    fn accept_passes_errors_on() {
        let t = walk_tree();
        let res = accept(&t, |n| if n == 2 { Err("no logits") } else { Ok(12) });
        assert_eq!(res, Err("no logits"));
    }
}
