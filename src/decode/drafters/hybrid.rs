//! Hybrid drafter: ESP's mask-token candidates, prompt lookup and n-gram continuations merged into ONE tree
//! per step under ONE block complexity, `BC = (k + 1) (1 + nodes)` as for ESP: every node carries k mask
//! probes, and the masks of the deepest accepted node seed the next step's ESP candidates (exactly as in
//! [`super::esp`], whose [`MaskEmbedding`] and candidate lists this reuses).
//!
//! Every source proposes scored paths, merged into one candidate trie, and the `nodes` best nodes by one
//! score are kept. A node's score estimates the probability that the verifier reaches it: the parent's
//! score times the chance it is accepted given its parent was, combined over the sources that propose it
//! as `1 - prod(1 - p_s)`. Scores never grow along a path, so the best nodes form a tree. Sources:
//!   - ESP: the dynamic tree of the mask candidates; `p = alpha * p_mask`, where the calibration `alpha`
//!     (accepted ESP nodes / their summed mask probability) is learnt online during the generation;
//!   - prompt lookup: up to `pld_matches` distinct continuations of the history's suffix (n = `max_ngram`
//!     down to 1, most recent first); `p` = the acceptance rate learnt online per (match length, first or
//!     later match, depth);
//!   - n-gram extension of ESP: each of the `extend` best ESP depth-1 tokens x is followed by the prompt-
//!     lookup continuation of `history + [x]` (what came after the same context earlier), so a mask's guess
//!     for the next token brings the rest of a phrase with it; `p` learnt per (match length, depth).
//!
//!   The learnt rates start from `1/2` (one accepted, one rejected pseudo-count) and are counted over the
//!   nodes whose parent the verifier reached, so they measure exactly the conditional acceptance.
//!
//! The draft depends only on the history and on the probes' logits, never on the step's own random draws:
//! sample matching in the shared verifier keeps it exact under sampling.

use super::candidates::dynamic_tree;
use super::esp::MaskProbes;
use super::ngram::{distinct_matches, lookup};
use crate::decode::budget::{nodes_within, MAX_BC};
use crate::decode::check_flag;
use crate::decode::generate::{Draft, Drafter, Step};
use crate::decode::layout::{esp_probes, Probe};
use crate::decode::method::{Masks, MethodKind};
use crate::decode::tree::TokenTree;
use crate::model::Transformer;
use anyhow::{bail, Result};
use candle_core::Tensor;
use std::collections::HashMap;

#[derive(Debug, Clone)]
pub struct HybridConfig {
    pub masks: Masks,
    /// Draft nodes per step (sum K_i = BC / (k + 1) - 1).
    pub nodes: usize,
    /// Largest suffix length prompt lookup matches.
    pub max_ngram: usize,
    /// Longest prompt-lookup chain.
    pub draft_len: usize,
    /// Seed of `--mask-init normal`.
    pub seed: u64,
    /// Distinct prompt-lookup continuations.
    pub pld_matches: usize,
    /// ESP depth-1 candidates extended by their prompt-lookup continuation.
    pub extend: usize,
}

impl HybridConfig {
    /// The defaults for a node budget and k: 3-gram lookup, chains of up to 10 tokens.
    pub fn new(k: usize, nodes: usize) -> Self {
        HybridConfig {
            masks: Masks {
                count: k,
                ..Masks::default()
            },
            nodes,
            max_ngram: 3,
            draft_len: 10,
            seed: 0,
            pld_matches: 3,
            extend: 4,
        }
    }
}

/// Which source proposed a node, with the statistics key its acceptance is learnt under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Source {
    Esp,
    /// Prompt lookup: match length, first (0) or later (1) match, depth in the chain (capped).
    Pld {
        n: u8,
        later: u8,
        depth: u8,
    },
    /// Lookup continuation of an ESP candidate: match length, depth below the candidate (capped).
    Ext {
        n: u8,
        depth: u8,
    },
}

const MAX_DEPTH_KEY: usize = 8;

fn depth_key(d: usize) -> u8 {
    d.min(MAX_DEPTH_KEY) as u8
}

/// What the drafter remembers of a node it proposed, for learning.
#[derive(Clone, Debug, Default)]
struct NodeInfo {
    tags: Vec<Source>,
    /// The mask probability when ESP proposed it.
    esp_p: Option<f64>,
}

