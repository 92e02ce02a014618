//! Lookahead decoding (Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead
//! Decoding", 2024), simplified to one Jacobi level, in the shared engine.
//!
//! Each step runs ONE forward over `[root | verification branch | lookahead window]`:
//! - the **verification branch**: up to G n-grams from the pool whose first token is the root, as chains
//!   under the root (N-1 draft tokens each), merged into a trie where they share a prefix;
//! - the **lookahead window**: W probe rows owned by the root at offsets 1..=W. Their inputs are the current
//!   Jacobi guesses for the W positions after the root (token embeddings); window row j sees the root's path
//!   (the committed prefix and the root) and window rows 1..=j: exactly the [`Probe`] pattern of ESP's masks,
//!   with token guesses as inputs instead of mask vectors.
//!
//! After the step, window row j's argmax is the next Jacobi guess for the position after it. Guesses are kept
//! by absolute position, so when the step commits c tokens the window slides by c: positions that already
//! have a guess keep it, the c - 1 new tail positions get a random prompt token (LADE initialises its window
//! the same way). The pool (keyed by first token, up to G continuations per key, the most recent kept) is
//! fed with the prompt's N-grams and with the n-grams collected from the window: for each window output at
//! position Q, the *diagonal* (guess of the window N-2 steps ago at Q-N+1, ..., guess of the previous window
//! at Q-2, current guess at Q-1, output at Q). Each element there was computed by the model from the one
//! before it (the window guesses at Q-1 are the previous step's outputs), as in LADE's 2-D window.
//!
//! **Deviations from LADE**:
//! - LADE feeds N-1 window *levels* (the last N-1 Jacobi iterates, W tokens each) and each new token
//!   attends along its diagonal trajectory through those levels. Here only the newest level is fed (W rows,
//!   not (N-1) W); the older levels live in the drafter's memory and only serve to form n-grams. A window
//!   row therefore attends to the current guesses before it, not to its own trajectory: cheaper (a block of
//!   1 + W + G (N-1) rows instead of 1 + (N-1) W + G (N-1)), with less refined guesses.
//! - Verification candidates that share a prefix are merged into one tree (LADE verifies them as separate
//!   branches): fewer rows for the same candidates, identical acceptance.
//! - The window slides by the committed length, keeping guesses aligned with absolute positions (LADE keeps
//!   its window in place relative to the end of the sequence).
//!
//! Block complexity (rows per forward, as ESP counts them): at most `1 + W + G (N-1)`; the defaults
//! (W, N, G) = (7, 5, 7) give at most 36. LADE's own count is `(N-1)(W+G)`: the paper matches LADE to BC
//! 10/30/60 with (N, W, G) = (3, 4, 1), (4, 5, 5), (5, 8, 7); here those settings cost at most 7, 21 and
//! 37 rows.

use super::ngram::{insert_chain, NgramPool};
use crate::decode::check_flag;
use crate::decode::generate::{Draft, Drafter, Step};
use crate::decode::layout::Probe;
use crate::decode::method::MethodKind;
use crate::decode::sampling::argmax;
use crate::decode::tree::TokenTree;
use crate::model::Transformer;
use anyhow::Result;
use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::VecDeque;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookaheadConfig {
    /// W: lookahead window (probe rows per step).
    pub window: usize,
    /// N: n-gram size (a verification candidate is N-1 draft tokens).
    pub ngram: usize,
    /// G: most verification candidates per step (also the pool's capacity per first token).
    pub guesses: usize,
    /// Seed of the random prompt tokens that fill new window positions.
    pub seed: u64,
}

impl Default for LookaheadConfig {
    /// Spec-Bench's lookahead setting: W = 7, N = 5, G = 7.
    fn default() -> Self {
        LookaheadConfig {
            window: 7,
            ngram: 5,
            guesses: 7,
            seed: 0,
        }
    }
}

impl LookaheadConfig {
    /// Most rows per forward pass: root, window, G chains of N-1 tokens.
    pub fn block_complexity(&self) -> usize {
        1 + self.window + self.guesses * (self.ngram - 1)
    }
}

/// A window of guesses laid at absolute positions `start..start + tokens.len()`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Level {
    start: usize,
    tokens: Vec<u32>,
}

impl Level {
    fn at(&self, pos: usize) -> Option<u32> {
        pos.checked_sub(self.start)
            .and_then(|i| self.tokens.get(i))
            .copied()
    }
}

pub struct Lookahead {
    cfg: LookaheadConfig,
    pool: NgramPool,
    /// Jacobi guesses by absolute position (the latest outputs of the window).
    guesses: Level,
    /// The window fed in the last forward (empty when none was fed), and its root's absolute position.
    fed: Level,
    /// The windows fed in earlier steps, newest last, the current one included after `observe`: the levels
    /// n-grams are read from (at most N-1 kept).
    levels: VecDeque<Level>,
    /// Tokens to fill new window positions with (the prompt), and the generator that picks them.
    fill: Vec<u32>,
    rng: StdRng,
}

