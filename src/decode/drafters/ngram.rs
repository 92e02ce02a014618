//! N-gram helpers shared by the training-free drafters: prompt lookup (the continuation after an earlier
//! occurrence of the last n tokens), an n-gram pool (lookahead decoding's store of (N-1)-token continuations
//! keyed by their first token), and merging token chains into a [`TokenTree`] as a trie.
//!
//! Plain data, no tensors; everything here runs once per decoding step on a few thousand tokens at most.

use crate::decode::tree::TokenTree;
use std::collections::HashMap;

/// One prompt-lookup match: the last `n` tokens of the history also occur at `start..start + n`, and
/// `continuation` is what followed them there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Match<'a> {
    /// Length of the matched suffix.
    pub n: usize,
    /// Where the earlier occurrence starts in the history.
    pub start: usize,
    /// The tokens after that occurrence (at least one, at most the asked-for length).
    pub continuation: &'a [u32],
}

/// Prompt Lookup Decoding's matcher: the last `n` tokens of `history` (n = `max_n` down to 1) searched
/// among the earlier positions of `history`, the most recent occurrence with at least one following token
/// first. Returns the longest match found (largest n), with up to `max_len` following tokens; `None` when no
/// suffix of length 1..=max_n occurs earlier, or `max_len` is 0.
///
/// The continuation may run into the suffix itself (a repeated pattern drafts its own repetition).
pub fn lookup(history: &[u32], max_n: usize, max_len: usize) -> Option<Match<'_>> {
    (1..=max_n)
        .rev()
        .find_map(|n| matches_of(history, n, max_len).next())
}

/// Every earlier occurrence of the last `n` tokens of `history`, most recent first, each with up to
/// `max_len` following tokens (at least one).
pub fn matches_of(history: &[u32], n: usize, max_len: usize) -> impl Iterator<Item = Match<'_>> + '_ {
    let len = history.len();
    // An occurrence must start at most at len - n - 1 so that one token follows it.
    let ok = n >= 1 && max_len >= 1 && len > n;
    let suffix = &history[len.saturating_sub(n)..];
    let last_start = if ok { len - n - 1 } else { 0 };
    (0..=last_start)
        .rev()
        .filter(move |_| ok)
        .filter(move |&s| &history[s..s + n] == suffix)
        .map(move |start| Match {
            n,
            start,
            continuation: &history[start + n..(start + n + max_len).min(len)],
        })
}

/// Up to `max_matches` distinct continuations for the end of `history`: longer matches first (n = `max_n`
/// down to 1), within a length the most recent first. A continuation equal to, or a prefix of, one already
/// taken is skipped (it would add no node to a trie), and one that extends a taken one replaces it.
pub fn distinct_matches(history: &[u32], max_n: usize, max_len: usize, max_matches: usize) -> Vec<Match<'_>> {
    let mut out: Vec<Match<'_>> = Vec::new();
    for n in (1..=max_n).rev() {
        for m in matches_of(history, n, max_len) {
            if out.len() >= max_matches {
                return out;
            }
            if out.iter().any(|o| o.continuation.starts_with(m.continuation)) {
                continue;
            }
            // A longer continuation that extends a taken one replaces it (same place in the order).
            match out
                .iter_mut()
                .find(|o| m.continuation.starts_with(o.continuation))
            {
                Some(o) => *o = m,
                None => out.push(m),
            }
        }
    }
    out
}

/// Lookahead decoding's n-gram pool: for every first token, up to `capacity` (N-1)-token continuations,
/// most recently added last, each with a tag saying where it came from (0 for the prompt; lookahead tags a
/// window gram with the window row that made it, to learn what each row is worth). Adding a gram already
/// present moves it to the most recent place (with the new tag); adding past the capacity drops the oldest.
#[derive(Clone, Debug)]
pub struct NgramPool {
    n: usize,
    capacity: usize,
    map: HashMap<u32, Vec<(Vec<u32>, u8)>>,
}

impl NgramPool {
    /// A pool of `n`-grams (n >= 2) keeping `capacity` (>= 1) continuations per first token.
    pub fn new(n: usize, capacity: usize) -> Self {
        assert!(n >= 2, "NgramPool: n must be at least 2 (got {n})");
        NgramPool {
            n,
            capacity: capacity.max(1),
            map: HashMap::new(),
        }
    }

    /// Adds one N-gram (`gram.len() == n`): key `gram[0]`, continuation `gram[1..]`, tag 0.
    pub fn insert(&mut self, gram: &[u32]) {
        self.insert_tagged(gram, 0);
    }