/// Accepted / proposed counts (with their pseudo-counts).
#[derive(Clone, Copy, Debug)]
struct Rate {
    accepted: f64,
    proposed: f64,
}

impl Default for Rate {
    fn default() -> Self {
        Rate {
            accepted: 1.0,
            proposed: 2.0,
        }
    }
}

impl Rate {
    fn get(&self) -> f64 {
        self.accepted / self.proposed
    }
}

/// The candidate trie of one step, before selection.
struct CandidateTrie {
    tree: TokenTree,
    /// prod(1 - p_s) over the sources proposing each node.
    miss: Vec<f64>,
    info: Vec<NodeInfo>,
}

impl CandidateTrie {
    fn new(root: u32) -> Self {
        CandidateTrie {
            tree: TokenTree::new(root),
            miss: vec![1.0],
            info: vec![NodeInfo::default()],
        }
    }

    fn add(&mut self, parent: usize, token: u32, p: f64, tag: Source) -> usize {
        let n = match self.tree.child_with_token(parent, token) {
            Some(c) => c,
            None => {
                self.miss.push(1.0);
                self.info.push(NodeInfo::default());
                self.tree.push(parent, token)
            }
        };
        self.miss[n] *= 1.0 - p.clamp(0.0, 0.99);
        if !self.info[n].tags.contains(&tag) {
            self.info[n].tags.push(tag);
        }
        n
    }

    /// The `budget` best nodes as a tree (best first), with their infos.
    fn select(self, budget: usize) -> (TokenTree, Vec<NodeInfo>) {
        let t = &self.tree;
        let mut score = vec![1.0f64; t.len()];
        for n in 1..t.len() {
            score[n] = score[t.parent(n).unwrap()] * (1.0 - self.miss[n]);
        }
        let mut order: Vec<usize> = (1..t.len()).collect();
        order.sort_by(|&a, &b| {
            score[b]
                .total_cmp(&score[a])
                .then(t.depth(a).cmp(&t.depth(b)))
                .then(a.cmp(&b))
        });
        order.truncate(budget);
        let mut out = TokenTree::with_capacity(t.token(0), 1 + order.len());
        let mut infos = vec![NodeInfo::default()];
        let mut map = vec![usize::MAX; t.len()];
        map[0] = 0;
        let mut info = self.info;
        for &n in &order {
            let p = map[t.parent(n).unwrap()];
            debug_assert!(p != usize::MAX, "a node was selected before its parent");
            if p == usize::MAX {
                continue;
            }
            map[n] = out.push(p, t.token(n));
            infos.push(std::mem::take(&mut info[n]));
        }
        (out, infos)
    }
}

pub struct Hybrid {
    cfg: HybridConfig,
    masks: MaskProbes,
    /// The last tree proposed and what is known of its nodes.
    last: Option<(TokenTree, Vec<NodeInfo>)>,
    rates: HashMap<Source, Rate>,
    /// ESP calibration: accepted ESP nodes and their summed mask probability (pseudo-counts 1, 1).
    esp_accepted: f64,
    esp_mass: f64,
}

impl Hybrid {
    pub fn new(cfg: HybridConfig) -> Result<Self> {
        let masks = MaskProbes::new(cfg.masks, cfg.seed)?;
        if !(1..=MAX_BC).contains(&cfg.nodes) {
            bail!(
                "the hybrid needs a node budget in 1..={MAX_BC} (got {})",
                cfg.nodes
            );
        }
        check_flag("--ngram", cfg.max_ngram, 1)?;
        check_flag("--draft-len", cfg.draft_len, 1)?;
        Ok(Hybrid {
            cfg,
            masks,
            last: None,
            rates: HashMap::new(),
            esp_accepted: 1.0,
            esp_mass: 1.0,
        })
    }

    fn rate(&self, s: Source) -> f64 {
        self.rates.get(&s).copied().unwrap_or_default().get()
    }

    fn esp_alpha(&self) -> f64 {
        self.esp_accepted / self.esp_mass
    }

