//! Under sampling, every decoding method (plain autoregressive decoding included) draws its tokens from
//! the model's exact distribution: temperature, top-p and top-k as `probespec::decode::sampling` specifies.
//!
//! The context is fixed (a prompt chosen so that drafts get accepted, plus the model's greedy output), the
//! seed varies. Each run generates 3 tokens from that context; the test looks at the pair (t1, t2): t1 is
//! sampled at the prefill, t2 at the first verification step, where the drafter's tree was verified
//! (accepted as a draft when the step also committed t3, else the step's bonus token). The exact joint
//! probability `p(t1 | context) p(t2 | context, t1)` comes from the tiny model's own forward passes.
//!
//! Each method's pairs get a Pearson chi-square goodness-of-fit test against the exact joint distribution,
//! and a two-sample chi-square homogeneity test against plain decoding's pairs drawn with disjoint seeds.
//! Every test is at a false-alarm rate of alpha = 1e-3 (9 tests per setting below: about 1% per setting).
//! The seeds are fixed, so a run is deterministic; `the_tests_reject_a_wrong_distribution` shows that the
//! same statistics, on the same number of samples, reject samples drawn at another temperature.

mod common;

use common::decoding::{esp, greedy, hybrid, lookahead, pld, prompts, run};
use common::TinySpec;
use probespec::decode::generate::GenerateParams;
use probespec::decode::method::{EspTree, Method, MethodKind};
use probespec::decode::sampling::SamplingParams;
use probespec::model::{BlockMask, Transformer};
use std::collections::HashMap;

/// Runs (seeds) per method and setting.
const RUNS: u64 = 600;

type Pair = (u32, u32);

/// Plain decoding first: the others are compared with its samples.
fn methods() -> Vec<Method> {
    vec![
        Method::Ar,
        esp(30, 1, EspTree::Dynamic),
        pld(3, 10),
        lookahead(7, 5, 7),
        hybrid(30, 1),
    ]
}

fn sampling(temperature: f32, top_p: f32, top_k: usize) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p,
        top_k,
        seed: 0,
    }
}

/// The tiny model and the fixed context: of 30 random prompts (a third repeat a motif, a third copy a
/// stretch of themselves) each followed by 40 tokens of the model's greedy output, the one on which greedy
/// prompt lookup accepts the most, so that drafts get accepted under sampling too.
fn model_and_context() -> (tempfile::TempDir, Transformer, Vec<u32>) {
    let mut spec = TinySpec::llama();
    spec.scale = 0.5; // sharp enough that the model loops, diverse enough to sample from
    let (dir, model) = common::load_tiny(&spec);
    let pld = &methods()[2];
    let context = prompts(30, 10..24, 26)
        .into_iter()
        .map(|p| {
            let g = run(&model, &p, &Method::Ar, &greedy(40, vec![]));
            [p, g.tokens].concat()
        })
        .max_by_key(|p| {
            let g = run(&model, p, pld, &greedy(8, vec![]));
            (g.tokens.len() - g.stats.model_calls, std::cmp::Reverse(p.len()))
        })
        .unwrap();
    (dir, model, context)
}

/// Logits after `context` and after `context + [a]` for each `a` of `next`, by plain causal forwards.
fn logits_after(model: &Transformer, context: &[u32], next: &[u32]) -> (Vec<f32>, HashMap<u32, Vec<f32>>) {
    let n = context.len();
    let mut cache = model.new_cache(n + 1).unwrap();
    let positions: Vec<u32> = (0..n as u32).collect();
    let h = model
        .forward(
            &model.embed(context).unwrap(),
            &positions,
            &BlockMask::Causal,
            &mut cache,
        )
        .unwrap();
    let first = model
        .logits(&h, &[n - 1])
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
        .remove(0);
    let mut after = HashMap::new();
    for &a in next {
        cache.truncate(n);
        let h = model
            .forward(
                &model.embed(&[a]).unwrap(),
                &[n as u32],
                &BlockMask::Causal,
                &mut cache,
            )
            .unwrap();
        after.insert(
            a,
            model
                .logits(&h, &[0])
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
                .remove(0),
        );
    }
    (first, after)
}