impl Lookahead {
    pub fn new(cfg: LookaheadConfig) -> Result<Self> {
        check_flag("--lookahead-window", cfg.window, 1)?;
        check_flag("--lookahead-ngram", cfg.ngram, 2)?;
        check_flag("--lookahead-guesses", cfg.guesses, 1)?;
        Ok(Lookahead {
            cfg,
            pool: NgramPool::new(cfg.ngram, cfg.guesses),
            guesses: Level::default(),
            fed: Level::default(),
            levels: VecDeque::new(),
            fill: Vec::new(),
            rng: StdRng::seed_from_u64(cfg.seed),
        })
    }

    /// The window for the root at absolute position `root_pos`, `len` tokens: the guesses already held for
    /// those positions, random prompt tokens for the others.
    fn window_for(&mut self, root_pos: usize, len: usize) -> Level {
        let tokens = (root_pos + 1..root_pos + 1 + len)
            .map(|p| match self.guesses.at(p) {
                Some(t) => t,
                None => self.fill[self.rng.random_range(0..self.fill.len())],
            })
            .collect();
        Level {
            start: root_pos + 1,
            tokens,
        }
    }

    /// The n-grams ending at each output of the current window (see the module doc), into the pool.
    fn collect_ngrams(&mut self, outputs: &Level) {
        let n = self.cfg.ngram;
        let mut gram = vec![0u32; n];
        'q: for (i, &out) in outputs.tokens.iter().enumerate() {
            let q = outputs.start + i;
            gram[n - 1] = out;
            // Element n-1-k is the guess at position q - k of the window fed k - 1 steps ago.
            for k in 1..n {
                let level = match self.levels.len().checked_sub(k) {
                    Some(l) => &self.levels[l],
                    None => continue 'q,
                };
                match q.checked_sub(k).and_then(|p| level.at(p)) {
                    Some(t) => gram[n - 1 - k] = t,
                    None => continue 'q,
                }
            }
            self.pool.insert(&gram);
        }
    }
}

impl Drafter for Lookahead {
    fn name(&self) -> MethodKind {
        MethodKind::Lookahead
    }

    fn begin(&mut self, _: &Transformer, prompt: &[u32]) -> Result<usize> {
        self.pool = NgramPool::new(self.cfg.ngram, self.cfg.guesses);
        self.pool.insert_all(prompt);
        self.fill = prompt.to_vec();
        self.rng = StdRng::seed_from_u64(self.cfg.seed);
        self.guesses = Level::default();
        self.levels.clear();
        // The prefill's root is the last prompt token.
        self.fed = self.window_for(prompt.len() - 1, self.cfg.window);
        Ok(self.cfg.window)
    }

    fn draft(&mut self, root: u32, history: &[u32], max_rows: usize) -> Draft {
        let root_pos = history.len() - 1;
        let w = self.cfg.window.min(max_rows.saturating_sub(1));
        let nodes = 1 + self.cfg.guesses * (self.cfg.ngram - 1);
        let mut tree = TokenTree::with_capacity(root, nodes.min(max_rows.max(1)));
        let mut room = max_rows.saturating_sub(1 + w);
        for cont in self.pool.get(root).take(self.cfg.guesses) {
            let before = tree.len();
            insert_chain(&mut tree, 0, cont, room);
            room -= tree.len() - before;
        }
        self.fed = self.window_for(root_pos, w);
        let probes = (1..=w).map(|offset| Probe { owner: 0, offset }).collect();
        Draft { tree, probes }
    }

    fn probe_inputs(&self, model: &Transformer, probes: &[Probe]) -> Result<Tensor> {
        let ids: Vec<u32> = probes.iter().map(|p| self.fed.tokens[p.offset - 1]).collect();
        model.embed(&ids)
    }

    fn probe_owner(&self, _deepest: usize) -> usize {
        0
    }

