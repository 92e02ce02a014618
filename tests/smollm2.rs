//! The real model: SmolLM2-135M-Instruct (the default GGUF). Coherent greedy output, and ESP token-identical
//! to plain decoding on Spec-Bench prompts. Fetch the model with `make model` first.

mod common;

use candle_core::{DType, Device};
use probespec::cli::{encode_prompt, make_drafter, MaskInitArg, MethodArg, MethodArgs, TreeArg};
use probespec::decode::ar::Autoregressive;
use probespec::decode::generate::{generate, GenerateParams};
use probespec::model::load::{load_model, Activations, LoadOptions, LoadedModel, ModelSource};

fn smollm2() -> LoadedModel {
    smollm2_with(Activations::default())
}

fn smollm2_with(activations: Activations) -> LoadedModel {
    let path = common::smollm2_path();
    load_model(
        &ModelSource::Gguf(path),
        &LoadOptions {
            device: Device::Cpu,
            dtype: DType::F32,
            dequantize: false,
            activations,
        },
    )
    .unwrap()
}

/// First turns of Spec-Bench, `per_group` from each of its six groups (mt_bench spread over its categories).
fn specbench_prompts(per_group: usize) -> Vec<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/specbench/question.jsonl");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let mut by_cat: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        by_cat
            .entry(v["category"].as_str().unwrap().to_string())
            .or_default()
            .push(v["turns"][0].as_str().unwrap().to_string());
    }
    let mut out = Vec::new();
    for group in ["translation", "summarization", "qa", "math_reasoning", "rag"] {
        out.extend(
            by_cat[group]
                .iter()
                .take(per_group)
                .map(|t| (group.to_string(), t.clone())),
        );
    }
    let mt = [
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
    ];
    for i in 0..per_group {
        let cat = mt[i % mt.len()];
        out.push((cat.to_string(), by_cat[cat][i / mt.len()].clone()));
    }
    out
}

/// Both activation paths answer a factual question. (The first answer token of "What is the capital of
/// France?" is a near tie: "The" leads "L" by 0.08 (25.33 vs 25.24) with f32 activations, and the 8-bit
/// rounding tips it the other way (24.67 vs 24.87), so that path is asked about Germany.)
#[test]
fn greedy_answer_is_deterministic_and_sensible() {
    for (activations, question, answer) in [
        (Activations::F32, "What is the capital of France?", "Paris"),
        (Activations::Q8, "What is the capital of Germany?", "Berlin"),
    ] {
        let m = smollm2_with(activations);
        let prompt = encode_prompt(&m.tokenizer, question, None, true).unwrap();
        let params = GenerateParams {
            max_new_tokens: 24,
            sampling: Default::default(),
            stop_tokens: m.tokenizer.stop_tokens().to_vec(),
        };
        let a = generate(&m.model, &prompt, &mut Autoregressive, &params, &mut |_| Ok(())).unwrap();
        let b = generate(&m.model, &prompt, &mut Autoregressive, &params, &mut |_| Ok(())).unwrap();
        assert_eq!(a.tokens, b.tokens);
        let text = m.tokenizer.decode(&a.tokens).unwrap();
        assert!(
            text.contains(answer),
            "{activations:?}: unexpected answer: {text}"
        );
        assert_eq!(
            a.finish_reason, "stop_token",
            "{activations:?}: the answer should end with the end-of-turn token: {text}"
        );
    }
}

fn esp(bc: usize, masks: usize, tree: TreeArg, branches: Option<Vec<usize>>) -> MethodArgs {
    MethodArgs {
        method: MethodArg::Esp,
        bc,
        masks,
        tree,
        branches,
        mask_init: MaskInitArg::Mean,
        mask_lambda: 0.1,
        ..MethodArgs::default()
    }
}

#[test]
fn esp_is_lossless_on_42_specbench_prompts() {
    let m = smollm2();
    let prompts = specbench_prompts(7);
    assert!(prompts.len() >= 40);
    let params = GenerateParams {
        max_new_tokens: 48,
        sampling: Default::default(),
        stop_tokens: m.tokenizer.stop_tokens().to_vec(),
    };
    let configs = [
        esp(30, 1, TreeArg::Dynamic, None),
        esp(10, 1, TreeArg::Static, None),
        esp(60, 2, TreeArg::Static, Some(vec![15, 4])),
    ];
    let (mut committed, mut calls) = (0usize, 0usize);
    for (i, (cat, text)) in prompts.iter().enumerate() {
        let ids = encode_prompt(&m.tokenizer, text, None, true).unwrap();
        let want = generate(&m.model, &ids, &mut Autoregressive, &params, &mut |_| Ok(())).unwrap();
        // Every prompt under the main configuration; the others on every third prompt to bound the run time.
        for cfg in if i % 3 == 0 { &configs[..] } else { &configs[..1] } {
            let mut d = make_drafter(cfg, 0).unwrap();
            let got = generate(&m.model, &ids, d.as_mut(), &params, &mut |_| Ok(())).unwrap();
            assert_eq!(
                got.tokens, want.tokens,
                "mismatch on prompt {i} ({cat}), bc {} k {}",
                cfg.bc, cfg.masks
            );
            if cfg.bc == 30 {
                committed += got.stats.committed_by_calls();
                calls += got.stats.model_calls;
            }
        }
    }
    let tau = committed as f64 / calls as f64;
    eprintln!("ESP bc 30 k 1 tau over {} prompts: {tau:.3}", prompts.len());
    // An exact implementation reaches about 1.2 on this model (PERFORMANCE.md); far lower means a bug in the
    // mask offsets, attention pattern or cache compaction.
    assert!(tau > 1.12, "tau {tau:.3} is too low for ESP on SmolLM2");
}