    /// Every source into one candidate trie, the best `budget` nodes kept.
    fn draft_scored(&self, root: u32, history: &[u32], budget: usize) -> (TokenTree, Vec<NodeInfo>) {
        let mut c = CandidateTrie::new(root);
        // ESP: its dynamic tree (twice the budget: a node other sources support may lift its subtree).
        let alpha = self.esp_alpha();
        let esp = dynamic_tree(root, self.masks.dists(), 2 * budget);
        let mut map = vec![0usize; esp.len()];
        let mut depth1: Vec<(usize, u32)> = Vec::new();
        for n in 1..esp.len() {
            let d = esp.depth(n);
            let token = esp.token(n);
            let p_mask = self.masks.dists()[d - 1]
                .iter()
                .find(|x| x.0 == token)
                .map_or(0.0, |x| f64::from(x.1));
            map[n] = c.add(map[esp.parent(n).unwrap()], token, alpha * p_mask, Source::Esp);
            c.info[map[n]].esp_p = Some(p_mask);
            if d == 1 {
                depth1.push((map[n], token));
            }
        }
        // Prompt lookup: distinct continuations, longest match first.
        let len = self.cfg.draft_len;
        for (rank, m) in distinct_matches(history, self.cfg.max_ngram, len, self.cfg.pld_matches)
            .iter()
            .enumerate()
        {
            let mut cur = 0;
            for (i, &t) in m.continuation.iter().enumerate() {
                let tag = Source::Pld {
                    n: m.n as u8,
                    later: rank.min(1) as u8,
                    depth: depth_key(i + 1),
                };
                cur = c.add(cur, t, self.rate(tag), tag);
            }
        }
        // ESP's best depth-1 tokens, each followed by what came after the same context earlier.
        if self.cfg.extend > 0 && !depth1.is_empty() {
            let mut h = Vec::with_capacity(history.len() + 1);
            h.extend_from_slice(history);
            h.push(0);
            for &(node, token) in depth1.iter().take(self.cfg.extend) {
                *h.last_mut().unwrap() = token;
                if let Some(m) = lookup(&h, self.cfg.max_ngram, len.saturating_sub(1).max(1)) {
                    let mut cur = node;
                    for (i, &t) in m.continuation.iter().enumerate() {
                        let tag = Source::Ext {
                            n: m.n as u8,
                            depth: depth_key(i + 1),
                        };
                        cur = c.add(cur, t, self.rate(tag), tag);
                    }
                }
            }
        }
        c.select(budget)
    }

    /// Counts, for every node whose parent the verifier reached, whether it was accepted.
    fn learn(&mut self, tree: &TokenTree, infos: &[NodeInfo], accepted: &[usize]) {
        let mut reached = vec![false; tree.len()];
        reached[0] = true;
        for &a in accepted {
            reached[a] = true;
        }
        for n in 1..tree.len() {
            if !reached[tree.parent(n).unwrap()] {
                continue;
            }
            let hit = reached[n];
            for &tag in &infos[n].tags {
                if tag == Source::Esp {
                    self.esp_mass += infos[n].esp_p.unwrap_or(0.0);
                    self.esp_accepted += f64::from(u8::from(hit));
                } else {
                    let r = self.rates.entry(tag).or_default();
                    r.proposed += 1.0;
                    r.accepted += f64::from(u8::from(hit));
                }
            }
        }
    }
}

impl Drafter for Hybrid {
    fn name(&self) -> MethodKind {
        MethodKind::Hybrid
    }

    fn begin(&mut self, model: &Transformer, prompt: &[u32]) -> Result<usize> {
        self.last = None;
        self.rates.clear();
        self.esp_accepted = 1.0;
        self.esp_mass = 1.0;
        self.masks.begin(model, prompt)
    }

    fn draft(&mut self, root: u32, history: &[u32], max_rows: usize) -> Draft {
        let k = self.masks.count();
        let budget = self.cfg.nodes.min(nodes_within(max_rows, k));
        if max_rows < k + 1 {
            self.last = None;
            return Draft::root_only(root);
        }
        let (tree, infos) = self.draft_scored(root, history, budget);
        let probes = esp_probes(tree.len(), k);
        self.last = Some((tree.clone(), infos));
        Draft { tree, probes }
    }

    fn probe_inputs(&self, model: &Transformer, probes: &[Probe]) -> Result<Tensor> {
        self.masks.probe_inputs(model, probes)
    }

