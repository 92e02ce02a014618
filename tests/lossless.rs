//! Every speculative method, in every configuration, must be token-identical to plain decoding of the same
//! binary (same tokens, same finish reason), also at the edges: one-token prompts, prompts that run into
//! the context window mid-draft, stop tokens and length limits inside an accepted path, and sampling with
//! the same seed. Tiny random LLaMA and Qwen 3 checkpoints, many prompts. (That sampling keeps the model's
//! distribution is tests/sampling.rs; drafter-specific behaviour is tests/drafters.rs.)

mod common;

use common::decoding::{
    all_configs, assert_acceptance_exercised, check_all, esp, esp_auto, esp_configs, greedy, hybrid,
    logits_in_blocks, lookahead, one_token_prompts, peer_configs, pld, prompts, run, same_bits,
};
use common::TinySpec;
use probespec::decode::generate::{FinishReason, GenerateParams};
use probespec::decode::method::{EspTree, Method, MethodKind};
use probespec::decode::sampling::SamplingParams;
use probespec::model::Transformer;
use std::collections::HashMap;

/// Every configuration of every method against plain decoding on 9 random prompts of a tiny model.
fn every_method_lossless_on(spec: TinySpec, seed: u64) {
    let (_d, model) = common::load_tiny(&spec);
    let pooled = check_all(
        &model,
        &prompts(9, 1..48, seed),
        &all_configs(),
        &greedy(48, vec![]),
    );
    assert_acceptance_exercised(&pooled);
}

#[test]
fn every_method_is_lossless_on_tiny_llama_every_configuration() {
    every_method_lossless_on(TinySpec::llama(), 21);
}

#[test]
fn every_method_is_lossless_on_tiny_qwen3_every_configuration() {
    every_method_lossless_on(TinySpec::qwen3(), 22);
}

#[test]
fn one_token_prompts_every_method() {
    // ESP at k = 1 (BC 10/30/60, both trees) and every configuration of the other drafters.
    let mut configs = esp_configs()[..6].to_vec();
    configs.extend(peer_configs());
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let (_d, model) = common::load_tiny(&spec);
        check_all(&model, &one_token_prompts(4..12), &configs, &greedy(32, vec![]));
    }
}

#[test]
fn prompts_near_the_context_limit_every_method() {
    // max_position_embeddings is 512: prompts of 480..510 tokens run into the window mid-draft (trees,
    // chains, lookahead windows and mask probes cut short or dropped).
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let ps = prompts(6, 480..511, 13);
    check_all(&model, &ps, &all_configs(), &greedy(64, vec![]));
    let g = run(&model, &ps[0], &Method::Ar, &greedy(64, vec![]));
    assert_eq!(g.finish_reason, FinishReason::ContextWindow);
}

#[test]
fn stop_token_and_length_limit_inside_an_accepted_path_every_method() {
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let ps = prompts(9, 2..30, 14);
    let configs = [
        esp(30, 1, EspTree::Dynamic),
        esp(60, 2, EspTree::Dynamic),
        pld(3, 10),
        lookahead(7, 5, 7),
        hybrid(30, 1),
    ];
    // Per method: runs that ended on the stop token and accepted more than one token in some step.
    let mut stop_inside: HashMap<MethodKind, usize> = HashMap::new();
    for p in &ps {
        let free = run(&model, p, &Method::Ar, &greedy(40, vec![]));
        // Stop at a token plain decoding emits at step 5..: whether a drafter reaches it inside a path or
        // not, it must end exactly there.
        for &stop in free.tokens[5..].iter().take(4) {
            let params = greedy(40, vec![stop]);
            check_all(&model, std::slice::from_ref(p), &configs, &params);
            for m in &configs {
                let g = run(&model, p, m, &params);
                assert_eq!(g.finish_reason, FinishReason::StopToken, "{m:?}");
                if g.stats.committed_histogram.len() > 2 {
                    *stop_inside.entry(m.kind()).or_default() += 1;
                }
            }
        }
        for max_new in [1, 2, 3, 5, 8, 13, 21] {
            check_all(
                &model,
                std::slice::from_ref(p),
                &configs,
                &greedy(max_new, vec![]),
            );
        }
    }
    eprintln!("stop-token runs with a multi-token step: {stop_inside:?}");
    for m in &configs {
        assert!(
            stop_inside.get(&m.kind()).copied().unwrap_or(0) > 0,
            "{}: no run accepted more than one token: the stop case was not exercised",
            m.kind()
        );
    }
}