    fn observe(&mut self, _: &Transformer, step: &Step) -> Result<()> {
        let fed = std::mem::take(&mut self.fed);
        let probe_logits = step.probe_logits;
        // The loop verified the root alone (no room left), or there was no window: nothing was learnt.
        if step.replaced || probe_logits.is_empty() || probe_logits.len() != fed.tokens.len() {
            return Ok(());
        }
        // Window row j (position fed.start + j) predicts position fed.start + j + 1.
        let outputs = Level {
            start: fed.start + 1,
            tokens: probe_logits.iter().map(|l| argmax(l)).collect(),
        };
        self.levels.push_back(fed);
        while self.levels.len() > self.cfg.ngram - 1 {
            self.levels.pop_front();
        }
        self.collect_ngrams(&outputs);
        self.guesses = outputs;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookahead(w: usize, n: usize, g: usize) -> Lookahead {
        let mut la = Lookahead::new(LookaheadConfig {
            window: w,
            ngram: n,
            guesses: g,
            seed: 1,
        })
        .unwrap();
        la.fill = vec![100];
        la
    }

    #[test]
    fn config_checks_and_block_complexity() {
        assert_eq!(LookaheadConfig::default().block_complexity(), 36);
        for (w, n, g) in [(0, 5, 7), (7, 1, 7), (7, 5, 0)] {
            assert!(Lookahead::new(LookaheadConfig {
                window: w,
                ngram: n,
                guesses: g,
                seed: 0
            })
            .is_err());
        }
    }

    #[test]
    fn window_slides_with_absolute_positions() {
        let mut la = lookahead(4, 3, 2);
        la.guesses = Level {
            start: 12,
            tokens: vec![1, 2, 3, 4],
        };
        // Root at 12: positions 13..=16 -> guesses 2, 3, 4, then a fill token.
        assert_eq!(
            la.window_for(12, 4),
            Level {
                start: 13,
                tokens: vec![2, 3, 4, 100]
            }
        );
        // Root at 10: position 11 has no guess.
        assert_eq!(
            la.window_for(10, 3),
            Level {
                start: 11,
                tokens: vec![100, 1, 2]
            }
        );
    }

    #[test]
    fn ngrams_follow_the_diagonal() {
        // N = 3: gram = (guess two levels back at q-2, current guess at q-1, output at q).
        let mut la = lookahead(3, 3, 4);
        la.levels.push_back(Level {
            start: 10,
            tokens: vec![1, 2, 3],
        });
        la.levels.push_back(Level {
            start: 11,
            tokens: vec![4, 5, 6],
        });
        la.collect_ngrams(&Level {
            start: 12,
            tokens: vec![7, 8, 9],
        });
        // q = 12: current guess at 11 = 4, previous level at 10 = 1 -> [1, 4, 7].
        // q = 13: [2, 5, 8]; q = 14: [3, 6, 9].
        assert_eq!(la.pool.get(1).collect::<Vec<_>>(), vec![&[4u32, 7][..]]);
        assert_eq!(la.pool.get(2).collect::<Vec<_>>(), vec![&[5u32, 8][..]]);
        assert_eq!(la.pool.get(3).collect::<Vec<_>>(), vec![&[6u32, 9][..]]);
        // A slid window: current level starts at 13, the older one at 10; q = 14 needs 13 (ok) and 12 (ok).
        let mut la = lookahead(3, 3, 4);
        la.levels.push_back(Level {
            start: 10,
            tokens: vec![1, 2, 3],
        });
        la.levels.push_back(Level {
            start: 13,
            tokens: vec![4, 5, 6],
        });
        la.collect_ngrams(&Level {
            start: 14,
            tokens: vec![7, 8, 9],
        });
        // q=14: level0 at 12 = 3, current at 13 = 4 -> [3, 4, 7]; q=15: level0 at 13 missing; q=16 too.
        assert_eq!(la.pool.len(), 1);
        assert_eq!(la.pool.get(3).collect::<Vec<_>>(), vec![&[4u32, 7][..]]);
        // Too few levels yet: nothing.
        let mut la = lookahead(3, 3, 4);
        la.levels.push_back(Level {
            start: 11,
            tokens: vec![4, 5, 6],
        });
        la.collect_ngrams(&Level {
            start: 12,
            tokens: vec![7, 8, 9],
        });
        assert!(la.pool.is_empty());
        // N = 2: the current level alone.
        let mut la = lookahead(3, 2, 4);
        la.levels.push_back(Level {
            start: 11,
            tokens: vec![4, 5, 6],
        });
        la.collect_ngrams(&Level {
            start: 12,
            tokens: vec![7, 8, 9],
        });
        assert_eq!(la.pool.len(), 3);
        assert_eq!(la.pool.get(5).collect::<Vec<_>>(), vec![&[8u32][..]]);
    }

    #[test]
    fn draft_merges_pool_candidates_and_appends_the_window() {
        let mut la = lookahead(3, 3, 2);
        la.pool.insert(&[5, 6, 7]);
        la.pool.insert(&[5, 6, 8]);
        la.pool.insert(&[9, 1, 1]);
        let history = [1, 2, 5];
        let d = la.draft(5, &history, 100);
        // Most recent first: [6, 8] then [6, 7], sharing the node 6.
        assert_eq!(d.tree.tokens(), &[5, 6, 8, 7]);
        assert_eq!(d.tree.parents(), &[0, 0, 1, 1]);
        assert_eq!(
            d.probes,
            vec![
                Probe { owner: 0, offset: 1 },
                Probe { owner: 0, offset: 2 },
                Probe { owner: 0, offset: 3 }
            ]
        );
        assert_eq!(la.fed.start, 3);
        // Tight room: 4 rows = root + window of 3, no candidates.
        let d = la.draft(5, &history, 4);
        assert_eq!((d.tree.len(), d.probes.len()), (1, 3));
        // 2 rows: root + 1 window probe.
        let d = la.draft(5, &history, 2);
        assert_eq!((d.tree.len(), d.probes.len()), (1, 1));
        assert_eq!(la.probe_owner(7), 0);
    }
}
