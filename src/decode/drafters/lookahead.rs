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
//! **`--bc auto`** (no fixed window): every step the window W (0, 1, 2, 4, 8 or 16 rows) and the number of
//! verification nodes are chosen together, by expected tokens per second: a node counts with its reach
//! probability (acceptance learnt per candidate rank and depth, given the parent was reached), a window
//! row with the tokens accepted so far from n-grams that rows at its offset made, per row fed. W = 0 with
//! no nodes is plain decoding. (The window's count is optimistic: those tokens also need nodes, which are
//! priced separately; it only decides whether rows that pay later are worth renting now.)
//!
//! Block complexity (rows per forward, as ESP counts them): at most `1 + W + G (N-1)`; the defaults
//! (W, N, G) = (7, 5, 7) give at most 36. LADE's own count is `(N-1)(W+G)`: the paper matches LADE to BC
//! 10/30/60 with (N, W, G) = (3, 4, 1), (4, 5, 5), (5, 8, 7); here those settings cost at most 7, 21 and
//! 37 rows.

use super::ngram::{insert_chain, NgramPool};
use crate::decode::auto::{
    best_first, chain_rate, prefix_offers, subtree, tried_nodes, Choice, Chooser, Offer, Rate,
};
use crate::decode::check_flag;
use crate::decode::cost_cache::curve_for;
use crate::decode::generate::{Beside, Draft, Drafter, Step};
use crate::decode::kind::MethodKind;
use crate::decode::layout::Probe;
use crate::decode::sampling::argmax;
use crate::decode::tree::TokenTree;
use crate::model::Transformer;
use anyhow::Result;
use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, VecDeque};

/// Windows `--bc auto` considers (0: none).
const AUTO_WINDOWS: [usize; 6] = [0, 1, 2, 4, 8, 16];
/// The window fed at prefill under `--bc auto` (and the fixed window's default).
pub const DEFAULT_WINDOW: usize = 7;
/// Prior of a window row's worth, in tokens accepted later per row fed, and its weight in rows.
const WINDOW_PRIOR: f64 = 0.05;
const WINDOW_PRIOR_ROWS: f64 = 16.0;
/// The tokens, in n-gram lengths, within which a window row's n-grams are used if at all: a row's worth
/// (measured over the answer so far) shrinks when less of the answer than this is left.
const WINDOW_HORIZON_NGRAMS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookaheadConfig {
    /// W: lookahead window (probe rows per step); `None`: chosen per step (`--bc auto`).
    pub window: Option<usize>,
    /// N: n-gram size (a verification candidate is N-1 draft tokens).
    pub ngram: usize,
    /// G: most verification candidates per step (also the pool's capacity per first token).
    pub guesses: usize,
    /// Seed of the random prompt tokens that fill new window positions.
    pub seed: u64,
}

impl Default for LookaheadConfig {
    /// Spec-Bench's lookahead setting, N = 5, G = 7, with the window chosen per step (W = 7 in
    /// Spec-Bench).
    fn default() -> Self {
        LookaheadConfig {
            window: None,
            ngram: 5,
            guesses: 7,
            seed: 0,
        }
    }
}

impl LookaheadConfig {
    /// Most rows per forward pass: root, window, G chains of N-1 tokens.
    pub fn block_complexity(&self) -> usize {
        1 + self.max_window() + self.guesses * (self.ngram - 1)
    }

    /// The fixed window, or the largest `--bc auto` considers.
    pub fn max_window(&self) -> usize {
        self.window.unwrap_or(AUTO_WINDOWS[AUTO_WINDOWS.len() - 1])
    }
}

/// Which of [`AUTO_WINDOWS`]' steps a window row at `offset` (1-based) belongs to.
fn window_bucket(offset: usize) -> usize {
    AUTO_WINDOWS[1..]
        .iter()
        .position(|&w| offset <= w)
        .unwrap_or(AUTO_WINDOWS.len() - 2)
}

/// A verification trie with, per node (the root's entries unused), its rate key (candidate rank, depth)
/// and the tag of the n-gram that brought it (0: the prompt, j: window row j).
struct Verification {
    tree: TokenTree,
    keys: Vec<(u8, u8)>,
    tags: Vec<u8>,
}

/// What `--bc auto` learns and remembers.
struct LookaheadAuto {
    chooser: Chooser,
    /// Acceptance of a verification node given its parent was reached, by (candidate rank, depth).
    rates: HashMap<(u8, u8), Rate>,
    /// Per window bucket: tokens accepted from the n-grams its rows made (`accepted`) over its rows fed
    /// (`proposed`).
    window_worth: Vec<Rate>,
    /// The last tree sent, to learn from its verification.
    last: Option<Verification>,
    /// Tokens the answer may still take ([`Step::remaining`] of the last step).
    remaining: usize,
}

