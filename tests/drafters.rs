//! The training-free peers (prompt lookup, lookahead) and the hybrid drafter must be token-identical to plain
//! greedy decoding of the same binary, in every configuration, and keep the model's distribution under
//! sampling. Tiny random LLaMA and Qwen 3 checkpoints, many prompts (as tests/lossless.rs does for ESP).

mod common;

use common::TinySpec;
use probespec::cli::{make_drafter, HybridModeArg, MethodArg, MethodArgs};
use probespec::decode::ar::Autoregressive;
use probespec::decode::generate::{generate, GenerateParams};
use probespec::decode::sampling::SamplingParams;
use probespec::model::Transformer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Random prompts; every third one repeats a short motif and every third one copies a random stretch of
/// itself (prompt lookup and the n-gram pool find something to draft from).
fn prompts(n: usize, len: std::ops::Range<usize>, seed: u64) -> Vec<Vec<u32>> {
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

fn pld(ngram: usize, draft_len: usize) -> MethodArgs {
    MethodArgs {
        method: MethodArg::Pld,
        ngram,
        draft_len,
        ..MethodArgs::default()
    }
}

fn lookahead(w: usize, n: usize, g: usize) -> MethodArgs {
    MethodArgs {
        method: MethodArg::Lookahead,
        lookahead_window: w,
        lookahead_ngram: n,
        lookahead_guesses: g,
        ..MethodArgs::default()
    }
}

fn hybrid(bc: usize, masks: usize, mode: HybridModeArg) -> MethodArgs {
    MethodArgs {
        method: MethodArg::Hybrid,
        bc,
        masks,
        hybrid_mode: mode,
        ..MethodArgs::default()
    }
}

fn pld_configs() -> Vec<MethodArgs> {
    vec![pld(3, 10), pld(1, 10), pld(2, 5), pld(3, 1), pld(4, 16)]
}

/// Spec-Bench's setting, the paper's three BC-matched settings, and degenerate ones.
fn lookahead_configs() -> Vec<MethodArgs> {
    vec![
        lookahead(7, 5, 7),
        lookahead(4, 3, 1),
        lookahead(5, 4, 5),
        lookahead(8, 5, 7),
        lookahead(1, 2, 1),
    ]
}

fn hybrid_configs() -> Vec<MethodArgs> {
    let mut v = Vec::new();
    for mode in [HybridModeArg::Scored, HybridModeArg::Simple] {
        for (bc, k) in [(10, 1), (30, 1), (60, 1), (30, 2), (60, 2), (12, 3)] {
            v.push(hybrid(bc, k, mode));
        }
    }
    v
}

/// Pooled (committed, calls, runs) per method name.
type Pooled = HashMap<String, (usize, usize, usize)>;

/// Checks every configuration against plain decoding on every prompt: zero mismatches allowed.
fn check_all(
    model: &Transformer,
    prompts: &[Vec<u32>],
    configs: &[MethodArgs],
    params: &GenerateParams,
) -> Pooled {
    let mut pooled = Pooled::new();
    for p in prompts {
        let want = generate(model, p, &mut Autoregressive, params, &mut |_| Ok(())).unwrap();
        for m in configs {
            let got = common::run(model, p, m, params);
            assert_eq!(
                got.tokens,
                want.tokens,
                "mismatch: {:?} prompt len {} ({:?})",
                m.method,
                p.len(),
                m
            );
            assert_eq!(got.finish_reason, want.finish_reason, "{m:?}");
            assert_eq!(
                got.stats.committed_by_calls(),
                got.tokens.len() - 1,
                "{m:?}: every token but the first is committed by a call"
            );
            let e = pooled.entry(got.stats.method.clone()).or_default();
            e.0 += got.stats.committed_by_calls();
            e.1 += got.stats.model_calls;
            e.2 += 1;
        }
    }
    pooled
}

fn tau(p: &Pooled, method: &str) -> f64 {
    let (c, n, _) = p[method];
    c as f64 / n as f64
}

fn all_configs() -> Vec<MethodArgs> {
    let mut v = pld_configs();
    v.extend(lookahead_configs());
    v.extend(hybrid_configs());
    v
}

fn lossless_on(spec: TinySpec, seed: u64) {
    let (_d, model) = common::load_tiny(&spec);
    let pooled = check_all(
        &model,
        &prompts(9, 1..48, seed),
        &all_configs(),
        &common::greedy(48, vec![]),
    );
    for m in ["pld", "lookahead", "hybrid"] {
        eprintln!("pooled {m} tau {:.3}", tau(&pooled, m));
        // The speculative path must actually be exercised, or the test proves nothing.
        assert!(
            tau(&pooled, m) > 1.05,
            "{m}: tau {:.3} too low to exercise acceptance",
            tau(&pooled, m)
        );
    }
}

#[test]
fn lossless_on_tiny_llama_every_configuration() {
    lossless_on(TinySpec::llama(), 21);
}

#[test]
fn lossless_on_tiny_qwen3_every_configuration() {
    lossless_on(TinySpec::qwen3(), 22);
}

#[test]
fn one_token_prompts() {
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let (_d, model) = common::load_tiny(&spec);
        let ps: Vec<Vec<u32>> = (4..10).map(|t| vec![t * 17 % 252 + 4]).collect();
        check_all(&model, &ps, &all_configs(), &common::greedy(32, vec![]));
    }
}