/// Determinism, not a distribution test (tests/sampling.rs tests the distribution): the verifier draws
/// one random number per committed token, as plain decoding does, so under sampling every drafter gives
/// exactly plain sampling's tokens for the same seed, with drafts accepted along the way. Two settings, every
/// method in both: a model of scale 0.3 on one repeating prompt, where the mask drafters (ESP, hybrid) must
/// get at least 10 drafts accepted (prompt lookup and lookahead find too little there), and a model sharp
/// enough to loop (scale 0.5) on random prompts, where every method must.
#[test]
fn same_seed_gives_identical_output_under_sampling_every_method() {
    let methods = [
        esp(30, 1, EspTree::Dynamic),
        esp(60, 2, EspTree::Static(None)),
        pld(3, 10),
        lookahead(7, 5, 7),
        hybrid(30, 1),
    ];
    // (weight scale, prompts, seeds per prompt, tokens, (temperature, top-p, top-k) settings, the methods
    // that must get drafts accepted)
    let settings = [
        (
            0.3,
            vec![vec![10, 20, 30, 10, 20, 30, 10, 20]],
            30,
            16,
            [(0.8, 1.0, 0), (1.3, 0.9, 0), (1.0, 1.0, 5)],
            vec![MethodKind::Esp, MethodKind::Hybrid],
        ),
        (
            0.5,
            prompts(6, 8..24, 26),
            10,
            24,
            [(0.7, 1.0, 0), (1.3, 0.9, 0), (1.0, 1.0, 5)],
            methods.iter().map(Method::kind).collect(),
        ),
    ];
    for (scale, ps, seeds, max_new, samplings, must_accept) in settings {
        let mut spec = TinySpec::llama();
        spec.scale = scale;
        let (_d, model) = common::load_tiny(&spec);
        let mut accepted: HashMap<MethodKind, usize> = HashMap::new();
        for (i, prompt) in ps.iter().enumerate() {
            for seed in 0..seeds {
                for (temperature, top_p, top_k) in samplings {
                    let params = GenerateParams {
                        max_new_tokens: max_new,
                        sampling: SamplingParams {
                            temperature,
                            top_p,
                            top_k,
                            seed: seed + 100 * i as u64,
                        },
                        stop_tokens: vec![],
                        max_block_rows: None,
                    };
                    let a = run(&model, prompt, &Method::Ar, &params);
                    for m in &methods {
                        let e = run(&model, prompt, m, &params);
                        assert_eq!(
                            e.tokens, a.tokens,
                            "scale {scale}, seed {}, {m:?}",
                            params.sampling.seed
                        );
                        *accepted.entry(m.kind()).or_default() +=
                            e.stats.committed_by_calls() - e.stats.model_calls;
                    }
                }
            }
        }
        eprintln!("scale {scale}: drafts accepted: {accepted:?}");
        for m in must_accept {
            let n = accepted[&m];
            assert!(
                n >= 10,
                "scale {scale}, {m}: only {n} drafts accepted: too few to exercise acceptance"
            );
        }
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

/// A GGUF in llama.cpp's block formats loaded with f32 activations runs through the f32 block kernel:
/// its logits are bit-identical to those of the same weights dequantised and stored as f32 and to those
/// of the file loaded with `dequantize` (both run by the dense kernel), and ESP on it is lossless.
#[test]
fn block_quantized_gguf_with_f32_activations_equals_its_dequantized_weights_and_is_lossless() {
    use probespec::model::load::Activations;
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let dir = common::tempdir();
        let (qp, fp) = (dir.path().join("q.gguf"), dir.path().join("f32.gguf"));
        spec.write_gguf_as(&qp, common::mixed_block_format);
        spec.write_gguf_dequantized(&fp, common::mixed_block_format);
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
            esp(10, 1, EspTree::Dynamic),
            esp(30, 2, EspTree::Static(None)),
            hybrid(30, 1),
            pld(3, 10),
        ];
        check_all(&q, &prompts(6, 1..40, 15), &configs, &greedy(40, vec![]));
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
    // The closeness to the dequantised model is the 8-bit activations' alone: both with an f32 KV cache.
    let f32_kv = |m: Transformer| m.with_kv_dtype(candle_core::DType::F32).unwrap();
    let q32 = f32_kv(load_gguf(&qp, false, Activations::Q8));
    let f = f32_kv(load_gguf(&qp, true, Activations::Q8));
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
    let alone32 = logits_in_blocks(&q32, &prompt, &[1]);
    assert!(
        !same_bits(&alone32, &lf),
        "the 8-bit path should round differently from f32"
    );
    let scale = lf.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let err = alone32
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
        esp(10, 1, EspTree::Dynamic),
        esp(30, 2, EspTree::Static(None)),
        esp_auto(1),
        hybrid(30, 1),
        pld(3, 10),
    ];
    check_all(&q, &prompts(6, 1..40, seed), &configs, &greedy(40, vec![]));
}

/// The block-format GGUF with the default 8-bit activations.
#[test]
fn block_quantized_gguf_with_q8_activations_is_row_invariant_and_lossless() {
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        q8_activations_are_row_invariant_and_lossless(spec, common::mixed_block_format, 16);
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
