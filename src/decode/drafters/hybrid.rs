//! Hybrid drafter: ESP's mask-token candidates, prompt lookup and n-gram continuations merged into ONE tree
//! per step under ONE block complexity, `BC = (k + 1) (1 + nodes)` as for ESP: every node carries k mask
//! probes, and the masks of the deepest accepted node seed the next step's ESP candidates (exactly as in
//! [`super::esp`], whose [`MaskEmbedding`](super::esp::MaskEmbedding) and candidate lists this reuses).
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
//! Under `--bc auto` (no fixed node budget) the same scores also size the tree: a node's score is the
//! chance the verifier reaches it, so keeping the best m nodes is expected to commit 1 + the sum of their
//! scores, and m is chosen every step (0: plain decoding) by tokens per second at the current cache length,
//! up to [`AUTO_MAX_NODES`]. How the budget splits between the sources follows from their learnt rates.
//! The block may also go without mask probes (half the rows with k = 1) when what the masks would buy
//! next step, estimated by what this step's ESP-only nodes are worth, does not pay for them; the
//! exploring block brings them back.
//!
//! The draft depends only on the history and on the probes' logits, never on the step's own random draws:
//! sample matching in the shared verifier keeps it exact under sampling.

use super::candidates::dynamic_tree;
use super::esp::{MaskProbes, Masks};
use super::ngram::{distinct_matches, lookup};
use crate::decode::auto::{
    best_first, chain_rate, prefix_offers, subtree, tried_nodes, Choice, Chooser, Offer, Rate,
};
use crate::decode::budget::{nodes_within, rows_for, MAX_BC};
use crate::decode::check_flag;
use crate::decode::cost_cache::curve_for;
use crate::decode::generate::{Beside, Draft, Drafter, Step};
use crate::decode::kind::MethodKind;
use crate::decode::layout::{esp_probes, Probe};
use crate::decode::tree::TokenTree;
use crate::model::Transformer;
use anyhow::{bail, Result};
use candle_core::Tensor;
use std::collections::HashMap;

/// Most draft nodes `--bc auto` considers (BC 60 with one mask).
pub const AUTO_MAX_NODES: usize = 29;

