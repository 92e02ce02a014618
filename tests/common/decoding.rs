//! Decoding on the tiny checkpoints: the test prompts, the method configurations, and the lossless check
//! (every configuration token-identical to plain decoding, with the same finish reason).

use probespec::decode::generate::{generate, GenerateParams, Generation};
use probespec::decode::method::{
    Budget, EspSpec, EspTree, HybridSpec, LookaheadConfig, Masks, Method, MethodKind, PldConfig,
};
use probespec::model::Transformer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Random prompts over the tiny vocabulary (ids 4..256); every third one repeats a short motif, and every
/// third one copies a random stretch of itself, so ESP's masks, prompt lookup and the n-gram pool all find
/// something to draft from.
pub fn prompts(n: usize, len: std::ops::Range<usize>, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let l = rng.random_range(len.clone());
            match i % 3 {
                2 => {
                    let motif: Vec<u32> = (0..4).map(|_| rng.random_range(4..256)).collect();
                    (0..l).map(|j| motif[j % 4]).collect()
                }
                1 => {
                    let mut p: Vec<u32> = (0..l).map(|_| rng.random_range(4..256)).collect();
                    if l > 8 {
                        let (a, k) = (rng.random_range(0..l / 2), l / 4);
                        for j in 0..k {
                            p[l - k + j] = p[a + j];
                        }
                    }
                    p
                }
                _ => (0..l).map(|_| rng.random_range(4..256)).collect(),
            }
        })
        .collect()
}

/// One-token prompts, one per id in `ids` (spread over the vocabulary).
pub fn one_token_prompts(ids: std::ops::Range<u32>) -> Vec<Vec<u32>> {
    ids.map(|t| vec![t * 17 % 252 + 4]).collect()
}

/// Greedy decoding of at most `max_new` tokens, stopping at `stops`.
pub fn greedy(max_new: usize, stops: Vec<u32>) -> GenerateParams {
    GenerateParams {
        max_new_tokens: max_new,
        sampling: Default::default(),
        stop_tokens: stops,
        max_block_rows: None,
    }
}

/// Generates with `method`'s drafter (seeded by the sampling seed, as the CLI does).
pub fn run(model: &Transformer, prompt: &[u32], method: &Method, params: &GenerateParams) -> Generation {
    let mut d = method
        .drafter(params.sampling.seed)
        .unwrap_or_else(|e| panic!("{method:?}: {e:#}"));
    generate(model, prompt, d.as_mut(), params, &mut |_| Ok(())).unwrap()
}

fn masks(k: usize) -> Masks {
    Masks {
        count: k,
        ..Masks::default()
    }
}

/// ESP with `k` masks per node at block complexity `bc` (mean-initialised masks, lambda 0.1).
pub fn esp(bc: usize, k: usize, tree: EspTree) -> Method {
    Method::Esp(EspSpec {
        masks: masks(k),
        budget: Budget::Fixed(bc),
        tree,
    })
}

/// ESP with `--bc auto`: plain steps, probing steps and trees, as the measured cost curve and acceptance
/// decide.
pub fn esp_auto(k: usize) -> Method {
    Method::Esp(EspSpec {
        masks: masks(k),
        budget: Budget::Auto,
        tree: EspTree::Dynamic,
    })
}

/// Prompt lookup with a fixed chain length.
pub fn pld(max_ngram: usize, draft_len: usize) -> Method {
    Method::Pld(PldConfig {
        max_ngram,
        draft_len: Some(draft_len),
    })
}

/// Prompt lookup with `--bc auto`: the chain length chosen per step.
pub fn pld_auto(max_ngram: usize) -> Method {
    Method::Pld(PldConfig {
        max_ngram,
        draft_len: None,
    })
}

/// Lookahead with a fixed window.
pub fn lookahead(window: usize, ngram: usize, guesses: usize) -> Method {
    Method::Lookahead(LookaheadConfig {
        window: Some(window),
        ngram,
        guesses,
        seed: 0,
    })
}

/// Lookahead with `--bc auto`: the window and the verification nodes chosen per step.
pub fn lookahead_auto(ngram: usize, guesses: usize) -> Method {
    Method::Lookahead(LookaheadConfig {
        window: None,
        ngram,
        guesses,
        seed: 0,
    })
}

/// Hybrid with `k` masks at block complexity `bc`, prompt lookup at its defaults (n-gram 3, chains of 10).
pub fn hybrid(bc: usize, k: usize) -> Method {
    Method::Hybrid(HybridSpec {
        masks: masks(k),
        budget: Budget::Fixed(bc),
        lookup: PldConfig::default(),
    })
}

/// Hybrid with `k` masks and `--bc auto`: the node count chosen per step.
pub fn hybrid_auto(k: usize) -> Method {
    Method::Hybrid(HybridSpec {
        masks: masks(k),
        budget: Budget::Auto,
        lookup: PldConfig::default(),
    })
}

/// Every ESP configuration: k = 1..=3 at BC 10/30/60, dynamic and static trees, --bc auto, explicit branches
/// (the paper's among them, docs/ESP.md).
pub fn esp_configs() -> Vec<Method> {
    let mut v = Vec::new();
    for k in 1..=3 {
        for bc in [10, 30, 60] {
            if bc < 2 * (k + 1) {
                continue;
            }
            v.push(esp(bc, k, EspTree::Dynamic));
            v.push(esp(bc, k, EspTree::Static(None)));
        }
    }
    v.push(esp_auto(1));
    v.push(esp(60, 2, EspTree::Static(Some(vec![15, 4]))));
    v.push(esp(60, 3, EspTree::Static(Some(vec![7, 5, 3]))));
    v
}

