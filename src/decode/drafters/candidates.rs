//! ESP's tree builders: from the mask tokens' candidate distributions to a [`TokenTree`], static (K_i per
//! depth) or dynamic (the paper's Algorithm 1, best-first by cumulative probability). Shared by ESP and the
//! hybrid.

use crate::decode::tree::TokenTree;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

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

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(list: &[(u32, f32)]) -> Candidates {
        list.to_vec()
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
        let mut next = crate::decode::drafters::test_rng(0x2545_f491_u64);
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
}