#[test]
fn prompts_near_the_context_limit() {
    // max_position_embeddings is 512: prompts of 480..510 tokens run into the window mid-draft (chains,
    // lookahead windows and mask probes cut short or dropped).
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let ps = prompts(6, 480..511, 23);
    check_all(&model, &ps, &all_configs(), &common::greedy(64, vec![]));
}

#[test]
fn stop_token_and_length_limit_inside_an_accepted_path() {
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let ps = prompts(6, 2..30, 24);
    let configs = [
        pld(3, 10),
        lookahead(7, 5, 7),
        hybrid(30, 1, HybridModeArg::Scored),
        hybrid(30, 1, HybridModeArg::Simple),
    ];
    let mut stop_inside = 0;
    for p in &ps {
        let free = generate(
            &model,
            p,
            &mut Autoregressive,
            &common::greedy(40, vec![]),
            &mut |_| Ok(()),
        )
        .unwrap();
        for &stop in free.tokens[5..].iter().take(3) {
            check_all(
                &model,
                std::slice::from_ref(p),
                &configs,
                &common::greedy(40, vec![stop]),
            );
            for m in &configs {
                if common::run(&model, p, m, &common::greedy(40, vec![stop]))
                    .stats
                    .committed_histogram
                    .len()
                    > 2
                {
                    stop_inside += 1;
                }
            }
        }
        for max_new in [1, 2, 3, 5, 8, 13] {
            check_all(
                &model,
                std::slice::from_ref(p),
                &configs,
                &common::greedy(max_new, vec![]),
            );
        }
    }
    assert!(
        stop_inside > 0,
        "no run accepted more than one token: the stop case was not exercised"
    );
}

/// Lookahead windows and prompt-lookup chains longer than the KV cache's margin over the prompt and
/// --max-new-tokens (256 rows), up to the flags' bounds: the prefill's probe rows fit the cache, and the
/// output is plain decoding's.
#[test]
fn drafts_larger_than_the_cache_margin() {
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let configs = [
        lookahead(300, 5, 7),
        lookahead(1024, 1024, 1024),
        pld(1024, 1024),
        hybrid(1024, 1, HybridModeArg::Scored),
    ];
    let ps = prompts(3, 2..30, 27);
    for max_new in [1, 3, 40] {
        check_all(&model, &ps, &configs, &common::greedy(max_new, vec![]));
    }
}

#[test]
fn hybrid_beats_its_parents_on_repetitive_text() {
    // Not a benchmark: a sanity check that merging sources does not lose what each source finds alone.
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let ps = prompts(9, 8..48, 25);
    let configs = [
        pld(3, 10),
        MethodArgs {
            method: MethodArg::Esp,
            bc: 30,
            masks: 1,
            ..MethodArgs::default()
        },
        hybrid(30, 1, HybridModeArg::Simple),
        hybrid(30, 1, HybridModeArg::Scored),
    ];
    let params = common::greedy(48, vec![]);
    let mut taus = Vec::new();
    for m in &configs {
        let p = check_all(&model, &ps, std::slice::from_ref(m), &params);
        let name = p.keys().next().unwrap().clone();
        taus.push(tau(&p, &name));
    }
    eprintln!(
        "tau pld {:.3} esp {:.3} hybrid-simple {:.3} hybrid-scored {:.3}",
        taus[0], taus[1], taus[2], taus[3]
    );
    let best_parent = taus[0].max(taus[1]);
    assert!(
        taus[2] >= 0.95 * best_parent,
        "simple hybrid {:.3} vs best parent {best_parent:.3}",
        taus[2]
    );
    assert!(
        taus[3] >= 0.95 * best_parent,
        "scored hybrid {:.3} vs best parent {best_parent:.3}",
        taus[3]
    );
}

