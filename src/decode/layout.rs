//! The block of one speculative step: which rows it holds (the tree's nodes, then probe rows), where they
//! sit, what each may see, and the additive attention mask against the committed prefix. Plain data, no
//! tensors.
//!
//! Probe rows (ESP's mask tokens, lookahead's window) are rows whose logits go back to the drafter and
//! whose KV entries are always dropped. [`LayoutCache`] keeps a layout per tree shape: ESP's "static tree"
//! optimisation, since the block-local mask of a fixed shape never changes, only the prefix columns grow.

use super::tree::TokenTree;
use std::collections::HashMap;
use std::sync::Arc;

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
            let p = tree.parents()[n];
            visible.copy_within(p * rows..p * rows + n, n * rows);
        }
        visible[n * rows + n] = true;
    }

    let mut rel_positions: Vec<u32> = (0..tree.len()).map(|n| tree.depth(n) as u32).collect();
    rel_positions.reserve(probes.len());
    for (i, probe) in probes.iter().enumerate() {
        let Probe { owner, offset } = *probe;
        assert!(
            owner < n_nodes,
            "probe {probe:?}: owner is not a node ({n_nodes} nodes)"
        );
        assert!(offset >= 1, "probe {probe:?}: offset must be >= 1");
        let r = n_nodes + i;
        rel_positions.push((tree.depth(owner) + offset) as u32);
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
/// [`BlockLayout::additive_mask_into`] adds. Bounded: the map is cleared when it would exceed its entry limit
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::drafters::candidates::{static_tree, Candidates};

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