impl LookaheadAuto {
    fn new(chooser: Chooser) -> Self {
        LookaheadAuto {
            chooser,
            rates: HashMap::new(),
            window_worth: vec![
                Rate {
                    accepted: WINDOW_PRIOR * WINDOW_PRIOR_ROWS,
                    proposed: WINDOW_PRIOR_ROWS,
                };
                AUTO_WINDOWS.len() - 1
            ],
            last: None,
            remaining: usize::MAX,
        }
    }

    /// Acceptance of a node of candidate rank `rank` at `depth` given its parent was reached (a depth not
    /// tried yet takes the rate of the depth above).
    fn rate(&self, (rank, depth): (u8, u8)) -> f64 {
        chain_rate(usize::from(depth.max(1)), |d| {
            self.rates.get(&(rank, d as u8)).copied()
        })
    }

    /// The prefill's window: the one a step would rent at the prior's worth per row (none where rows
    /// cost what they bring, as on a CPU, where seven rows are a few percent of a short prefill).
    fn prefill_window(&self, context: usize, ngram: usize) -> usize {
        let rate = |w: usize| {
            let tokens = 1.0 + self.window_tokens(w, ngram);
            self.chooser.rate(Offer { rows: 1 + w, tokens }, context)
        };
        let best = AUTO_WINDOWS
            .into_iter()
            .max_by(|&a, &b| rate(a).total_cmp(&rate(b)).then(b.cmp(&a)));
        let bar = self.chooser.plain_bar(context);
        best.filter(|&w| rate(w) > bar).unwrap_or(0)
    }

    /// Expected tokens a window of `w` rows brings within the answer that is left: its n-grams (of
    /// `ngram` tokens) can be used only after they are made, and pay over about
    /// [`WINDOW_HORIZON_NGRAMS`] n-gram lengths.
    fn window_tokens(&self, w: usize, ngram: usize) -> f64 {
        let left = self.remaining.saturating_sub(ngram) as f64;
        let horizon = (WINDOW_HORIZON_NGRAMS * ngram) as f64;
        let share = (left / horizon).min(1.0);
        share
            * (1..=w)
                .map(|j| self.window_worth[window_bucket(j)].get())
                .sum::<f64>()
    }