/// The exact joint probabilities `p(t1) p(t2 | t1)`, zeros included, for every `t2` and every `t1` that
/// was observed (`first_tokens`) or has an expected count of at least 1 in `RUNS` runs: so every category
/// the test can keep as a bin (expected count 5 or more) is listed whatever the samples; the mass of the
/// others is pooled by the test.
fn exact_pairs(
    model: &Transformer,
    context: &[u32],
    first_tokens: &[u32],
    params: &SamplingParams,
) -> HashMap<Pair, f64> {
    let (l1, _) = logits_after(model, context, &[]);
    let p1 = common::sampling_probs(&l1, params);
    let mut firsts: Vec<u32> = (0..p1.len() as u32)
        .filter(|&a| p1[a as usize] * RUNS as f64 >= 1.0)
        .chain(first_tokens.iter().copied())
        .collect();
    firsts.sort();
    firsts.dedup();
    let (_, l2) = logits_after(model, context, &firsts);
    let mut joint = HashMap::new();
    for &a in &firsts {
        let p2 = common::sampling_probs(&l2[&a], params);
        for (b, &q) in p2.iter().enumerate() {
            joint.insert((a, b as u32), p1[a as usize] * q);
        }
    }
    joint
}

/// The (t1, t2) pairs of `RUNS` runs with seeds `first_seed..`, and in how many runs t2 was an accepted
/// draft (the first verification step committed both t2 and t3).
fn sample_pairs(
    model: &Transformer,
    context: &[u32],
    m: &Method,
    params: &SamplingParams,
    first_seed: u64,
) -> (HashMap<Pair, usize>, usize) {
    let (pairs, accepted) = sample_pair_list(model, context, m, params, first_seed);
    (count(&pairs), accepted)
}

fn count(pairs: &[Pair]) -> HashMap<Pair, usize> {
    let mut counts = HashMap::new();
    for &p in pairs {
        *counts.entry(p).or_insert(0) += 1;
    }
    counts
}

/// [`sample_pairs`] before counting, in seed order.
fn sample_pair_list(
    model: &Transformer,
    context: &[u32],
    m: &Method,
    params: &SamplingParams,
    first_seed: u64,
) -> (Vec<Pair>, usize) {
    let mut pairs = Vec::new();
    let mut accepted = 0;
    for seed in first_seed..first_seed + RUNS {
        let p = GenerateParams {
            max_new_tokens: 3,
            sampling: SamplingParams { seed, ..*params },
            stop_tokens: vec![],
            max_block_rows: None,
        };
        let g = run(model, context, m, &p);
        assert_eq!(g.tokens.len(), 3);
        pairs.push((g.tokens[0], g.tokens[1]));
        if g.stats.model_calls < 2 {
            accepted += 1;
        }
    }
    (pairs, accepted)
}

fn first_tokens(counts: &HashMap<Pair, usize>) -> Vec<u32> {
    let mut v: Vec<u32> = counts.keys().map(|p| p.0).collect();
    v.sort();
    v.dedup();
    v
}

/// Chi-square goodness of fit of `counts` to the exact distribution under `params`: (statistic, df,
/// critical value at alpha = 1e-3).
fn fit(
    model: &Transformer,
    context: &[u32],
    counts: &HashMap<Pair, usize>,
    params: &SamplingParams,
) -> (f64, usize, f64) {
    let exact = exact_pairs(model, context, &first_tokens(counts), params);
    let (stat, df) = common::chi_square_gof(counts, &exact);
    assert!(df >= 1, "degenerate distribution: nothing to test");
    (stat, df, common::chi_square_critical_001(df))
}

/// Every method's (t1, t2) against the exact distribution, and against plain decoding with disjoint seeds
/// (method i uses seeds i * RUNS..(i + 1) * RUNS). Returns how many runs accepted t2 as a draft, per method.
fn every_method_keeps_the_distribution(params: SamplingParams) -> HashMap<MethodKind, usize> {
    let (_d, model, context) = model_and_context();
    let mut ar_counts = None;
    let mut accepted = HashMap::new();
    for (i, m) in methods().into_iter().enumerate() {
        let name = m.kind();
        let (counts, acc) = sample_pairs(&model, &context, &m, &params, i as u64 * RUNS);
        let (stat, df, crit) = fit(&model, &context, &counts, &params);
        eprintln!(
            "{name}: fit chi2 {stat:.1} (df {df}, critical {crit:.1}); \
             t2 accepted as a draft in {acc} of {RUNS} runs"
        );
        assert!(
            stat < crit,
            "{name} {params:?}: chi2 {stat:.1} >= {crit:.1} (df {df}) against the exact distribution"
        );
        match &ar_counts {
            None => ar_counts = Some(counts),
            Some(ar) => {
                let (stat, df) = common::chi_square(ar, &counts);
                assert!(df >= 1, "degenerate distribution: nothing to compare");
                let crit = common::chi_square_critical_001(df);
                eprintln!("{name} vs ar: homogeneity chi2 {stat:.1} (df {df}, critical {crit:.1})");
                assert!(
                    stat < crit,
                    "{name} {params:?}: chi2 {stat:.1} >= {crit:.1} (df {df}) against plain decoding"
                );
            }
        }
        accepted.insert(name, acc);
    }
    accepted
}

