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

/// Every ESP configuration: k = 1..=3 at BC 10/30/60, dynamic and static trees, --bc auto, explicit branches
/// (the paper's among them, docs/ESP.md).
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

/// Determinism, not a distribution test (tests/sampling.rs tests the distribution): the verifier draws
/// one random number per committed token, as plain decoding does, so under sampling ESP gives exactly plain
/// sampling's tokens for the same seed, with drafts accepted along the way.
#[test]
fn same_seed_gives_identical_output_under_sampling() {
    let mut spec = TinySpec::llama();
    spec.scale = 0.3; // sharper distributions: drafts get accepted under sampling too
    let (_d, model) = common::load_tiny(&spec);
    let prompt: Vec<u32> = vec![10, 20, 30, 10, 20, 30, 10, 20];
    let configs = [
        method(MethodArg::Esp, 30, 1, TreeArg::Dynamic, None),
        method(MethodArg::Esp, 60, 2, TreeArg::Static, None),
    ];
    let mut accepted = 0;
    for seed in 0..30u64 {
        for (temperature, top_p, top_k) in [(0.8, 1.0, 0), (1.3, 0.9, 0), (1.0, 1.0, 5)] {
            let params = GenerateParams {
                max_new_tokens: 16,
                sampling: SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    seed,
                },
                stop_tokens: vec![],
            };
            let a = generate(&model, &prompt, &mut Autoregressive, &params, &mut |_| Ok(())).unwrap();
            for m in &configs {
                let e = common::run(&model, &prompt, m, &params);
                assert_eq!(e.tokens, a.tokens, "seed {seed}, {m:?}");
                accepted += e.stats.committed_by_calls() - e.stats.model_calls;
            }
        }
    }
    eprintln!("drafts accepted: {accepted}");
    assert!(
        accepted >= 10,
        "only {accepted} drafts accepted: too few to exercise acceptance"
    );
}

/// A GGUF in llama.cpp's block formats (Q8_0 embeddings, Q4_0 attention, Q4_1 MLP) runs through the CPU
/// block kernel. Its logits are bit-identical to those of the same weights dequantised and stored as
/// f32 and to those of the file loaded with `dequantize` (both run by the dense kernel), and ESP on it
/// is lossless.
#[test]
fn block_quantized_gguf_equals_its_dequantized_weights_and_is_lossless() {
    use candle_core::quantized::GgmlDType;
    use probespec::model::load::{load_model, LoadOptions, ModelSource};
    use probespec::model::BlockMask;
    let format = |name: &str| {
        if name.starts_with("token_embd") || name.starts_with("output.") {
            GgmlDType::Q8_0
        } else if name.contains("attn") {
            GgmlDType::Q4_0
        } else {
            GgmlDType::Q4_1
        }
    };
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let dir = common::tempdir();
        let (qp, fp) = (dir.path().join("q.gguf"), dir.path().join("f32.gguf"));
        spec.write_gguf_as(&qp, format);
        spec.write_gguf_dequantized(&fp, format);
        let load = |p: &std::path::Path, dequantize: bool| {
            let opts = LoadOptions {
                device: candle_core::Device::Cpu,
                dtype: candle_core::DType::F32,
                dequantize,
            };
            load_model(&ModelSource::Gguf(p.to_path_buf()), &opts)
                .unwrap()
                .model
        };
        let (q, f, qd) = (load(&qp, false), load(&fp, false), load(&qp, true));
        assert!(
            std::fs::metadata(&qp).unwrap().len() * 3 < std::fs::metadata(&fp).unwrap().len(),
            "the quantised file should be several times smaller"
        );
        let prompt: Vec<u32> = (0..37).map(|i| (i * 53 + 11) % 250 + 4).collect();
        let positions: Vec<u32> = (0..prompt.len() as u32).collect();
        let logits = |m: &Transformer| {
            let mut cache = m.new_cache(64).unwrap();
            let h = m
                .forward(
                    &m.embed(&prompt).unwrap(),
                    &positions,
                    &BlockMask::Causal,
                    &mut cache,
                )
                .unwrap();
            let rows: Vec<usize> = (0..prompt.len()).collect();
            m.logits(&h, &rows)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let (lq, lf, lqd) = (logits(&q), logits(&f), logits(&qd));
        for (other, what) in [(&lf, "the f32 copy's"), (&lqd, "--dequantize's")] {
            assert!(
                lq.iter().zip(other).all(|(a, b)| a.to_bits() == b.to_bits()),
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
