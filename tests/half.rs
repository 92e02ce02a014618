//! Half precision (f16, bf16): safetensors folders and GGUF files load and run in both dtypes; with the
//! row-invariant products (`Ops::Exact`, the CPU's default in f16 / bf16) a row's logits are the same bits
//! alone and inside blocks and every method is token-identical to plain decoding of the same dtype; with
//! candle's ops as a GPU device runs them (`Ops::Candle`) the products round by block size, and how often
//! that changes a method's answer is measured and printed (the README's limits quote it).

mod common;

use candle_core::DType;
use common::decoding::{
    assert_acceptance_exercised, check_all, esp, esp_auto, greedy, hybrid, hybrid_auto, logits_in_blocks,
    lookahead, lookahead_auto, pld, pld_auto, prompts, run, same_bits,
};
use common::{TinyArch, TinySpec};
use probespec::decode::method::{EspTree, Method};
use probespec::model::load::{Activations, ModelSource};
use probespec::model::{Ops, Transformer};

const HALF: [DType; 2] = [DType::BF16, DType::F16];

/// One configuration of every method and of `--bc auto`.
fn configs() -> Vec<Method> {
    vec![
        esp(30, 1, EspTree::Dynamic),
        esp(60, 2, EspTree::Static(None)),
        esp_auto(1),
        pld(3, 10),
        pld_auto(3),
        lookahead(7, 5, 7),
        lookahead_auto(5, 7),
        hybrid(30, 1),
        hybrid_auto(1),
    ]
}

/// The setting whose divergence the README quotes: every method at block complexity 10, 24 tokens.
fn bc10_methods() -> Vec<Method> {
    vec![
        esp(10, 1, EspTree::Dynamic),
        pld(3, 10),
        hybrid(10, 1),
        lookahead(4, 3, 2),
    ]
}

fn prompt37() -> Vec<u32> {
    (0..37).map(|i| (i * 53 + 11) % 250 + 4).collect()
}

/// The largest difference between two logit vectors, relative to the largest |logit| of `reference`.
fn relative_error(got: &[f32], reference: &[f32]) -> f32 {
    let scale = reference.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let err = got
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    err / scale
}

/// A row's logits in half precision are the same bits alone and in blocks of 2..37 rows, close to the f32
/// model's (the same weights rounded, within the dtype's precision) but not equal to them (the half
/// precision path really rounds).
fn assert_row_invariant_and_close(m: &Transformer, f32_logits: &[f32], what: &str) {
    assert_eq!(m.ops(), Ops::Exact, "{what}: the CPU default in half precision");
    let alone = logits_in_blocks(m, &prompt37(), &[1]);
    for blocks in [vec![37], vec![2], vec![3, 5], vec![16]] {
        let got = logits_in_blocks(m, &prompt37(), &blocks);
        assert!(
            same_bits(&got, &alone),
            "{what}: blocks {blocks:?} change the logits"
        );
    }
    let err = relative_error(&alone, f32_logits);
    assert!(
        !same_bits(&alone, f32_logits),
        "{what}: no rounding to half precision"
    );
    assert!(
        err < 0.1,
        "{what}: logits differ from f32 by {err} of the largest"
    );
}

#[test]
fn safetensors_in_half_precision_are_row_invariant_and_every_method_is_lossless() {
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let (_d, f) = common::load_tiny(&spec);
        let f32_logits = logits_in_blocks(&f, &prompt37(), &[37]);
        for dtype in HALF {
            let what = format!("{:?} {dtype:?}", spec.arch);
            let (_d, m) = common::load_tiny_as(&spec, dtype);
            assert_eq!(m.dtype, dtype);
            assert_row_invariant_and_close(&m, &f32_logits, &what);
            let seed = if spec.arch == TinyArch::Llama { 21 } else { 22 };
            let pooled = check_all(&m, &prompts(9, 1..48, seed), &configs(), &greedy(48, vec![]));
            eprintln!("{what}: lossless");
            assert_acceptance_exercised(&pooled);
        }
    }
}

