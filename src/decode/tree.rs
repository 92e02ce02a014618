//! Candidate trees, probe rows and the block layout of one speculative step: plain data, no tensors.
//!
//! Every speculative step feeds the model one *block* of rows (see `docs/ARCHITECTURE.md`):
//! - rows `0..tree.len()` are the candidate tree: row 0 is the root (the last committed token, not yet in the
//!   KV cache), the other rows are draft tokens, each with a parent;
//! - then the *probe* rows (ESP's mask tokens, lookahead's window): their logits go back to the drafter and
//!   their KV entries are always dropped.
//!
//! This module builds:
//! - [`TokenTree`]: the candidate tree, plus [`static_tree`] and [`dynamic_tree`] (ESP Algorithm 1) that
//!   build it from the probes' candidate distributions;
//! - [`accept`]: the verifier's greedy / sample-matching walk down the tree;
//! - [`BlockLayout`]: relative positions and block-local visibility of every row, and the additive attention
//!   mask against the committed prefix; [`LayoutCache`] keeps layouts per tree shape (ESP's "static tree"
//!   optimisation: the block-local mask of a fixed shape never changes, only the prefix columns grow);
//! - [`block_complexity`] / [`node_budget`]: ESP's budget arithmetic.
//!
//! Everything here runs once per decoding step, so it avoids per-node allocations: the tree keeps its child
//! lists as intrusive linked lists, the walk allocates only its result, and masks are written into one
//! buffer.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

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

/// Probe rows: rows whose logits go back to the drafter and whose KV entries are always dropped. ESP's mask
/// token j (1..=k) of owner node n sits at position pos(n) + j and sees n's path (root..=n) and the probes
/// 1..=j of the same owner (itself included). A lookahead window is the same pattern owned by the root.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Probe {
    /// The tree node whose path the probe sees.
    pub owner: usize,
    /// Position offset from the owner, `>= 1`.
    pub offset: usize,
}

/// ESP's probes: `k` masks for every node, owners in node order: `[(0,1)..(0,k), (1,1)..(1,k), ...]`.
pub fn esp_probes(n_nodes: usize, k: usize) -> Vec<Probe> {
    let mut probes = Vec::with_capacity(n_nodes * k);
    for owner in 0..n_nodes {
        probes.extend((1..=k).map(|offset| Probe { owner, offset }));
    }
    probes
}

/// The block fed to the model: rows `0..tree.len()` are the tree nodes (row i = node i), then the probe rows
/// in the order given. Plain data: positions relative to the root (root = 0), and the block-local visibility.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    /// `n_nodes + probes.len()`.
    pub rows: usize,
    /// Number of tree rows (they come first).
    pub n_nodes: usize,
    /// Position of each row relative to the root; absolute position = root position + this.
    pub rel_positions: Vec<u32>,
    /// `rows x rows`, row-major: `visible[r * rows + c]` is true when row r may attend to row c.
    pub visible: Vec<bool>,
    /// The probe of row `n_nodes + i` is `probes[i]`.
    pub probes: Vec<Probe>,
}

/// Builds the block layout of `tree` followed by `probes`.
///
/// Tree nodes see their ancestors and themselves; a probe `(n, j)` sees `path(n)` and the probes `(n, i)`
/// with `i <= j` that are in the list (itself included).
///
/// # Panics
/// If a probe's owner is not a node, its offset is 0, or a probe appears twice.
pub fn layout(tree: &TokenTree, probes: &[Probe]) -> BlockLayout {
    let n_nodes = tree.len();
    let rows = n_nodes + probes.len();
    let mut visible = vec![false; rows * rows];

    // Tree rows: a node's ancestors are a prefix-closed set of lower rows, so its row is its parent's row
    // (only the first `n` columns can be set there) plus itself.
    for n in 0..n_nodes {
        if n != 0 {
            let p = tree.parents[n];
            visible.copy_within(p * rows..p * rows + n, n * rows);
        }
        visible[n * rows + n] = true;
    }

    let mut rel_positions: Vec<u32> = tree.depths.iter().map(|&d| d as u32).collect();
    rel_positions.reserve(probes.len());
    for (i, probe) in probes.iter().enumerate() {
        let Probe { owner, offset } = *probe;
        assert!(
            owner < n_nodes,
            "probe {probe:?}: owner is not a node ({n_nodes} nodes)"
        );
        assert!(offset >= 1, "probe {probe:?}: offset must be >= 1");
        let r = n_nodes + i;
        rel_positions.push((tree.depths[owner] + offset) as u32);
        // The owner's path = the owner's own tree row (columns 0..=owner).
        visible.copy_within(owner * rows..owner * rows + owner + 1, r * rows);
        // Probes of the same owner with an offset up to ours. Quadratic in the number of probes, but it
        // only runs on a cache miss and the probe count is small (k per node, or one lookahead window).
        for (i2, other) in probes.iter().enumerate() {
            if other.owner == owner && other.offset <= offset {
                assert!(other.offset != offset || i2 == i, "probe {probe:?} appears twice");
                visible[r * rows + n_nodes + i2] = true;
            }
        }
    }

    BlockLayout {
        rows,
        n_nodes,
        rel_positions,
        visible,
        probes: probes.to_vec(),
    }
}