#[derive(Debug, Clone)]
pub struct HybridConfig {
    pub masks: Masks,
    /// Draft nodes per step (sum K_i = BC / (k + 1) - 1); `None`: chosen per step (`--bc auto`).
    pub nodes: Option<usize>,
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
    /// The defaults for a node budget (`None`: `--bc auto`) and k: 3-gram lookup, chains of up to 10
    /// tokens.
    pub fn new(k: usize, nodes: Option<usize>) -> Self {
        HybridConfig {
            masks: Masks {
                count: k,
                ..Masks::default()
            },
            nodes,
            max_ngram: 3,
            draft_len: super::pld::DEFAULT_DRAFT_LEN,
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

    /// The `budget` best nodes as a tree (best first: every prefix of its nodes is a tree), with their
    /// infos and scores (the root's is 1).
    fn select(self, budget: usize) -> (TokenTree, Vec<NodeInfo>, Vec<f64>) {
        let t = &self.tree;
        let mut score = vec![1.0f64; t.len()];
        for n in 1..t.len() {
            score[n] = score[t.parent(n).unwrap()] * (1.0 - self.miss[n]);
        }
        let mut order = best_first(t, &score);
        order.truncate(budget);
        let (out, from) = subtree(t, &order);
        let mut info = self.info;
        let infos = from.iter().map(|&n| std::mem::take(&mut info[n])).collect();
        let scores = from.iter().map(|&n| score[n]).collect();
        (out, infos, scores)
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
    /// `--bc auto`'s chooser of the node count.
    auto: Option<Chooser>,
}

impl Hybrid {
    pub fn new(cfg: HybridConfig) -> Result<Self> {
        let masks = MaskProbes::new(cfg.masks, cfg.seed)?;
        if let Some(nodes) = cfg.nodes {
            if !(1..=MAX_BC).contains(&nodes) {
                bail!("the hybrid needs a node budget in 1..={MAX_BC} (got {nodes})");
            }
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
            auto: None,
        })
    }

    /// Most nodes a step may have.
    fn max_nodes(&self) -> usize {
        self.cfg.nodes.unwrap_or(AUTO_MAX_NODES)
    }

    /// The learnt acceptance of a source's node; a chain depth not tried yet takes the rate of the depth
    /// above it (with the same match length).
    fn rate(&self, s: Source) -> f64 {
        let at = |d: usize| match s {
            Source::Pld { n, later, .. } => Source::Pld {
                n,
                later,
                depth: depth_key(d),
            },
            Source::Ext { n, .. } => Source::Ext {
                n,
                depth: depth_key(d),
            },
            Source::Esp => Source::Esp,
        };
        let depth = match s {
            Source::Pld { depth, .. } | Source::Ext { depth, .. } => usize::from(depth.max(1)),
            Source::Esp => 1,
        };
        chain_rate(depth, |d| self.rates.get(&at(d)).copied())
    }

    fn esp_alpha(&self) -> f64 {
        self.esp_accepted / self.esp_mass
    }

    /// Every source into one candidate trie, the best `budget` nodes kept.
    fn draft_scored(
        &self,
        root: u32,
        history: &[u32],
        budget: usize,
    ) -> (TokenTree, Vec<NodeInfo>, Vec<f64>) {
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
        for (n, hit) in tried_nodes(tree, accepted) {
            for &tag in &infos[n].tags {
                if tag == Source::Esp {
                    self.esp_mass += infos[n].esp_p.unwrap_or(0.0);
                    self.esp_accepted += f64::from(u8::from(hit));
                } else {
                    self.rates.entry(tag).or_default().record(hit);
                }
            }
        }
    }
}

impl Drafter for Hybrid {
    fn beside(&mut self, beside: Beside) {
        if let Some(a) = &mut self.auto {
            a.beside(beside);
        }
    }

    fn name(&self) -> MethodKind {
        MethodKind::Hybrid
    }

    fn begin(&mut self, model: &Transformer, prompt: &[u32]) -> Result<usize> {
        self.last = None;
        self.rates.clear();
        self.esp_accepted = 1.0;
        self.esp_mass = 1.0;
        self.auto = match self.cfg.nodes {
            Some(_) => None,
            None => Some(Chooser::new(curve_for(model)?).exploring_with(self.masks.count() + 1)),
        };
        self.masks.begin(model, prompt)
    }

    fn draft(&mut self, root: u32, history: &[u32], max_rows: usize) -> Draft {
        let k = self.masks.count();
        self.last = None;
        if max_rows < k + 1 {
            return Draft::root_only(root);
        }
        let budget = self.max_nodes().min(nodes_within(max_rows, k));
        let (mut tree, mut infos, scores) = self.draft_scored(root, history, budget);
        let mut with_masks = true;
        if let Some(chooser) = &mut self.auto {
            // Offer m (1..=n) is the best m nodes with their masks, offer n + m the same nodes without:
            // a mask row costs as much as a draft row, and what masks buy arrives one step later, as the
            // candidates only ESP proposes. That is priced as this step's ESP-only nodes once more (their
            // reach probabilities: what the last step's masks bought). The root's masks alone (offer 0)
            // never beat plain decoding, but they are there to explore: without masks ESP has no
            // candidates to offer.
            let n = scores.len() - 1;
            let esp_only =
                |i: usize| infos[i].tags.iter().all(|&t| t == Source::Esp) && !infos[i].tags.is_empty();
            let mut offers = vec![Offer {
                rows: rows_for(k, 0),
                tokens: 1.0,
            }];
            let mut masks_buy = 0.0;
            for (i, mut o) in prefix_offers(&scores[1..], |m| rows_for(k, m))
                .into_iter()
                .enumerate()
            {
                if esp_only(i + 1) {
                    masks_buy += scores[i + 1].clamp(0.0, 1.0);
                }
                o.tokens += masks_buy;
                offers.push(o);
            }
            offers.extend(prefix_offers(&scores[1..], |m| 1 + m));
            let m = match chooser.choose(history.len() - 1, &offers) {
                Choice::Plain => return Draft::root_only(root),
                Choice::Explore => 0,
                Choice::Offer(i) if i <= n => i,
                Choice::Offer(i) => {
                    with_masks = false;
                    i - n
                }
            };
            let keep: Vec<usize> = (1..=m).collect();
            tree = subtree(&tree, &keep).0;
            infos.truncate(m + 1);
        }
        let probes = if with_masks {
            esp_probes(tree.len(), k)
        } else {
            Vec::new()
        };
        self.last = Some((tree.clone(), infos));
        Draft { tree, probes }
    }

    fn probe_inputs(&self, model: &Transformer, probes: &[Probe]) -> Result<Tensor> {
        self.masks.probe_inputs(model, probes)
    }

    fn observe(&mut self, _: &Transformer, step: &Step) -> Result<()> {
        if let Some(chooser) = &mut self.auto {
            chooser.record(step);
        }
        // A replaced draft was not verified: nothing to learn from it.
        if let Some((tree, infos)) = self.last.take() {
            if !step.replaced {
                self.learn(&tree, &infos, step.accepted);
            }
        }
        let n = 2 * self.max_nodes() + 2;
        self.masks.observe(step, n);
        Ok(())
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
        Hybrid::new(HybridConfig::new(1, Some(nodes))).unwrap()
    }

    #[test]
    fn scored_ranks_sources_by_learnt_rates() {
        let mut h = hybrid(3);
        h.cfg.extend = 0;
        let history = [5, 6, 1, 2, 3, 9, 5, 6];
        h.masks
            .set_dists(vec![cands(&[(40, 0.6), (41, 0.3), (42, 0.05)])]);
        // Fresh rates (1/2) for PLD: chain 1 (0.5), 2 (0.25), 3 (0.125); ESP alpha 1: 40 (0.6), 41 (0.3).
        let (t, infos, _) = h.draft_scored(6, &history, 3);
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
        let (t, _, _) = h.draft_scored(6, &history, 3);
        assert_eq!(t.tokens(), &[6, 1, 2, 3]);
        // A node proposed by two sources scores 1 - (1 - p1)(1 - p2).
        h.masks.set_dists(vec![cands(&[(1, 0.5)])]);
        let (t, infos, _) = h.draft_scored(6, &history, 1);
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
        let (t, infos, _) = h.draft_scored(6, &history, 4);
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