    fn observe(&mut self, model: &Transformer, step: &Step) -> Result<()> {
        // A replaced draft was not verified: nothing to learn from it.
        if let Some((tree, infos)) = self.last.take() {
            if !step.replaced {
                self.learn(&tree, &infos, step.accepted);
            }
        }
        let n = 2 * self.cfg.nodes + 2;
        self.masks.observe(model, step, n)
    }
}

#[cfg(test)]
mod tests {
    use super::super::candidates::Candidates;
    use super::*;

    fn cands(list: &[(u32, f32)]) -> Candidates {
        list.to_vec()
    }

    fn hybrid(nodes: usize) -> Hybrid {
        Hybrid::new(HybridConfig::new(1, nodes)).unwrap()
    }

    #[test]
    fn scored_ranks_sources_by_learnt_rates() {
        let mut h = hybrid(3);
        h.cfg.extend = 0;
        let history = [5, 6, 1, 2, 3, 9, 5, 6];
        h.masks
            .set_dists(vec![cands(&[(40, 0.6), (41, 0.3), (42, 0.05)])]);
        // Fresh rates (1/2) for PLD: chain 1 (0.5), 2 (0.25), 3 (0.125); ESP alpha 1: 40 (0.6), 41 (0.3).
        let (t, infos) = h.draft_scored(6, &history, 3);
        assert_eq!(t.tokens(), &[6, 40, 1, 41]);
        assert_eq!(
            infos[2].tags,
            vec![Source::Pld {
                n: 2,
                later: 0,
                depth: 1
            }]
        );
        assert_eq!(infos[1].esp_p, Some(0.6f32 as f64));
        // PLD nodes that are always accepted push the chain ahead of ESP's second candidate.
        for d in 1..=3u8 {
            h.rates.insert(
                Source::Pld {
                    n: 2,
                    later: 0,
                    depth: d,
                },
                Rate {
                    accepted: 95.0,
                    proposed: 100.0,
                },
            );
        }
        let (t, _) = h.draft_scored(6, &history, 3);
        assert_eq!(t.tokens(), &[6, 1, 2, 3]);
        // A node proposed by two sources scores 1 - (1 - p1)(1 - p2).
        h.masks.set_dists(vec![cands(&[(1, 0.5)])]);
        let (t, infos) = h.draft_scored(6, &history, 1);
        assert_eq!(t.tokens(), &[6, 1]);
        assert_eq!(infos[1].tags.len(), 2);
    }

    #[test]
    fn scored_extends_esp_candidates_with_lookup() {
        let mut h = hybrid(4);
        h.cfg.pld_matches = 0;
        // After root 6, ESP proposes 1; "6 1" was followed by "2 3" earlier.
        let history = [6, 1, 2, 3, 8, 6];
        h.masks.set_dists(vec![cands(&[(1, 0.9)])]);
        let (t, infos) = h.draft_scored(6, &history, 4);
        assert_eq!(t.tokens(), &[6, 1, 2, 3, 8]);
        assert_eq!(infos[2].tags, vec![Source::Ext { n: 2, depth: 1 }]);
    }

    #[test]
    fn learning_counts_reached_nodes_only() {
        let mut h = hybrid(4);
        let mut t = TokenTree::new(0);
        let a = t.push(0, 1);
        let b = t.push(a, 2);
        let _c = t.push(b, 3);
        t.push(0, 4); // d
        let tag = |depth| Source::Pld {
            n: 1,
            later: 0,
            depth,
        };
        let infos = vec![
            NodeInfo::default(),
            NodeInfo {
                tags: vec![tag(1)],
                esp_p: None,
            },
            NodeInfo {
                tags: vec![tag(2)],
                esp_p: None,
            },
            NodeInfo {
                tags: vec![tag(3)],
                esp_p: None,
            },
            NodeInfo {
                tags: vec![Source::Esp],
                esp_p: Some(0.25),
            },
        ];
        // Node a accepted (committed 1, then a bonus token): b rejected, c not reached, d rejected.
        h.learn(&t, &infos, &[a]);
        assert_eq!(h.rates[&tag(1)].accepted, 2.0);
        assert_eq!(h.rates[&tag(2)].accepted, 1.0);
        assert_eq!(h.rates[&tag(2)].proposed, 3.0);
        assert!(!h.rates.contains_key(&tag(3)));
        assert_eq!((h.esp_accepted, h.esp_mass), (1.0, 1.25));
    }
}