    /// Learns from the verified step: node acceptance, and the window rows' worth.
    fn learn(&mut self, step: &Step, window: usize) {
        self.remaining = step.remaining;
        if step.replaced {
            self.last = None;
            return;
        }
        for j in 1..=window {
            self.window_worth[window_bucket(j)].proposed += 1.0;
        }
        let Some(sent) = self.last.take() else {
            return;
        };
        for (n, hit) in tried_nodes(&sent.tree, step.accepted) {
            self.rates.entry(sent.keys[n]).or_default().record(hit);
            if hit && sent.tags[n] > 0 {
                self.window_worth[window_bucket(usize::from(sent.tags[n]))].accepted += 1.0;
            }
        }
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
    auto: Option<LookaheadAuto>,
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
        if let Some(w) = cfg.window {
            check_flag("--lookahead-window", w, 1)?;
        }
        check_flag("--lookahead-ngram", cfg.ngram, 2)?;
        check_flag("--lookahead-guesses", cfg.guesses, 1)?;
        Ok(Lookahead {
            cfg,
            auto: None,
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
            // Tagged with the window row whose output ends the gram.
            self.pool
                .insert_tagged(&gram, (i + 1).min(usize::from(u8::MAX)) as u8);
        }
    }

    /// The verification trie of up to G pool candidates for `root`, at most `max_nodes` nodes, with each
    /// node's rate key (candidate rank, depth) and n-gram tag.
    fn candidates(&self, root: u32, max_nodes: usize) -> Verification {
        let mut tree = TokenTree::with_capacity(root, 1 + max_nodes);
        let (mut keys, mut tags) = (vec![(0, 0)], vec![0]);
        for (rank, (cont, tag)) in self.pool.get_tagged(root).take(self.cfg.guesses).enumerate() {
            let before = tree.len();
            let room = max_nodes.saturating_sub(before - 1);
            for (i, node) in insert_chain(&mut tree, 0, cont, room).into_iter().enumerate() {
                if node >= before {
                    keys.push((rank.min(3) as u8, (i + 1).min(usize::from(u8::MAX)) as u8));
                    tags.push(tag);
                }
            }
        }
        Verification { tree, keys, tags }
    }

    /// `--bc auto`'s step: the window and the verification nodes that maximise expected tokens per
    /// second at this cache length; returns the tree and the window's rows.
    fn draft_auto(&mut self, root: u32, history: &[u32], max_rows: usize) -> (TokenTree, usize) {
        let room = max_rows.saturating_sub(1);
        let max_nodes = (self.cfg.guesses * (self.cfg.ngram - 1)).min(room);
        let Verification {
            tree: full,
            keys,
            tags,
        } = self.candidates(root, max_nodes);
        let auto = self.auto.as_mut().expect("begin() sets up --bc auto");
        let mut score = vec![1.0; full.len()];
        for n in 1..full.len() {
            score[n] = score[full.parent(n).unwrap_or(0)] * auto.rate(keys[n]);
        }
        let order = best_first(&full, &score);
        let ranked: Vec<f64> = order.iter().map(|&n| score[n]).collect();
        // Every (window, nodes) pair that fits, but (0, 0): plain decoding.
        let (mut offers, mut shapes) = (Vec::new(), Vec::new());
        for w in AUTO_WINDOWS.into_iter().filter(|&w| w <= room) {
            let worth = auto.window_tokens(w, self.cfg.ngram);
            if w > 0 {
                offers.push(Offer {
                    rows: 1 + w,
                    tokens: 1.0 + worth,
                });
                shapes.push((w, 0));
            }
            let most = (room - w).min(ranked.len());
            for (m, o) in prefix_offers(&ranked[..most], |m| 1 + w + m)
                .into_iter()
                .enumerate()
            {
                offers.push(Offer {
                    tokens: o.tokens + worth,
                    ..o
                });
                shapes.push((w, m + 1));
            }
        }
        let (w, m) = match auto.chooser.choose(history.len() - 1, &offers) {
            Choice::Plain => (0, 0),
            // One window row and the best node: acceptance and window rows keep being observed.
            Choice::Explore => (1.min(room), ranked.len().min(1).min(room.saturating_sub(1))),
            Choice::Offer(i) => shapes[i],
        };
        let (tree, from) = subtree(&full, &order[..m]);
        let keys = from.iter().map(|&n| keys[n]).collect();
        let tags = from.iter().map(|&n| tags[n]).collect();
        auto.last = Some(Verification {
            tree: tree.clone(),
            keys,
            tags,
        });
        (tree, w)
    }

    /// A fixed window's step: the window, and the pool's candidates in the rows left.
    fn draft_fixed(&self, root: u32, max_rows: usize) -> (TokenTree, usize) {
        let w = self
            .cfg
            .window
            .unwrap_or(DEFAULT_WINDOW)
            .min(max_rows.saturating_sub(1));
        let nodes = 1 + self.cfg.guesses * (self.cfg.ngram - 1);
        let mut tree = TokenTree::with_capacity(root, nodes.min(max_rows.max(1)));
        let mut room = max_rows.saturating_sub(1 + w);
        for cont in self.pool.get(root).take(self.cfg.guesses) {
            let before = tree.len();
            insert_chain(&mut tree, 0, cont, room);
            room -= tree.len() - before;
        }
        (tree, w)
    }
}

impl Drafter for Lookahead {
    fn beside(&mut self, beside: Beside) {
        if let Some(a) = &mut self.auto {
            a.chooser.beside(beside);
        }
    }

    fn name(&self) -> MethodKind {
        MethodKind::Lookahead
    }

    fn begin(&mut self, model: &Transformer, prompt: &[u32]) -> Result<usize> {
        self.pool = NgramPool::new(self.cfg.ngram, self.cfg.guesses);
        self.pool.insert_all(prompt);
        self.fill = prompt.to_vec();
        self.rng = StdRng::seed_from_u64(self.cfg.seed);
        self.guesses = Level::default();
        self.levels.clear();
        self.auto = match self.cfg.window {
            Some(_) => None,
            // The exploring block: the root, one window row and one verification node.
            None => Some(LookaheadAuto::new(
                Chooser::new(curve_for(model)?).exploring_with(3),
            )),
        };
        // The prefill's root is the last prompt token.
        let window = |a: &LookaheadAuto| a.prefill_window(prompt.len(), self.cfg.ngram);
        let w = self
            .cfg
            .window
            .unwrap_or_else(|| self.auto.as_ref().map_or(DEFAULT_WINDOW, window));
        self.fed = self.window_for(prompt.len() - 1, w);
        Ok(w)
    }

    fn draft(&mut self, root: u32, history: &[u32], max_rows: usize) -> Draft {
        let root_pos = history.len() - 1;
        let (tree, w) = if self.auto.is_some() {
            self.draft_auto(root, history, max_rows)
        } else {
            self.draft_fixed(root, max_rows)
        };
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
        if let Some(auto) = &mut self.auto {
            auto.chooser.record(step);
            auto.learn(step, fed.tokens.len());
        }
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
#[path = "lookahead_tests.rs"]
mod tests;
