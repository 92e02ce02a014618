//! Every speculative method, in every configuration, must be token-identical to plain decoding of the same
//! binary (same tokens, same finish reason), also at the edges: one-token prompts, prompts that run into
//! the context window mid-draft, stop tokens and length limits inside an accepted path, and sampling with
//! the same seed. Tiny random LLaMA and Qwen 3 checkpoints, many prompts. (That sampling keeps the model's
//! distribution is tests/sampling.rs; drafter-specific behaviour is tests/drafters.rs.)

mod common;

use common::decoding::{
    all_configs, assert_acceptance_exercised, check_all, esp, esp_configs, greedy, hybrid, lookahead,
    one_token_prompts, peer_configs, pld, prompts, run,
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
            esp(10, 1, EspTree::Dynamic),
            esp(30, 2, EspTree::Static(None)),
            hybrid(30, 1),
            pld(3, 10),
        ];
        check_all(&q, &prompts(6, 1..40, 15), &configs, &greedy(40, vec![]));
    }
}
