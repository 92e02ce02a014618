//! Every speculative configuration must be token-identical to plain greedy decoding of the same binary,
//! and sampling must keep the model's distribution. Tiny random LLaMA and Qwen 3 checkpoints, many prompts.

mod common;

use common::TinySpec;
use probespec::cli::{MaskInitArg, MethodArg, MethodArgs, TreeArg};
use probespec::decode::ar::Autoregressive;
use probespec::decode::generate::{generate, GenerateParams};
use probespec::decode::sampling::SamplingParams;
use probespec::model::Transformer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Random prompts; every third one repeats a short motif, which makes drafts easier to accept.
fn prompts(n: usize, len: std::ops::Range<usize>, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let l = rng.random_range(len.clone());
            if i % 3 == 2 {
                let motif: Vec<u32> = (0..4).map(|_| rng.random_range(4..256)).collect();
                (0..l).map(|j| motif[j % 4]).collect()
            } else {
                (0..l).map(|_| rng.random_range(4..256)).collect()
            }
        })
        .collect()
}

pub fn method(
    method: MethodArg,
    bc: usize,
    masks: usize,
    tree: TreeArg,
    branches: Option<Vec<usize>>,
) -> MethodArgs {
    MethodArgs {
        method,
        bc,
        masks,
        tree,
        branches,
        mask_init: MaskInitArg::Mean,
        mask_lambda: 0.1,
        ..MethodArgs::default()
    }
}

/// Every ESP configuration the issue names.
fn esp_configs() -> Vec<MethodArgs> {
    let mut v = Vec::new();
    for k in 1..=3 {
        for bc in [10, 30, 60] {
            if bc < 2 * (k + 1) {
                continue;
            }
            v.push(method(MethodArg::Esp, bc, k, TreeArg::Dynamic, None));
            v.push(method(MethodArg::Esp, bc, k, TreeArg::Static, None));
        }
    }
    // --bc auto: plain steps, probing steps and trees, as the measured cost curve and acceptance decide.
    v.push(method(
        MethodArg::Esp,
        probespec::cli::BC_AUTO,
        1,
        TreeArg::Dynamic,
        None,
    ));
    v.push(method(MethodArg::Esp, 60, 2, TreeArg::Static, Some(vec![15, 4])));
    v.push(method(
        MethodArg::Esp,
        60,
        3,
        TreeArg::Static,
        Some(vec![7, 5, 3]),
    ));
    v
}

/// Checks every configuration against AR on every prompt; returns (committed, calls) pooled over ESP runs.
fn check_all(
    model: &Transformer,
    prompts: &[Vec<u32>],
    configs: &[MethodArgs],
    params: &GenerateParams,
) -> (usize, usize) {
    let (mut committed, mut calls) = (0, 0);
    for p in prompts {
        let want = generate(model, p, &mut Autoregressive, params, &mut |_| Ok(())).unwrap();
        for m in configs {
            let got = common::run(model, p, m, params);
            assert_eq!(
                got.tokens,
                want.tokens,
                "mismatch: k={} bc={} tree={:?} branches={:?} prompt len {}",
                m.masks,
                m.bc,
                m.tree,
                m.branches,
                p.len()
            );
            assert_eq!(got.finish_reason, want.finish_reason);
            committed += got.stats.committed_by_calls();
            calls += got.stats.model_calls;
        }
    }
    (committed, calls)
}

/// Every ESP configuration against AR on 8 random prompts of a tiny model.
fn esp_lossless_on(spec: TinySpec, seed: u64) {
    let (_d, model) = common::load_tiny(&spec);
    let (c, n) = check_all(
        &model,
        &prompts(8, 1..40, seed),
        &esp_configs(),
        &common::greedy(48, vec![]),
    );
    // The speculative path must actually be exercised, or the test proves nothing.
    let tau = c as f64 / n as f64;
    eprintln!("pooled ESP tau {tau:.3}");
    assert!(tau > 1.05, "tau {tau} too low to exercise acceptance");
}