pub fn pld_configs() -> Vec<Method> {
    vec![
        pld(3, 10),
        pld(1, 10),
        pld(2, 5),
        pld(3, 1),
        pld(4, 16),
        pld_auto(3),
    ]
}

/// Spec-Bench's setting, the paper's three BC-matched settings, and degenerate ones.
pub fn lookahead_configs() -> Vec<Method> {
    vec![
        lookahead(7, 5, 7),
        lookahead(4, 3, 1),
        lookahead(5, 4, 5),
        lookahead(8, 5, 7),
        lookahead(1, 2, 1),
        lookahead_auto(5, 7),
        lookahead_auto(3, 2),
    ]
}

pub fn hybrid_configs() -> Vec<Method> {
    let mut v: Vec<Method> = [(10, 1), (30, 1), (60, 1), (30, 2), (60, 2), (12, 3)]
        .into_iter()
        .map(|(bc, k)| hybrid(bc, k))
        .collect();
    v.push(hybrid_auto(1));
    v.push(hybrid_auto(2));
    v
}

/// The configurations of the drafters other than ESP: prompt lookup, lookahead, hybrid.
pub fn peer_configs() -> Vec<Method> {
    let mut v = pld_configs();
    v.extend(lookahead_configs());
    v.extend(hybrid_configs());
    v
}

/// Every configuration of every speculative method.
pub fn all_configs() -> Vec<Method> {
    let mut v = esp_configs();
    v.extend(peer_configs());
    v
}

/// Pooled (committed, calls, runs) per method.
pub type Pooled = HashMap<MethodKind, (usize, usize, usize)>;

/// Checks every configuration against plain decoding on every prompt: same tokens, same finish reason,
/// every token but the first committed by a model call; zero mismatches allowed. Returns what each method
/// committed, pooled over its configurations and the prompts.
pub fn check_all(
    model: &Transformer,
    prompts: &[Vec<u32>],
    configs: &[Method],
    params: &GenerateParams,
) -> Pooled {
    let mut pooled = Pooled::new();
    for p in prompts {
        let want = run(model, p, &Method::Ar, params);
        for m in configs {
            let got = run(model, p, m, params);
            assert_eq!(got.tokens, want.tokens, "mismatch: {m:?}, prompt len {}", p.len());
            assert_eq!(got.finish_reason, want.finish_reason, "{m:?}");
            assert_eq!(
                got.stats.committed_by_calls(),
                got.tokens.len() - 1,
                "{m:?}: every token but the first is committed by a call"
            );
            assert_eq!(got.stats.method, m.kind());
            let e = pooled.entry(m.kind()).or_default();
            e.0 += got.stats.committed_by_calls();
            e.1 += got.stats.model_calls;
            e.2 += 1;
        }
    }
    pooled
}

/// Tokens committed per model call, pooled over a method's runs.
pub fn tau(p: &Pooled, method: MethodKind) -> f64 {
    let (c, n, _) = p[&method];
    c as f64 / n as f64
}

/// Fails unless every method in `pooled` committed more than 1.05 tokens per call: the speculative path
/// must actually be exercised, or a lossless check proves nothing.
pub fn assert_acceptance_exercised(pooled: &Pooled) {
    let mut kinds: Vec<MethodKind> = pooled.keys().copied().collect();
    kinds.sort_by_key(|k| k.name());
    for m in kinds {
        let t = tau(pooled, m);
        eprintln!("pooled {m} tau {t:.3}");
        assert!(t > 1.05, "{m}: tau {t:.3} too low to exercise acceptance");
    }
}

/// Logits of every row of `ids`, fed to the model in consecutive blocks of the given sizes (each block
/// after the cache of the previous ones).
pub fn logits_in_blocks(m: &Transformer, ids: &[u32], blocks: &[usize]) -> Vec<f32> {
    use probespec::model::BlockMask;
    let mut cache = m.new_cache(ids.len()).unwrap();
    let (mut out, mut at) = (Vec::new(), 0);
    for &b in blocks.iter().cycle() {
        if at == ids.len() {
            break;
        }
        let b = b.min(ids.len() - at);
        let positions: Vec<u32> = (at as u32..(at + b) as u32).collect();
        let h = m
            .forward(
                &m.embed(&ids[at..at + b]).unwrap(),
                &positions,
                &BlockMask::Causal,
                &mut cache,
            )
            .unwrap();
        let rows: Vec<usize> = (0..b).collect();
        out.extend(
            m.logits(&h, &rows)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
        );
        at += b;
    }
    out
}

pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// What the library's `generate` gives `prompt` (token ids) with `method`, up to `max_new` tokens and
/// `l`'s stop tokens: the answer the server and the CLI must give for the same request.
pub fn library_tokens(
    l: &probespec::model::LoadedModel,
    prompt: &[u32],
    method: &Method,
    max_new: usize,
    sampling: probespec::decode::sampling::SamplingParams,
) -> Vec<u32> {
    let params = GenerateParams {
        max_new_tokens: max_new,
        sampling,
        stop_tokens: l.tokenizer.stop_tokens().to_vec(),
        max_block_rows: None,
    };
    let mut d = method.drafter(sampling.seed).unwrap();
    generate(&l.model, prompt, d.as_mut(), &params, &mut |_| Ok(()))
        .unwrap()
        .tokens
}