/// Each drafter must get drafts accepted at the verification step tested in `min` of the runs, or the
/// test would only see bonus tokens.
fn assert_drafts_accepted(accepted: &HashMap<MethodKind, usize>, min: usize) {
    for (name, &n) in accepted {
        if *name != MethodKind::Ar {
            assert!(
                n >= min,
                "{name}: t2 accepted as a draft in only {n} of {RUNS} runs"
            );
        }
    }
}

#[test]
fn every_method_samples_the_exact_distribution_at_temperature_0_7() {
    let acc = every_method_keeps_the_distribution(sampling(0.7, 1.0, 0));
    assert_drafts_accepted(&acc, 30);
}

#[test]
fn every_method_samples_the_exact_distribution_at_temperature_1_5() {
    let acc = every_method_keeps_the_distribution(sampling(1.5, 1.0, 0));
    assert_drafts_accepted(&acc, 10);
}

#[test]
fn every_method_samples_the_exact_distribution_with_top_p_0_9() {
    let acc = every_method_keeps_the_distribution(sampling(1.0, 0.9, 0));
    assert_drafts_accepted(&acc, 30);
}

#[test]
fn every_method_samples_the_exact_distribution_with_top_k_5() {
    let acc = every_method_keeps_the_distribution(sampling(1.0, 1.0, 5));
    assert_drafts_accepted(&acc, 30);
}

/// The statistics above can fail: samples drawn at temperature 0.7 are rejected as draws at temperature
/// 1.0 by the goodness-of-fit test, and as draws from the same distribution as samples at temperature 1.0
/// by the homogeneity test, with the same number of samples and the same alpha = 1e-3. Samples without
/// top-k are rejected as top-k 5 draws, and samples where every third t2 is replaced by the most likely
/// token (a verifier that favours drafts) are rejected too.
#[test]
fn the_tests_reject_a_wrong_distribution() {
    let (_d, model, context) = model_and_context();
    let esp = &methods()[1];
    let (cold, _) = sample_pairs(&model, &context, esp, &sampling(0.7, 1.0, 0), 0);
    let (hot, _) = sample_pairs(&model, &context, esp, &sampling(1.0, 1.0, 0), RUNS);

    let (stat, df, crit) = fit(&model, &context, &cold, &sampling(0.7, 1.0, 0));
    assert!(
        stat < crit,
        "the right temperature is rejected: chi2 {stat:.1} >= {crit:.1} (df {df})"
    );
    let (stat, df, crit) = fit(&model, &context, &cold, &sampling(1.0, 1.0, 0));
    eprintln!("T 0.7 samples against T 1.0: chi2 {stat:.1} (df {df}, critical {crit:.1})");
    assert!(
        stat > crit,
        "a wrong temperature passes: chi2 {stat:.1} < {crit:.1} (df {df})"
    );

    let (stat, df) = common::chi_square(&cold, &hot);
    let crit = common::chi_square_critical_001(df);
    eprintln!("T 0.7 against T 1.0 samples: homogeneity chi2 {stat:.1} (df {df}, critical {crit:.1})");
    assert!(
        stat > crit,
        "different temperatures look alike: chi2 {stat:.1} < {crit:.1} (df {df})"
    );

    let (stat, df, crit) = fit(&model, &context, &hot, &sampling(1.0, 1.0, 5));
    eprintln!("samples without top-k against top-k 5: chi2 {stat:.1} (df {df}, critical {crit:.1})");
    assert!(
        stat > crit,
        "top-k 5 passes without top-k: chi2 {stat:.1} < {crit:.1} (df {df})"
    );

    // A verifier that favours drafts: every third t2 replaced by the most likely token after t1 (what the
    // drafters propose first).
    let params = sampling(1.5, 1.0, 0);
    let (mut pairs, _) = sample_pair_list(&model, &context, esp, &params, 0);
    let firsts: Vec<u32> = pairs.iter().map(|p| p.0).collect();
    let (_, after) = logits_after(&model, &context, &firsts);
    for p in pairs.iter_mut().step_by(3) {
        p.1 = probespec::decode::sampling::argmax(&after[&p.0]);
    }
    let (stat, df, crit) = fit(&model, &context, &count(&pairs), &params);
    eprintln!("a third of t2 greedy, at T 1.5: chi2 {stat:.1} (df {df}, critical {crit:.1})");
    assert!(
        stat > crit,
        "a draft-favouring verifier passes: chi2 {stat:.1} < {crit:.1} (df {df})"
    );
}