/// Determinism, not a distribution test (tests/sampling.rs tests the distribution): the verifier draws
/// one random number per committed token, as plain decoding does, so under sampling every drafter gives
/// exactly plain sampling's tokens for the same seed, with drafts accepted along the way.
#[test]
fn same_seed_gives_identical_output_under_sampling() {
    let mut spec = TinySpec::llama();
    spec.scale = 0.5; // sharp enough that the model loops and lookup drafts get accepted
    let (_d, model) = common::load_tiny(&spec);
    let methods = [
        pld(3, 10),
        lookahead(7, 5, 7),
        hybrid(30, 1, HybridModeArg::Scored),
        hybrid(30, 2, HybridModeArg::Simple),
    ];
    let mut accepted: HashMap<String, usize> = HashMap::new();
    for (i, prompt) in prompts(6, 8..24, 26).iter().enumerate() {
        for seed in 0..10u64 {
            for (temperature, top_p, top_k) in [(0.7, 1.0, 0), (1.3, 0.9, 0), (1.0, 1.0, 5)] {
                let params = GenerateParams {
                    max_new_tokens: 24,
                    sampling: SamplingParams {
                        temperature,
                        top_p,
                        top_k,
                        seed: seed + 100 * i as u64,
                    },
                    stop_tokens: vec![],
                };
                let a = generate(&model, prompt, &mut Autoregressive, &params, &mut |_| Ok(())).unwrap();
                for m in &methods {
                    let e = common::run(&model, prompt, m, &params);
                    assert_eq!(e.tokens, a.tokens, "seed {}, {m:?}", params.sampling.seed);
                    *accepted.entry(e.stats.method.clone()).or_default() +=
                        e.stats.committed_by_calls() - e.stats.model_calls;
                }
            }
        }
    }
    eprintln!("drafts accepted: {accepted:?}");
    for (m, &n) in &accepted {
        assert!(
            n >= 10,
            "{m}: only {n} drafts accepted: too few to exercise acceptance"
        );
    }
}

#[test]
fn method_flags_parse_and_bad_values_fail() {
    use clap::Parser;
    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        m: MethodArgs,
    }
    let t = T::parse_from([
        "t",
        "--method",
        "lookahead",
        "--lookahead-window",
        "4",
        "--lookahead-ngram",
        "3",
        "--lookahead-guesses",
        "1",
    ]);
    assert_eq!(
        (
            t.m.method,
            t.m.lookahead_window,
            t.m.lookahead_ngram,
            t.m.lookahead_guesses
        ),
        (MethodArg::Lookahead, 4, 3, 1)
    );
    let d = MethodArgs::default();
    assert_eq!(
        (
            d.ngram,
            d.draft_len,
            d.lookahead_window,
            d.lookahead_ngram,
            d.lookahead_guesses
        ),
        (3, 10, 7, 5, 7)
    );
    let t = T::parse_from(["t", "--method", "pld", "--ngram", "2", "--draft-len", "5"]);
    assert_eq!((t.m.method, t.m.ngram, t.m.draft_len), (MethodArg::Pld, 2, 5));
    let t = T::parse_from([
        "t",
        "--method",
        "hybrid",
        "--bc",
        "60",
        "--masks",
        "2",
        "--hybrid-mode",
        "simple",
    ]);
    assert_eq!(
        (t.m.method, t.m.bc, t.m.masks, t.m.hybrid_mode),
        (MethodArg::Hybrid, 60, 2, HybridModeArg::Simple)
    );
    for bad in [
        pld(0, 10),
        pld(3, 0),
        lookahead(0, 5, 7),
        lookahead(7, 1, 7),
        lookahead(7, 5, 0),
        hybrid(3, 1, HybridModeArg::Scored),
        hybrid(30, 4, HybridModeArg::Scored),
        // Sizes beyond any use (they would only allocate): bounded.
        pld(1025, 10),
        pld(3, 1 << 40),
        lookahead(1 << 40, 5, 7),
        lookahead(7, 1025, 7),
        lookahead(7, 5, 1 << 40),
        hybrid(1025, 1, HybridModeArg::Scored),
        MethodArgs {
            draft_len: 1025,
            ..hybrid(30, 1, HybridModeArg::Simple)
        },
    ] {
        assert!(make_drafter(&bad, 0).is_err(), "{bad:?} should be rejected");
    }
}