#[test]
fn esp_is_lossless_on_tiny_llama_every_configuration() {
    esp_lossless_on(TinySpec::llama(), 11);
}

#[test]
fn esp_is_lossless_on_tiny_qwen3_every_configuration() {
    esp_lossless_on(TinySpec::qwen3(), 12);
}

#[test]
fn one_token_prompts() {
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let (_d, model) = common::load_tiny(&spec);
        let ps: Vec<Vec<u32>> = (4..12).map(|t| vec![t * 17 % 252 + 4]).collect();
        check_all(&model, &ps, &esp_configs()[..6], &common::greedy(32, vec![]));
    }
}

#[test]
fn prompts_near_the_context_limit() {
    // max_position_embeddings is 512: prompts of 480..510 tokens run into the window mid-tree.
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let ps = prompts(6, 480..511, 13);
    check_all(&model, &ps, &esp_configs(), &common::greedy(64, vec![]));
    let g = generate(
        &model,
        &ps[0],
        &mut Autoregressive,
        &common::greedy(64, vec![]),
        &mut |_| Ok(()),
    )
    .unwrap();
    assert_eq!(g.finish_reason, "context_window");
}

#[test]
fn stop_token_and_length_limit_inside_an_accepted_path() {
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let ps = prompts(9, 2..30, 14);
    let configs = [
        method(MethodArg::Esp, 30, 1, TreeArg::Dynamic, None),
        method(MethodArg::Esp, 60, 2, TreeArg::Dynamic, None),
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
        // Stop at a token plain decoding emits at step 5..: whether ESP reaches it inside a path or not, it
        // must end exactly there.
        for &stop in free.tokens[5..].iter().take(4) {
            check_all(
                &model,
                std::slice::from_ref(p),
                &configs,
                &common::greedy(40, vec![stop]),
            );
            let esp = common::run(&model, p, &configs[0], &common::greedy(40, vec![stop]));
            if esp.stats.committed_histogram.len() > 2 {
                stop_inside += 1;
            }
        }
        for max_new in [1, 2, 3, 5, 8, 13, 21] {
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

#[test]
fn sampling_keeps_the_model_distribution() {
    // The 2nd and 3rd sampled tokens come from accepted drafts or bonus tokens under ESP; their distribution
    // must equal plain sampling. Each position is one chi-square test at a 0.1% false-alarm rate (so the two
    // together at about 0.2%), over 600 seeds per method.
    let mut spec = TinySpec::llama();
    spec.scale = 0.3; // sharper distributions: drafts get accepted under sampling too
    let (_d, model) = common::load_tiny(&spec);
    let prompt: Vec<u32> = vec![10, 20, 30, 10, 20, 30, 10, 20];
    let esp = method(MethodArg::Esp, 30, 1, TreeArg::Dynamic, None);
    let mut counts = vec![(std::collections::HashMap::new(), std::collections::HashMap::new()); 2];
    let mut esp_committed_multi = 0;
    for seed in 0..600u64 {
        let params = GenerateParams {
            max_new_tokens: 3,
            sampling: SamplingParams {
                temperature: 0.8,
                top_p: 1.0,
                top_k: 0,
                seed,
            },
            stop_tokens: vec![],
        };
        let a = generate(&model, &prompt, &mut Autoregressive, &params, &mut |_| Ok(())).unwrap();
        let e = common::run(&model, &prompt, &esp, &params);
        if e.stats.model_calls < 2 {
            esp_committed_multi += 1;
        }
        for (pos, (ca, ce)) in counts.iter_mut().enumerate() {
            *ca.entry(a.tokens[pos + 1]).or_insert(0usize) += 1;
            *ce.entry(e.tokens[pos + 1]).or_insert(0usize) += 1;
        }
    }
    assert!(
        esp_committed_multi > 30,
        "drafts were accepted in only {esp_committed_multi} of 600 runs"
    );
    for (pos, (a, e)) in counts.iter().enumerate() {
        let (stat, df) = common::chi_square(a, e);
        assert!(df >= 1, "degenerate distribution at position {pos}");
        let crit = common::chi_square_critical_001(df);
        assert!(
            stat < crit,
            "position {}: chi2 {stat:.1} >= {crit:.1} (df {df})",
            pos + 1
        );
    }
}

/// Block formats of the tiny GGUFs: Q8_0 embeddings (and so the tied vocabulary projection), Q4_0
/// attention, Q4_1 MLP, as in llama.cpp's mixed files.
fn block_format(name: &str) -> candle_core::quantized::GgmlDType {
    use candle_core::quantized::GgmlDType;
    if name.starts_with("token_embd") || name.starts_with("output.") {
        GgmlDType::Q8_0
    } else if name.contains("attn") {
        GgmlDType::Q4_0
    } else {
        GgmlDType::Q4_1
    }
}

fn load_gguf(
    p: &std::path::Path,
    dequantize: bool,
    activations: probespec::model::load::Activations,
) -> Transformer {
    use probespec::model::load::{load_model, LoadOptions, ModelSource};
    let opts = LoadOptions {
        device: candle_core::Device::Cpu,
        dtype: candle_core::DType::F32,
        dequantize,
        activations,
    };
    load_model(&ModelSource::Gguf(p.to_path_buf()), &opts)
        .unwrap()
        .model
}

/// Logits of every row of `ids`, fed to the model in consecutive blocks of the given sizes (each block
/// after the cache of the previous ones).
fn logits_in_blocks(m: &Transformer, ids: &[u32], blocks: &[usize]) -> Vec<f32> {
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

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// A GGUF in llama.cpp's block formats loaded with f32 activations runs through the f32 block kernel:
/// its logits are bit-identical to those of the same weights dequantised and stored as f32 and to those
/// of the file loaded with `dequantize` (both run by the dense kernel), and ESP on it is lossless.
#[test]
fn block_quantized_gguf_with_f32_activations_equals_its_dequantized_weights_and_is_lossless() {
    use probespec::model::load::Activations;
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let dir = common::tempdir();
        let (qp, fp) = (dir.path().join("q.gguf"), dir.path().join("f32.gguf"));
        spec.write_gguf_as(&qp, block_format);
        spec.write_gguf_dequantized(&fp, block_format);
        let q = load_gguf(&qp, false, Activations::F32);
        let f = load_gguf(&fp, false, Activations::F32);
        let qd = load_gguf(&qp, true, Activations::F32);
        assert!(
            std::fs::metadata(&qp).unwrap().len() * 3 < std::fs::metadata(&fp).unwrap().len(),
            "the quantised file should be several times smaller"
        );
        let prompt: Vec<u32> = (0..37).map(|i| (i * 53 + 11) % 250 + 4).collect();
        let all = [prompt.len()];
        let (lq, lf, lqd) = (
            logits_in_blocks(&q, &prompt, &all),
            logits_in_blocks(&f, &prompt, &all),
            logits_in_blocks(&qd, &prompt, &all),
        );
        for (other, what) in [(&lf, "the f32 copy's"), (&lqd, "--dequantize's")] {
            assert!(
                same_bits(&lq, other),
                "{:?}: block-kernel logits differ from {what}",
                spec.arch
            );
        }
        let configs = [
            method(MethodArg::Esp, 10, 1, TreeArg::Dynamic, None),
            method(MethodArg::Esp, 30, 2, TreeArg::Static, None),
            method(MethodArg::Hybrid, 30, 1, TreeArg::Dynamic, None),
            method(MethodArg::Pld, 30, 1, TreeArg::Dynamic, None),
        ];
        check_all(&q, &prompts(6, 1..40, 15), &configs, &common::greedy(40, vec![]));
    }
}

/// With the default 8-bit activations: every row's logits are bit-identical whether the prompt goes
/// through the whole model one token at a time or in blocks of 2..16 rows, they stay close to the
/// logits of the same file dequantised at load (the 8-bit path computes the same model), and ESP, PLD
/// and the hybrid are token-identical to plain decoding.
fn q8_activations_are_row_invariant_and_lossless(
    spec: TinySpec,
    format: impl Fn(&str) -> candle_core::quantized::GgmlDType,
    seed: u64,
) {
    use probespec::model::load::Activations;
    let dir = common::tempdir();
    let qp = dir.path().join("q.gguf");
    spec.write_gguf_as(&qp, format);
    let q = load_gguf(&qp, false, Activations::Q8);
    let f = load_gguf(&qp, true, Activations::Q8);
    let prompt: Vec<u32> = (0..37).map(|i| (i * 53 + 11) % 250 + 4).collect();
    let alone = logits_in_blocks(&q, &prompt, &[1]);
    for blocks in [vec![37], vec![2], vec![3, 5], vec![7], vec![16], vec![9, 16, 4]] {
        let got = logits_in_blocks(&q, &prompt, &blocks);
        assert!(
            same_bits(&got, &alone),
            "{:?}: blocks {blocks:?} change the 8-bit path's logits",
            spec.arch
        );
    }
    let lf = logits_in_blocks(&f, &prompt, &[37]);
    assert!(
        !same_bits(&alone, &lf),
        "the 8-bit path should round differently from f32"
    );
    let scale = lf.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let err = alone
        .iter()
        .zip(&lf)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        err < 0.05 * scale,
        "{:?}: 8-bit logits differ from f32 by {err} (max |logit| {scale})",
        spec.arch
    );
    let configs = [
        method(MethodArg::Esp, 10, 1, TreeArg::Dynamic, None),
        method(MethodArg::Esp, 30, 2, TreeArg::Static, None),
        method(MethodArg::Esp, probespec::cli::BC_AUTO, 1, TreeArg::Dynamic, None),
        method(MethodArg::Hybrid, 30, 1, TreeArg::Dynamic, None),
        method(MethodArg::Pld, 30, 1, TreeArg::Dynamic, None),
    ];
    check_all(
        &q,
        &prompts(6, 1..40, seed),
        &configs,
        &common::greedy(40, vec![]),
    );
}

/// The block-format GGUF with the default 8-bit activations.
#[test]
fn block_quantized_gguf_with_q8_activations_is_row_invariant_and_lossless() {
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        q8_activations_are_row_invariant_and_lossless(spec, block_format, 16);
    }
}

/// A GGUF in the K-quants (Q4_K attention, Q5_K / Q4_K / Q6_K MLP, Q6_K embeddings and vocabulary
/// projection; Q8_0 for the attention output, whose width is not a multiple of 256) with the default
/// 8-bit activations. Widened to 256 so that the K-quants' super-blocks fit.
#[test]
fn k_quant_gguf_with_q8_activations_is_row_invariant_and_lossless() {
    use candle_core::quantized::GgmlDType;
    let format = |name: &str| {
        if name.starts_with("token_embd") || name.starts_with("output.") || name.contains("ffn_down") {
            GgmlDType::Q6K
        } else if name.contains("attn_output") {
            GgmlDType::Q8_0
        } else if name.contains("ffn_gate") {
            GgmlDType::Q5K
        } else {
            GgmlDType::Q4K
        }
    };
    // LLaMA's head_dim is hidden / heads.
    let llama = TinySpec {
        head_dim: 64,
        ..TinySpec::llama()
    };
    for spec in [llama, TinySpec::qwen3()] {
        let spec = TinySpec {
            hidden: 256,
            intermediate: 512,
            ..spec
        };
        q8_activations_are_row_invariant_and_lossless(spec, format, 17);
    }
}