/// GGUF files in half precision: f32 tensors (dense, rounded to the dtype), and llama.cpp's block formats
/// with 8-bit and with f32 activations (the quantised products read f32 from the dtype's values).
#[test]
fn gguf_in_half_precision_is_row_invariant_and_every_method_is_lossless() {
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let dir = common::tempdir();
        let (fp, qp) = (dir.path().join("f32.gguf"), dir.path().join("q.gguf"));
        spec.write_gguf(&fp);
        spec.write_gguf_as(&qp, common::mixed_block_format);
        let (fp, qp) = (ModelSource::Gguf(fp), ModelSource::Gguf(qp));
        for (source, activations, name) in [
            (&fp, Activations::Q8, "f32 tensors"),
            (&qp, Activations::Q8, "block formats, q8 activations"),
            (&qp, Activations::F32, "block formats, f32 activations"),
        ] {
            let f = common::load_as(source, DType::F32, activations);
            let f32_logits = logits_in_blocks(&f, &prompt37(), &[37]);
            for dtype in HALF {
                let what = format!("{:?} GGUF {name} {dtype:?}", spec.arch);
                let m = common::load_as(source, dtype, activations);
                assert_row_invariant_and_close(&m, &f32_logits, &what);
                check_all(&m, &prompts(4, 1..40, 23), &configs()[..4], &greedy(24, vec![]));
            }
        }
    }
}

/// The lossless prompts of the README's measurement, under candle's ops (how a GPU computes today) and
/// under the row-invariant products, in every half dtype on [`common::test_device`] (where the
/// row-invariant products are not available, only candle's ops). Asserted: the row-invariant products
/// give every method plain decoding's tokens, candle's ops give plain decoding the requested length;
/// measured and printed (lines starting DIVERGENCE, which scripts/gpu-check.sh collects): how many runs of
/// each method candle's ops leave token-identical, and whether a causal block's logits are the bits of
/// its rows alone.
#[test]
fn candle_ops_in_half_precision_divergence_measured() {
    let device = common::test_device();
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        for dtype in HALF {
            let what = format!("{:?} {dtype:?} on {device:?}", spec.arch);
            let (_d, m) = common::load_tiny_as(&spec, dtype);
            let m = m.with_ops(Ops::Candle).unwrap();
            let alone = logits_in_blocks(&m, &prompt37(), &[1]);
            let block = logits_in_blocks(&m, &prompt37(), &[37]);
            let invariant = same_bits(&alone, &block);
            let ps = prompts(4, 1..48, 21);
            let params = greedy(24, vec![]);
            let (mut same, mut runs) = (0, 0);
            let mut per_method = Vec::new();
            for method in bc10_methods() {
                let mut s = 0;
                for p in &ps {
                    let want = run(&m, p, &Method::Ar, &params);
                    assert_eq!(want.tokens.len(), 24, "{what}: plain decoding");
                    s += usize::from(run(&m, p, &method, &params).tokens == want.tokens);
                    runs += 1;
                }
                same += s;
                per_method.push(format!("{} {s}/{}", method.kind(), ps.len()));
            }
            eprintln!(
                "DIVERGENCE {what}, candle ops: {same} of {runs} runs token-identical to plain decoding ({}); \
                 a 37-row causal block's logits {} its rows' alone",
                per_method.join(", "),
                if invariant { "are the bits of" } else { "differ from" }
            );
            if Ops::Exact.check(&device, dtype).is_ok() {
                let (_d, m) = common::load_tiny_as(&spec, dtype);
                let m = m.with_ops(Ops::Exact).unwrap();
                check_all(&m, &ps, &bc10_methods(), &params);
                eprintln!("DIVERGENCE {what}, row-invariant products: {runs} of {runs} runs token-identical");
            }
        }
    }
}

