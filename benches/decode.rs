//! Decoding speed on the default model (SmolLM2-135M-Instruct GGUF, Q4_1/Q8_0 blocks on the CPU):
//! - `plain_decode`: 32 greedy tokens, plain autoregressive decoding (tokens/s = 32 / time);
//! - `esp_decode`: the same prompt under ESP at BC 10 and with `--bc auto`;
//! - `forward_cost`: one forward pass of 1..64 rows after a KV cache of 256 and 1024 tokens, plus the
//!   logits of one row: cost(S) / cost(1) is the number that decides whether speculation pays; for the
//!   GGUF's blocks (`forward_cost`) and for the same weights dequantised to f32 (`forward_cost_f32_weights`).
//!
//! Run with `cargo bench --bench decode`; needs `make model`.

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use probespec::decode::generate::GenerateParams;
use probespec::decode::method::{Budget, EspSpec, Method};
use probespec::model::load::default_model_path;
use probespec::model::BlockMask;
use probespec::session::{DeviceKind, ModelOptions, Session};
use std::time::Duration;

fn model(dequantize: bool) -> Session {
    let p = default_model_path();
    assert!(
        p.is_file(),
        "SmolLM2 GGUF not found at {}: run `make model`",
        p.display()
    );
    Session::load(&ModelOptions {
        model: Some(p.to_str().unwrap().to_string()),
        device: DeviceKind::Cpu,
        dtype: Some(DType::F32),
        dequantize,
        activations: Default::default(),
        kv_dtype: None,
        ..ModelOptions::default()
    })
    .unwrap()
}

fn decoding(c: &mut Criterion) {
    let m = model(false);
    let prompt = m
        .encode_prompt("Write a short story about a lighthouse keeper.", None, true)
        .unwrap();
    // No stop tokens: every run decodes exactly 32 tokens.
    let params = GenerateParams {
        max_new_tokens: 32,
        sampling: Default::default(),
        stop_tokens: vec![],
        max_block_rows: None,
    };
    let mut g = c.benchmark_group("decode_32_tokens");
    g.sample_size(10).measurement_time(Duration::from_secs(20));
    g.bench_function("plain", |b| {
        b.iter(|| {
            m.generate(&prompt, &Method::Ar, &params, &mut |_| Ok(()))
                .unwrap()
        })
    });
    for (name, budget) in [("esp_bc10", Budget::Fixed(10)), ("esp_bc_auto", Budget::Auto)] {
        let esp = Method::Esp(EspSpec {
            budget,
            ..EspSpec::default()
        });
        g.bench_function(name, |b| {
            b.iter(|| m.generate(&prompt, &esp, &params, &mut |_| Ok(())).unwrap())
        });
    }
    g.finish();
}

fn forward_cost(c: &mut Criterion) {
    // The GGUF in its Q4_1/Q8_0 blocks (block kernel), and dequantised to f32 weights (dense kernel).
    for (group, dequantize) in [("forward_cost", false), ("forward_cost_f32_weights", true)] {
        forward_cost_of(c, group, &model(dequantize));
    }
}

fn forward_cost_of(c: &mut Criterion, group: &str, m: &Session) {
    let model = &m.model;
    let mut g = c.benchmark_group(group);
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    for cached in [256usize, 1024] {
        let mut cache = model.new_cache(cached + 64).unwrap();
        let ids: Vec<u32> = (0..cached as u32).map(|i| 100 + i % 1000).collect();
        let pos: Vec<u32> = (0..cached as u32).collect();
        model
            .forward(&model.embed(&ids).unwrap(), &pos, &BlockMask::Causal, &mut cache)
            .unwrap();
        for rows in [1usize, 2, 4, 8, 16, 32, 64] {
            let x = model.embed(&vec![42; rows]).unwrap();
            let positions: Vec<u32> = (cached as u32..(cached + rows) as u32).collect();
            let mask = if rows == 1 {
                BlockMask::Causal
            } else {
                BlockMask::Additive(Tensor::zeros((rows, cached + rows), DType::F32, &Device::Cpu).unwrap())
            };
            g.bench_with_input(BenchmarkId::new(format!("cache{cached}"), rows), &rows, |b, _| {
                b.iter(|| {
                    let h = model.forward(&x, &positions, &mask, &mut cache).unwrap();
                    model.logits(&h, &[0]).unwrap().to_vec2::<f32>().unwrap();
                    cache.truncate(cached);
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, decoding, forward_cost);
criterion_main!(benches);