    /// [`NgramPool::insert`] with a tag.
    pub fn insert_tagged(&mut self, gram: &[u32], tag: u8) {
        assert_eq!(
            gram.len(),
            self.n,
            "NgramPool::insert: gram of length {} in a {}-gram pool",
            gram.len(),
            self.n
        );
        let list = self.map.entry(gram[0]).or_default();
        let cont = &gram[1..];
        if let Some(i) = list.iter().position(|c| c.0 == cont) {
            list.remove(i);
        } else if list.len() >= self.capacity {
            list.remove(0);
        }
        list.push((cont.to_vec(), tag));
    }

    /// Adds every N-gram of `tokens` (in order, so the last ones end up the most recent).
    pub fn insert_all(&mut self, tokens: &[u32]) {
        for w in tokens.windows(self.n) {
            self.insert(w);
        }
    }

    /// The continuations stored for `first`, most recent first.
    pub fn get(&self, first: u32) -> impl Iterator<Item = &[u32]> + '_ {
        self.get_tagged(first).map(|(c, _)| c)
    }

    /// The continuations stored for `first` with their tags, most recent first.
    pub fn get_tagged(&self, first: u32) -> impl Iterator<Item = (&[u32], u8)> + '_ {
        self.map
            .get(&first)
            .into_iter()
            .flat_map(|l| l.iter().rev().map(|c| (c.0.as_slice(), c.1)))
    }

    /// Total number of grams held.
    pub fn len(&self) -> usize {
        self.map.values().map(|l| l.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Inserts `tokens` as a chain under node `from`, sharing nodes that already exist (a trie), adding at most
/// `max_new` nodes. A token equal to the one of the node it would hang under is not special-cased: chains
/// come from real text, where repeats are legitimate. Returns the nodes of the chain (existing or new) in
/// order; shorter than `tokens` when the budget ran out.
pub fn insert_chain(tree: &mut TokenTree, from: usize, tokens: &[u32], max_new: usize) -> Vec<usize> {
    let mut added = 0;
    let mut cur = from;
    let mut nodes = Vec::with_capacity(tokens.len());
    for &t in tokens {
        cur = match tree.child_with_token(cur, t) {
            Some(c) => c,
            None if added < max_new => {
                added += 1;
                tree.push(cur, t)
            }
            None => break,
        };
        nodes.push(cur);
    }
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_prefers_longest_then_most_recent() {
        //          0  1  2  3  4  5  6  7  8  9 10
        let h = [1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3];
        // The suffix [7, 2, 3] does not occur earlier; [2, 3] occurs at 5 and 1: the most recent wins.
        let m = lookup(&h, 3, 10).unwrap();
        assert_eq!(m.n, 2);
        assert_eq!(m.start, 5);
        assert_eq!(m.continuation, &[8, 7, 2, 3]);
        let m = lookup(&h, 3, 2).unwrap();
        assert_eq!(m.continuation, &[8, 7]);
        // A 3-gram match wins over a more recent 1-gram one.
        let h = [5, 6, 7, 1, 7, 2, 5, 6, 7];
        let m = lookup(&h, 3, 3).unwrap();
        assert_eq!((m.n, m.start, m.continuation), (3, 0, &[1u32, 7, 2][..]));
        // max_n = 1: the most recent earlier 7 (at 4) -> [2, 5, 6].
        let m = lookup(&h, 1, 3).unwrap();
        assert_eq!((m.n, m.start, m.continuation), (1, 4, &[2u32, 5, 6][..]));
    }

    #[test]
    fn lookup_edge_cases() {
        assert_eq!(lookup(&[], 3, 10), None);
        assert_eq!(lookup(&[4], 3, 10), None);
        assert_eq!(lookup(&[1, 2, 3], 3, 10), None);
        assert_eq!(lookup(&[1, 2, 1], 3, 0), None);
        // The suffix itself is not a match; the continuation may overlap the suffix.
        let m = lookup(&[4, 4], 3, 10).unwrap();
        assert_eq!((m.n, m.start, m.continuation), (1, 0, &[4u32][..]));
        let m = lookup(&[1, 2, 1, 2, 1, 2], 3, 10).unwrap();
        assert_eq!((m.n, m.start, m.continuation), (3, 1, &[1u32, 2][..]));
        let m = lookup(&[1, 2, 1, 2, 1, 2], 2, 10).unwrap();
        assert_eq!((m.n, m.start, m.continuation), (2, 2, &[1u32, 2][..]));
        // No earlier occurrence of any suffix.
        assert_eq!(lookup(&[1, 2, 3, 4], 3, 10), None);
    }

    #[test]
    fn lookup_matches_brute_force() {
        let mut next = crate::decode::drafters::test_rng(7u64);
        for _ in 0..300 {
            let len = (next() % 30) as usize;
            let h: Vec<u32> = (0..len).map(|_| next() % 4).collect();
            let got = lookup(&h, 3, 5).map(|m| (m.n, m.start, m.continuation.to_vec()));
            let mut want = None;
            'n: for n in (1..=3).rev() {
                if h.len() <= n {
                    continue;
                }
                for s in (0..h.len() - n).rev() {
                    if h[s..s + n] == h[h.len() - n..] {
                        want = Some((n, s, h[s + n..(s + n + 5).min(h.len())].to_vec()));
                        break 'n;
                    }
                }
            }
            assert_eq!(got, want, "history {h:?}");
        }
    }

    #[test]
    fn distinct_matches_skip_covered_continuations() {
        //          0  1  2  3  4  5  6  7  8
        let h = [1, 2, 5, 9, 2, 6, 1, 2, 5];
        // n=2 suffix [2,5]: at 1 -> [9,2,6]. n=1 suffix [5]: at 2 -> [9,2,6] (same: skipped).
        let ms = distinct_matches(&h, 2, 3, 10);
        assert_eq!(ms.len(), 1);
        assert_eq!(ms[0].continuation, &[9, 2, 6]);
        //          0  1  2  3  4  5  6
        let h = [3, 4, 3, 5, 6, 7, 3];
        // n=1 suffix [3]: at 2 -> [5,6], at 0 -> [4,3].
        let ms = distinct_matches(&h, 3, 2, 10);
        let conts: Vec<&[u32]> = ms.iter().map(|m| m.continuation).collect();
        assert_eq!(conts, vec![&[5u32, 6][..], &[4, 3][..]]);
        assert_eq!(distinct_matches(&h, 3, 2, 1).len(), 1);
        // The recent match's continuation is cut by the end of history; the older, longer one extends it
        // and takes its place.
        let h = [8, 1, 8, 1, 8];
        let ms = distinct_matches(&h, 1, 4, 10);
        let conts: Vec<&[u32]> = ms.iter().map(|m| m.continuation).collect();
        assert_eq!(conts, vec![&[1u32, 8, 1, 8][..]]);
        // ... and a shorter one that prefixes a taken one is skipped.
        let h = [8, 1, 8, 1, 2, 8];
        let ms = distinct_matches(&h, 1, 2, 10);
        let conts: Vec<&[u32]> = ms.iter().map(|m| m.continuation).collect();
        assert_eq!(conts, vec![&[1u32, 2][..], &[1, 8][..]]);
    }

    #[test]
    fn pool_keeps_most_recent_within_capacity() {
        let mut p = NgramPool::new(3, 2);
        assert!(p.is_empty());
        p.insert(&[1, 2, 3]);
        p.insert(&[1, 4, 5]);
        p.insert(&[7, 8, 9]);
        assert_eq!(p.get(1).collect::<Vec<_>>(), vec![&[4u32, 5][..], &[2, 3][..]]);
        // Re-inserting moves to the front (most recent), no duplicate.
        p.insert(&[1, 2, 3]);
        assert_eq!(p.get(1).collect::<Vec<_>>(), vec![&[2u32, 3][..], &[4, 5][..]]);
        // Over capacity: the oldest ([4,5]) goes.
        p.insert(&[1, 6, 6]);
        assert_eq!(p.get(1).collect::<Vec<_>>(), vec![&[6u32, 6][..], &[2, 3][..]]);
        assert_eq!(p.get(2).count(), 0);
        assert_eq!(p.len(), 3);
        // Tags follow the most recent insertion.
        p.insert_tagged(&[1, 2, 3], 5);
        assert_eq!(p.get_tagged(1).next(), Some((&[2u32, 3][..], 5)));
        assert_eq!(p.len(), 3);
        let mut q = NgramPool::new(2, 8);
        q.insert_all(&[1, 2, 1, 3, 1, 2]);
        assert_eq!(q.get(1).collect::<Vec<_>>(), vec![&[2u32][..], &[3][..]]);
        assert_eq!(q.get(2).collect::<Vec<_>>(), vec![&[1u32][..]]);
    }

    #[test]
    #[should_panic]
    fn pool_rejects_wrong_length() {
        NgramPool::new(3, 2).insert(&[1, 2]);
    }

    #[test]
    fn chains_merge_into_a_trie() {
        let mut t = TokenTree::new(0);
        assert_eq!(insert_chain(&mut t, 0, &[1, 2, 3], 10), vec![1, 2, 3]);
        // Shares [1, 2], branches at 4.
        assert_eq!(insert_chain(&mut t, 0, &[1, 2, 4], 10), vec![1, 2, 4]);
        assert_eq!(t.tokens(), &[0, 1, 2, 3, 4]);
        assert_eq!(t.parents(), &[0, 0, 1, 2, 2]);
        // Budget: only one new node.
        assert_eq!(insert_chain(&mut t, 0, &[1, 5, 6], 1), vec![1, 5]);
        assert_eq!(t.len(), 6);
        assert_eq!(insert_chain(&mut t, 0, &[7], 0), Vec::<usize>::new());
    }
}