impl BlockLayout {
    /// Row index of probe `(owner, offset)`, if present.
    pub fn probe_row(&self, owner: usize, offset: usize) -> Option<usize> {
        self.probes
            .iter()
            .position(|p| p.owner == owner && p.offset == offset)
            .map(|i| self.n_nodes + i)
    }

    /// The additive mask of the whole block against `cached` committed rows, written into `out` (cleared
    /// first; its capacity is kept): `[rows, cached + rows]` f32, row-major; 0.0 where visible,
    /// `f32::NEG_INFINITY` where not. Committed prefix columns are always visible.
    pub fn additive_mask_into(&self, cached: usize, out: &mut Vec<f32>) {
        let rows = self.rows;
        let width = cached + rows;
        out.clear();
        // One zero fill (a memset) covers the prefix and the visible entries; then only the hidden
        // block-local entries are written.
        out.resize(rows * width, 0.0);
        for (r, vis_row) in self.visible.chunks_exact(rows).enumerate() {
            let block = &mut out[r * width + cached..(r + 1) * width];
            for (dst, &vis) in block.iter_mut().zip(vis_row) {
                if !vis {
                    *dst = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// The "static tree" optimisation of ESP: the block-local part of the mask never changes for a fixed tree
/// shape and probe list, so layouts are kept per (shape, probes) key; only the prefix columns grow, which
/// [`BlockLayout::additive_mask`] adds. Bounded: the map is cleared when it would exceed its entry limit
/// (the shapes a drafter produces repeat, so a full clear is rare and cheap).
#[derive(Debug)]
pub struct LayoutCache {
    map: HashMap<Vec<usize>, Arc<BlockLayout>>,
    max_entries: usize,
    /// Reused buffer holding the encoded key of the current lookup, so a hit allocates nothing.
    scratch: Vec<usize>,
    hits: u64,
    misses: u64,
}

impl Default for LayoutCache {
    fn default() -> Self {
        Self::new()
    }
}

impl LayoutCache {
    /// Default bound on the number of cached layouts.
    pub const DEFAULT_MAX_ENTRIES: usize = 64;

    /// A cache holding at most [`LayoutCache::DEFAULT_MAX_ENTRIES`] layouts.
    pub fn new() -> Self {
        Self::with_max_entries(Self::DEFAULT_MAX_ENTRIES)
    }

    /// A cache holding at most `max_entries` layouts (at least 1).
    pub fn with_max_entries(max_entries: usize) -> Self {
        LayoutCache {
            map: HashMap::new(),
            max_entries: max_entries.max(1),
            scratch: Vec::new(),
            hits: 0,
            misses: 0,
        }
    }

    /// The layout of `tree` + `probes`, computed only when this (shape, probes) key was not seen before.
    /// Tokens do not matter: two trees with the same parents vector share a layout.
    pub fn get(&mut self, tree: &TokenTree, probes: &[Probe]) -> Arc<BlockLayout> {
        // Key encoding: [n_nodes, parents..., owner0, offset0, owner1, offset1, ...]. The leading length
        // makes it unambiguous (where the parents end and the probes start).
        self.scratch.clear();
        self.scratch.reserve(1 + tree.len() + 2 * probes.len());
        self.scratch.push(tree.len());
        self.scratch.extend_from_slice(tree.parents());
        for p in probes {
            self.scratch.push(p.owner);
            self.scratch.push(p.offset);
        }
        if let Some(hit) = self.map.get(self.scratch.as_slice()) {
            self.hits += 1;
            return Arc::clone(hit);
        }
        self.misses += 1;
        let built = Arc::new(layout(tree, probes));
        if self.map.len() >= self.max_entries {
            self.map.clear();
        }
        self.map.insert(self.scratch.clone(), Arc::clone(&built));
        built
    }

    /// Lookups answered from the cache.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Lookups that built a new layout.
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// Number of layouts currently cached.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no layout is cached.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Candidate distributions from probes: for depth d (1-based), a list of (token, probability) sorted by
/// probability descending (the top-N of a softmax; N >= the largest budget asked for).
pub type Candidates = Vec<(u32, f32)>;

/// Static tree: depth i (1..=`branches.len()`) gets `branches[i-1]` candidates from `dists[i-1]`; only the
/// top-1 node of each depth gets children. Pruning (docs/ESP.md): a candidate equal to its parent's token is
/// skipped and the next best of the same distribution takes its place. Depths beyond `dists.len()` are not
/// built. Duplicate tokens among siblings are never added. A depth that gets no node ends the tree.
pub fn static_tree(root: u32, dists: &[Candidates], branches: &[usize]) -> TokenTree {
    let total: usize = branches.iter().take(dists.len()).sum();
    let mut tree = TokenTree::with_capacity(root, 1 + total);
    let mut parent = 0;
    for (dist, &k) in dists.iter().zip(branches) {
        let parent_token = tree.token(parent);
        let mut top = None;
        let mut taken = 0;
        for &(token, _) in dist {
            if taken == k {
                break;
            }
            if token == parent_token || tree.child_with_token(parent, token).is_some() {
                continue;
            }
            let n = tree.push(parent, token);
            top.get_or_insert(n);
            taken += 1;
        }
        match top {
            Some(n) => parent = n,
            None => break,
        }
    }
    tree
}

/// One frontier entry of [`dynamic_tree`]: candidate `rank` of the distribution of depth
/// `depth(parent) + 1`, under `parent`, with cumulative score `P(parent) * p`.
#[derive(Clone, Copy, Debug)]
struct Frontier {
    score: f64,
    parent: usize,
    rank: usize,
}

impl Ord for Frontier {
    /// Max-heap order: higher score first; ties go to the earlier-inserted parent, then the lower rank, so
    /// the result does not depend on heap internals.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.parent.cmp(&self.parent))
            .then_with(|| other.rank.cmp(&self.rank))
    }
}

impl PartialOrd for Frontier {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Frontier {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Frontier {}

/// Dynamic tree (ESP Algorithm 1): best-first by cumulative probability. A candidate c at depth d under node
/// n (depth d-1) scores `P(n) * p_d(c)`, with `P(root) = 1`. Keeps the `budget` best nodes overall, max depth
/// `dists.len()`, with parent-equal pruning and no duplicate siblings (as [`static_tree`]). Nodes are
/// numbered in the order they were chosen (best first). Ties: earlier parent, then lower rank.
///
/// Frontier: each node, once added, pushes its best child candidate; each popped candidate (added or pruned)
/// pushes its next sibling candidate. With probabilities in [0, 1] every pushed score is <= the popped one,
/// so the pops come out in non-increasing score order: the first `budget` accepted pops are the best nodes,
/// and a node is always added after its parent.
pub fn dynamic_tree(root: u32, dists: &[Candidates], budget: usize) -> TokenTree {
    // The budget may be "everything" (usize::MAX): reserve no more than the full tree could hold, and
    // not absurdly much either (the vectors still grow past it if needed).
    let mut reachable = 0usize;
    let mut level = 1usize;
    for d in dists {
        level = level.saturating_mul(d.len());
        reachable = reachable.saturating_add(level);
    }
    let reserve = budget.min(reachable).min(4096);
    let mut tree = TokenTree::with_capacity(root, 1 + reserve);
    if budget == 0 || dists.is_empty() {
        return tree;
    }
    // Cumulative probability of each node (f64: products of a few f32 probabilities stay exact enough).
    let mut cum: Vec<f64> = Vec::with_capacity(1 + reserve);
    cum.push(1.0);
    // A NaN probability would poison the ordering; treat it as 0.
    let prob = |p: f32| if p.is_nan() { 0.0 } else { f64::from(p) };

    let mut heap = BinaryHeap::with_capacity(2 * reserve + 1);
    if let Some(&(_, p)) = dists[0].first() {
        heap.push(Frontier {
            score: prob(p),
            parent: 0,
            rank: 0,
        });
    }
    while tree.len() <= budget {
        let Some(Frontier { score, parent, rank }) = heap.pop() else {
            break;
        };
        let depth = tree.depth(parent) + 1;
        let dist = &dists[depth - 1];
        // The next sibling candidate takes this one's place in the frontier, whether or not it is added.
        if let Some(&(_, p)) = dist.get(rank + 1) {
            heap.push(Frontier {
                score: cum[parent] * prob(p),
                parent,
                rank: rank + 1,
            });
        }
        let token = dist[rank].0;
        if token == tree.token(parent) || tree.child_with_token(parent, token).is_some() {
            continue; // pruned: its next sibling is already in the frontier
        }
        let n = tree.push(parent, token);
        cum.push(score);
        if let Some(&(_, p)) = dists.get(depth).and_then(|d| d.first()) {
            heap.push(Frontier {
                score: score * prob(p),
                parent: n,
                rank: 0,
            });
        }
    }
    tree
}

/// Block complexity of ESP: every token in the forward, masks included: `(k + 1) * (1 + sum K_i)`.
pub fn block_complexity(k: usize, branches: &[usize]) -> usize {
    (k + 1) * (1 + branches.iter().sum::<usize>())
}

/// Largest block complexity `--bc` takes: rows per forward pass, far above any useful setting.
pub const MAX_BC: usize = 1024;

/// Node budget (`sum K_i`) for a block complexity: `BC / (k + 1) - 1` (rounded down). The smallest useful BC
/// is `2 (k + 1)`: the root and one draft node, each with its k masks.
pub fn node_budget(bc: usize, k: usize) -> Result<usize, String> {
    let min = 2 * (k + 1);
    if bc < min {
        return Err(format!(
            "--bc {bc} is too small for --masks {k}: needs at least {min} \
             (the root and one draft token, each with {k} mask(s))"
        ));
    }
    if bc > MAX_BC {
        return Err(format!("--bc {bc} is too large: it must be in {min}..={MAX_BC}"));
    }
    Ok(bc / (k + 1) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(owner: usize, offset: usize) -> Probe {
        Probe { owner, offset }
    }

    /// A `rows x rows` visibility matrix from, for each row, the list of visible columns.
    fn matrix(rows_visible: &[&[usize]]) -> Vec<bool> {
        let rows = rows_visible.len();
        let mut m = vec![false; rows * rows];
        for (r, cols) in rows_visible.iter().enumerate() {
            for &c in cols.iter() {
                m[r * rows + c] = true;
            }
        }
        m
    }

    fn cands(list: &[(u32, f32)]) -> Candidates {
        list.to_vec()
    }

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

    #[test]
    fn layout_k1_two_children() {
        // root(0) -> {a(1), b(2)}; probes (0,1),(1,1),(2,1) in rows 3, 4, 5.
        let mut t = TokenTree::new(100);
        t.push(0, 101);
        t.push(0, 102);
        let l = layout(&t, &esp_probes(3, 1));
        assert_eq!(l.rows, 6);
        assert_eq!(l.n_nodes, 3);
        // Positions: root 0; a, b depth 1; mask of root 0+1; masks of a and b 1+1.
        assert_eq!(l.rel_positions, vec![0, 1, 1, 1, 2, 2]);
        #[rustfmt::skip]
        let expected = vec![
            // cols:  r      a      b      m(r)   m(a)   m(b)
            /* r   */ true,  false, false, false, false, false,
            /* a   */ true,  true,  false, false, false, false,
            /* b   */ true,  false, true,  false, false, false,
            /* m(r)*/ true,  false, false, true,  false, false,
            /* m(a)*/ true,  true,  false, false, true,  false,
            /* m(b)*/ true,  false, true,  false, false, true,
        ];
        assert_eq!(l.visible, expected);
        assert_eq!(l.probe_row(0, 1), Some(3));
        assert_eq!(l.probe_row(2, 1), Some(5));
        assert_eq!(l.probe_row(2, 2), None);
        assert_eq!(l.rel_positions, vec![0, 1, 1, 1, 2, 2]);
    }

    #[test]
    fn layout_k2_static_tree() {
        // static K=[2,1]: root(50) -> a(1), b(2) from depth 1; only a (top-1) gets the depth-2 child c(3).
        let d1 = cands(&[(60, 0.5), (61, 0.3), (62, 0.1)]);
        let d2 = cands(&[(70, 0.4), (71, 0.2)]);
        let t = static_tree(50, &[d1, d2], &[2, 1]);
        assert_eq!(t.tokens(), &[50, 60, 61, 70]);
        assert_eq!(t.parents(), &[0, 0, 0, 1]);
        let probes = esp_probes(4, 2);
        assert_eq!(
            probes,
            vec![
                p(0, 1),
                p(0, 2),
                p(1, 1),
                p(1, 2),
                p(2, 1),
                p(2, 2),
                p(3, 1),
                p(3, 2)
            ]
        );
        let l = layout(&t, &probes);
        assert_eq!(l.rows, 12);
        // Nodes: depths 0,1,1,2. Masks j of node n at depth(n)+j: root 1,2; a 2,3; b 2,3; c 3,4.
        assert_eq!(l.rel_positions, vec![0, 1, 1, 2, 1, 2, 2, 3, 2, 3, 3, 4]);
        let expected = matrix(&[
            &[0],               // 0 root
            &[0, 1],            // 1 a
            &[0, 2],            // 2 b
            &[0, 1, 3],         // 3 c
            &[0, 4],            // 4 mask1(root)
            &[0, 4, 5],         // 5 mask2(root)
            &[0, 1, 6],         // 6 mask1(a)
            &[0, 1, 6, 7],      // 7 mask2(a): root, a, mask1(a), itself
            &[0, 2, 8],         // 8 mask1(b)
            &[0, 2, 8, 9],      // 9 mask2(b)
            &[0, 1, 3, 10],     // 10 mask1(c)
            &[0, 1, 3, 10, 11], // 11 mask2(c)
        ]);
        assert_eq!(l.visible, expected);
        assert_eq!(l.probe_row(1, 2), Some(7));
        assert_eq!(l.probe_row(3, 1), Some(10));
    }

    #[test]
    fn layout_probe_subset_and_order() {
        // Only the masks of node 1, listed in reverse order: mask 2 still sees mask 1 (wherever it sits).
        let mut t = TokenTree::new(1);
        t.push(0, 2);
        let l = layout(&t, &[p(1, 2), p(1, 1)]);
        assert_eq!(l.rel_positions, vec![0, 1, 3, 2]);
        let expected = matrix(&[&[0], &[0, 1], &[0, 1, 2, 3], &[0, 1, 3]]);
        assert_eq!(l.visible, expected);
        assert_eq!(l.probe_row(1, 1), Some(3));
    }

    #[test]
    #[should_panic]
    fn layout_rejects_duplicate_probe() {
        layout(&TokenTree::new(1), &[p(0, 1), p(0, 1)]);
    }

    #[test]
    fn additive_mask_with_prefix() {
        let mut t = TokenTree::new(100);
        t.push(0, 101);
        t.push(0, 102);
        let l = layout(&t, &esp_probes(3, 1));
        let ninf = f32::NEG_INFINITY;
        let mut m = vec![1.0; 2];
        l.additive_mask_into(3, &mut m);
        assert_eq!(m.len(), 6 * 9);
        // Rows: 3 prefix zeros, then the k=1 visibility above as 0 / -inf.
        #[rustfmt::skip]
        let expected = vec![
            0.0, 0.0, 0.0,  0.0,  ninf, ninf, ninf, ninf, ninf,
            0.0, 0.0, 0.0,  0.0,  0.0,  ninf, ninf, ninf, ninf,
            0.0, 0.0, 0.0,  0.0,  ninf, 0.0,  ninf, ninf, ninf,
            0.0, 0.0, 0.0,  0.0,  ninf, ninf, 0.0,  ninf, ninf,
            0.0, 0.0, 0.0,  0.0,  0.0,  ninf, ninf, 0.0,  ninf,
            0.0, 0.0, 0.0,  0.0,  ninf, 0.0,  ninf, ninf, 0.0,
        ];
        assert_eq!(m, expected);
        for r in 0..6 {
            assert!(m[r * 9..r * 9 + 3].iter().all(|&x| x == 0.0));
        }
        // The block-local part alone, and buffer reuse (a larger stale buffer is cleared).
        let mut buf = vec![1.0; 1000];
        l.additive_mask_into(0, &mut buf);
        assert_eq!(buf.len(), 36);
        for r in 0..6 {
            assert_eq!(&buf[r * 6..r * 6 + 6], &expected[r * 9 + 3..r * 9 + 9]);
        }
        l.additive_mask_into(3, &mut buf);
        assert_eq!(buf, expected);
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

    #[test]
    fn static_tree_pruning() {
        // Root token 5. Depth 1: 5 equals the root -> skipped, so K=2 takes 7 and 8.
        // Top-1 at depth 1 is 7. Depth 2: 7 equals its parent -> skipped, K=1 takes 9.
        let d1 = cands(&[(5, 0.5), (7, 0.3), (8, 0.1), (4, 0.05)]);
        let d2 = cands(&[(7, 0.6), (9, 0.2), (3, 0.1)]);
        let t = static_tree(5, &[d1.clone(), d2.clone()], &[2, 1]);
        assert_eq!(t.tokens(), &[5, 7, 8, 9]);
        assert_eq!(t.parents(), &[0, 0, 0, 1]);
        // Branches beyond the dists: the third depth is not built.
        let t2 = static_tree(5, &[d1.clone(), d2], &[2, 1, 3]);
        assert_eq!(t2, t);
        // More dists than branches: only branches.len() depths.
        let t3 = static_tree(5, &[d1.clone(), cands(&[(1, 0.9)])], &[3]);
        assert_eq!(t3.tokens(), &[5, 7, 8, 4]);
        assert_eq!(t3.max_depth(), 1);
    }

    #[test]
    fn static_tree_no_duplicate_siblings_and_short_lists() {
        // A duplicated token in the list is taken once; the list runs out before K=4.
        let d1 = cands(&[(7, 0.5), (7, 0.2), (8, 0.1)]);
        let t = static_tree(1, &[d1], &[4]);
        assert_eq!(t.tokens(), &[1, 7, 8]);
        // A depth with no candidate left ends the tree.
        let t = static_tree(1, &[cands(&[(1, 0.9)]), cands(&[(2, 0.9)])], &[1, 1]);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn dynamic_tree_best_first() {
        // d1: 1 (0.6), 2 (0.1), 3 (0.05); d2: 4 (0.5), 5 (0.3), 6 (0.1). Root token 0.
        // Scores: depth 1: 1 -> 0.6, 2 -> 0.1, 3 -> 0.05.
        //         under node "1": 4 -> 0.6*0.5 = 0.30, 5 -> 0.6*0.3 = 0.18, 6 -> 0.6*0.1 = 0.06.
        //         under node "2": 4 -> 0.1*0.5 = 0.05, ...
        // Best-first: 1 (0.6), 1/4 (0.30), 1/5 (0.18), 2 (0.1), 1/6 (0.06), then a tie at 0.05 between
        // root/3 and 2/4 (0.1*0.5 is exact in binary): the earlier parent (root) wins, then 2/4.
        let dists = [
            cands(&[(1, 0.6), (2, 0.1), (3, 0.05)]),
            cands(&[(4, 0.5), (5, 0.3), (6, 0.1)]),
        ];
        let t = dynamic_tree(0, &dists, 3);
        // Two depth-2 children of "1" are chosen over the weak depth-1 sibling "2".
        assert_eq!(t.tokens(), &[0, 1, 4, 5]);
        assert_eq!(t.parents(), &[0, 0, 1, 1]);
        let t = dynamic_tree(0, &dists, 4);
        assert_eq!(t.tokens(), &[0, 1, 4, 5, 2]);
        assert_eq!(t.parents(), &[0, 0, 1, 1, 0]);
        let t = dynamic_tree(0, &dists, 5);
        assert_eq!(t.tokens(), &[0, 1, 4, 5, 2, 6]);
        let t = dynamic_tree(0, &dists, 7);
        assert_eq!(t.tokens(), &[0, 1, 4, 5, 2, 6, 3, 4]);
        assert_eq!(t.parents(), &[0, 0, 1, 1, 0, 1, 0, 4]);
        // Budget respected for every budget; never deeper than dists.len().
        for budget in 0..20 {
            let t = dynamic_tree(0, &dists, budget);
            assert!(t.len() - 1 <= budget);
            assert!(t.max_depth() <= 2);
        }
        // All candidates: 3 depth-1 nodes, each with 3 children = 12 nodes.
        assert_eq!(dynamic_tree(0, &dists, 100).len(), 13);
    }

    #[test]
    fn dynamic_tree_pruning() {
        // Root token 1: the depth-1 candidate 1 is pruned, 2 (0.2) takes its place.
        // Under node "2" (P=0.2): 2 is pruned, so 3 (0.2*0.4=0.08) is its best child.
        let dists = [
            cands(&[(1, 0.7), (2, 0.2), (9, 0.01)]),
            cands(&[(2, 0.5), (3, 0.4)]),
        ];
        let t = dynamic_tree(1, &dists, 2);
        assert_eq!(t.tokens(), &[1, 2, 3]);
        assert_eq!(t.parents(), &[0, 0, 1]);
        // Budget 5: next best is 9 at depth 1 (0.01); node "9" then has children 2 and 3.
        let t = dynamic_tree(1, &dists, 5);
        assert_eq!(t.tokens(), &[1, 2, 3, 9, 2, 3]);
        assert_eq!(t.parents(), &[0, 0, 1, 0, 3, 3]);
    }

    #[test]
    fn dynamic_tree_one_depth_equals_static() {
        let d1 = cands(&[(3, 0.4), (8, 0.3), (3, 0.1), (5, 0.1), (9, 0.05), (2, 0.05)]);
        for root in [3, 8, 42] {
            for budget in 0..8 {
                assert_eq!(
                    dynamic_tree(root, std::slice::from_ref(&d1), budget),
                    static_tree(root, std::slice::from_ref(&d1), &[budget]),
                    "root {root} budget {budget}"
                );
            }
        }
        assert_eq!(dynamic_tree(7, &[], 5).len(), 1);
    }

    /// Cumulative probability of every node of `tree` under `dists` (ranks looked up by token).
    fn cumulative(tree: &TokenTree, dists: &[Candidates]) -> Vec<f64> {
        let mut cum = vec![1.0f64; tree.len()];
        for n in 1..tree.len() {
            let d = &dists[tree.depth(n) - 1];
            let pr = d.iter().find(|c| c.0 == tree.token(n)).unwrap().1;
            cum[n] = cum[tree.parent(n).unwrap()] * f64::from(pr);
        }
        cum
    }

    #[test]
    fn dynamic_tree_keeps_the_best_nodes() {
        // Against brute force: the full tree (every non-pruned candidate to depth 3) ranked by cumulative
        // probability; the dynamic tree of budget B must hold exactly the B best scores.
        let mut seed = 0x2545_f491_u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for _case in 0..50 {
            let dists: Vec<Candidates> = (0..3)
                .map(|_| {
                    // 5 distinct tokens out of 0..8 (so parent-equal pruning happens), random weights.
                    let mut toks: Vec<u32> = (0..8).collect();
                    for i in (1..toks.len()).rev() {
                        toks.swap(i, next() as usize % (i + 1));
                    }
                    let w: Vec<f32> = (0..5).map(|_| 1.0 + (next() % 1000) as f32).collect();
                    let sum: f32 = w.iter().sum();
                    let mut d: Candidates = toks[..5].iter().zip(&w).map(|(&t, &x)| (t, x / sum)).collect();
                    d.sort_by(|a, b| b.1.total_cmp(&a.1));
                    d
                })
                .collect();
            let root = next() % 8;
            let full = dynamic_tree(root, &dists, usize::MAX / 4);
            let mut all = cumulative(&full, &dists)[1..].to_vec();
            all.sort_by(|a, b| b.total_cmp(a));
            for budget in [1, 3, 7, 15, 40] {
                let t = dynamic_tree(root, &dists, budget);
                assert_eq!(t.len() - 1, budget.min(all.len()));
                for n in 1..t.len() {
                    assert_ne!(t.token(n), t.token(t.parent(n).unwrap()), "parent-equal pruning");
                }
                let mut got = cumulative(&t, &dists)[1..].to_vec();
                got.sort_by(|a, b| b.total_cmp(a));
                assert_eq!(got, all[..got.len()], "budget {budget}");
            }
        }
    }

    #[test]
    fn budget_arithmetic() {
        assert_eq!(block_complexity(1, &[4]), 10);
        assert_eq!(block_complexity(1, &[14]), 30);
        assert_eq!(block_complexity(2, &[15, 4]), 60);
        assert_eq!(block_complexity(1, &[29]), 60);
        assert_eq!(node_budget(30, 1), Ok(14));
        assert_eq!(node_budget(60, 2), Ok(19));
        assert_eq!(node_budget(10, 1), Ok(4));
        assert_eq!(node_budget(4, 1), Ok(1));
        let err = node_budget(3, 1).unwrap_err();
        assert!(
            err.contains("--bc 3 is too small for --masks 1: needs at least 4"),
            "{err}"
        );
        assert!(node_budget(5, 2).is_err());
        assert_eq!(node_budget(6, 2), Ok(1));
    }

    #[test]
    fn layout_cache_hits_and_misses() {
        let mut cache = LayoutCache::new();
        let d1 = cands(&[(60, 0.5), (61, 0.3)]);
        let t1 = static_tree(50, &[d1], &[2]);
        let probes = esp_probes(t1.len(), 1);
        let a = cache.get(&t1, &probes);
        assert_eq!((cache.hits(), cache.misses()), (0, 1));
        let b = cache.get(&t1, &probes);
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!((cache.hits(), cache.misses()), (1, 1));
        // Same shape, other tokens: a hit.
        let t2 = static_tree(1, &[cands(&[(2, 0.5), (3, 0.3)])], &[2]);
        let c = cache.get(&t2, &probes);
        assert!(Arc::ptr_eq(&a, &c));
        assert_eq!((cache.hits(), cache.misses()), (2, 1));
        // Other probes: a miss.
        let d = cache.get(&t1, &esp_probes(t1.len(), 2));
        assert_eq!(d.rows, 9);
        assert_eq!((cache.hits(), cache.misses()), (2, 2));
        // Other shape (a chain of the same length): a miss, and the right layout.
        let mut chain = TokenTree::new(1);
        chain.push(0, 2);
        chain.push(1, 3);
        let e = cache.get(&chain, &probes);
        assert_eq!(*e, layout(&chain, &probes));
        assert_eq!((cache.hits(), cache.misses()), (2, 3));
        assert_eq!(cache.len(), 3);
        // The cached layout equals a fresh one.
        assert_eq!(*a, layout(&t1, &probes));
    }

    #[test]
    fn layout_cache_is_bounded() {
        let mut cache = LayoutCache::with_max_entries(2);
        let trees: Vec<TokenTree> = (1..=3)
            .map(|n| {
                let mut t = TokenTree::new(0);
                for i in 0..n {
                    t.push(0, i + 1);
                }
                t
            })
            .collect();
        for t in &trees {
            cache.get(t, &[]);
        }
        // The third insert found the cache full and cleared it.
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.misses(), 3);
        cache.get(&trees[2], &[]);
        assert_eq!(cache.hits(), 1);
        cache.get(&trees[0], &[]);
        assert_eq!(cache.misses(), 4);
    }
}