/// The real SmolLM2 (Q4_1 GGUF, 8-bit activations) in bf16 and f16: every method at block complexity 10
/// token-identical to plain decoding of that dtype on two chat prompts.
#[test]
fn smollm2_gguf_in_half_precision_every_method_is_lossless() {
    use probespec::session::{ModelOptions, Session};
    for dtype in HALF {
        let session = Session::load(&ModelOptions {
            model: Some(common::smollm2_path().display().to_string()),
            dtype: Some(dtype),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(session.model.ops(), Ops::Exact);
        let ps: Vec<Vec<u32>> = [
            "Name the planets of the solar system.",
            "Repeat after me: a b c d e f g.",
        ]
        .iter()
        .map(|t| session.encode_prompt(t, None, true).unwrap())
        .collect();
        check_all(
            &session.model,
            &ps,
            &bc10_methods(),
            &greedy(16, session.stop_tokens()),
        );
    }
}

/// The binary with `--dtype bf16` / `f16` on a safetensors folder (a tiny LLaMA): one-shot answers for
/// every method (each the same tokens as plain decoding in that dtype), a conversation's turns, a bench
/// run with its lossless check, and `cost` of a named shape.
#[test]
fn the_binary_runs_half_precision_for_every_format_and_front_end() {
    use common::binary::probespec;
    let dir = common::tempdir();
    let hf = dir.path().join("tiny");
    TinySpec::llama().write_hf(&hf);
    {
        let (model, prompt) = (hf.to_str().unwrap(), "w5 w6 w7 w5 w6 w7 w5");
        for dtype in ["bf16", "f16"] {
            let answer = |method: &str| {
                let r = probespec(&[
                    "--model",
                    model,
                    "--dtype",
                    dtype,
                    "--method",
                    method,
                    "--bc",
                    "10",
                    "--max-new-tokens",
                    "16",
                    "--json",
                    prompt,
                ])
                .ok();
                let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
                v["token_ids"].clone()
            };
            let plain = answer("ar");
            assert!(
                !plain.as_array().unwrap().is_empty(),
                "{model} {dtype}: no tokens"
            );
            for method in ["esp", "pld", "lookahead", "hybrid"] {
                assert_eq!(answer(method), plain, "{model} {dtype} {method}");
            }
        }
    }
    // A conversation's turns (the terminal front end around them is tests/chat.rs's).
    let src = ModelSource::HfDir(hf.clone());
    let opts = probespec::model::load::LoadOptions {
        device: common::test_device(),
        dtype: DType::BF16,
        dequantize: false,
        activations: Default::default(),
    };
    let loaded = probespec::model::load::load_model(&src, &opts).unwrap();
    let mut chat =
        probespec::conversation::Conversation::new(&loaded.model, &loaded.tokenizer, None).unwrap();
    for user in ["w10 w11 w12", "w20 w21"] {
        let mut d = hybrid(10, 1).drafter(1).unwrap();
        let params = greedy(12, loaded.tokenizer.stop_tokens().to_vec());
        let turn = chat.turn(user, d.as_mut(), &params, &mut |_| Ok(())).unwrap();
        assert!(!turn.generation.tokens.is_empty());
    }
    let questions = dir.path().join("q.jsonl");
    std::fs::write(
        &questions,
        "{\"question_id\": 1, \"category\": \"qa\", \"turns\": [\"w7 w8 w9 w7 w8 w9\"]}\n",
    )
    .unwrap();
    let out = dir.path().join("bench");
    let r = probespec(&[
        "bench",
        "--questions",
        questions.to_str().unwrap(),
        "--model",
        hf.to_str().unwrap(),
        "--dtype",
        "bf16",
        "--methods",
        "ar,esp,pld,hybrid",
        "--bc",
        "10",
        "--max-new-tokens",
        "16",
        "--warmup",
        "0",
        "--out",
        out.to_str().unwrap(),
    ])
    .ok();
    let summary = std::fs::read_to_string(out.join("summary.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&summary).unwrap();
    assert_eq!(v["mismatch_count"], 0, "bench in bf16: {summary}\n{}", r.stderr);
    let r = probespec(&[
        "cost",
        "--shape",
        "smollm2-135m",
        "--dtype",
        "bf16",
        "--rows",
        "1,4",
        "--cache",
        "16",
        "--repeats",
        "1",
    ])
    .ok();
    assert!(r.stdout.contains("bf16"), "cost in bf16:\n{}", r.stdout);
}

/// `PROBESPEC_OPS` is checked: an unknown name, or ops that cannot run in the dtype asked for, end in a
/// one-line error, never a panic.
#[test]
fn bad_ops_switch_is_a_clear_error() {
    let dir = common::tempdir();
    TinySpec::llama().write_hf(dir.path());
    let model = dir.path().to_str().unwrap();
    for (ops, dtype, needle) in [
        (
            "gpu",
            "f32",
            "PROBESPEC_OPS=gpu: expected kernels, candle or exact",
        ),
        (
            "kernels",
            "bf16",
            "PROBESPEC_OPS=kernels: probespec's kernels run on the CPU in f32 only",
        ),
    ] {
        let mut cmd = common::binary::command(&["--model", model, "--dtype", dtype, "w5 w6"]);
        common::binary::run(cmd.env("PROBESPEC_OPS", ops), None).errors_with(needle);
    }
}
