//! `probespec cost`: the forward cost curve, the number that decides whether speculation pays.
//!
//! A decoding step is one forward pass over a block of R rows after C cached tokens, plus the logits of
//! a row; speculation with a block of R rows pays when its acceptance beats cost(R)/cost(1). This
//! times exactly that step for a checkpoint (`--model`) or for random weights of a published shape
//! (`--shape llama3-8b`: the cost depends on shapes, not values), on any device and dtype, and prints
//! the median of `--repeats` runs per point and the ratio to one row.

use crate::decode::drafters::auto_bc::time_step;
use crate::model::synthetic::{random_model, shape_config};
use crate::model::{BlockMask, KvCache, Transformer};
use crate::session::{ModelOptions, Session};
use anyhow::{bail, Result};
use std::time::Instant;

/// What `probespec cost` measures.
#[derive(Debug, Clone)]
pub struct CostOptions {
    pub model: ModelOptions,
    /// Random weights of a published shape (llama3-8b, qwen3-8b, smollm2-135m) instead of a checkpoint.
    pub shape: Option<String>,
    /// Block sizes (rows per forward pass).
    pub rows: Vec<usize>,
    /// Cached tokens before the block.
    pub cache: Vec<usize>,
    /// Timed runs per point (the median is reported).
    pub repeats: usize,
    /// One JSON object instead of the table.
    pub json: bool,
}

/// One timed point of the curve.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CostPoint {
    pub cache: usize,
    pub rows: usize,
    pub median_ms: f64,
    pub min_ms: f64,
    /// median_ms / median_ms of one row at the same cache size.
    pub ratio: f64,
}

pub fn run(a: &CostOptions) -> Result<()> {
    if a.rows.is_empty() || a.rows.contains(&0) {
        bail!("--rows must list block sizes of at least 1");
    }
    if a.cache.is_empty() || a.cache.contains(&0) {
        bail!("--cache must list cache sizes of at least 1");
    }
    if a.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    let (model, name) = match &a.shape {
        Some(shape) => {
            let device = a.model.device.device()?;
            let dtype = a.model.dtype_on(&device);
            let t = Instant::now();
            let m = random_model(shape_config(shape)?, &device, dtype)?;
            eprintln!(
                "random {shape} weights created in {:.1} s",
                t.elapsed().as_secs_f64()
            );
            (m, format!("{shape} (random weights)"))
        }
        None => {
            let s = Session::load(&a.model)?;
            (s.model, s.description)
        }
    };
    let need = a.cache.iter().max().unwrap() + a.rows.iter().max().unwrap();
    if need > model.config.max_position_embeddings {
        bail!(
            "cache + rows = {need} positions exceed the model's context window of {}",
            model.config.max_position_embeddings
        );
    }
    let points = cost_curve(&model, &a.cache, &a.rows, a.repeats)?;
    let device = format!("{:?}", model.device.location());
    let dtype = format!("{:?}", model.dtype).to_lowercase();
    let mut text = String::new();
    if a.json {
        let v = serde_json::json!({ "model": name, "device": device, "dtype": dtype,
                                    "repeats": a.repeats, "points": points });
        text.push_str(&format!("{v}\n"));
    } else {
        text.push_str(&format!(
            "{name} on {device}, {dtype}, median of {} runs\n",
            a.repeats
        ));
        text.push_str(&format!(
            "{:>7} {:>5} {:>11} {:>9} {:>12}\n",
            "cache", "rows", "median ms", "min ms", "cost/cost(1)"
        ));
        for p in &points {
            text.push_str(&format!(
                "{:>7} {:>5} {:>11.3} {:>9.3} {:>12.2}\n",
                p.cache, p.rows, p.median_ms, p.min_ms, p.ratio
            ));
        }
    }
    super::write_stdout(&text)?;
    Ok(())
}

/// Times a decoding step of each block size after each cache size (rows interleaved within a repeat,
/// so that drifts of the machine spread over all sizes).
pub fn cost_curve(
    model: &Transformer,
    caches: &[usize],
    rows: &[usize],
    repeats: usize,
) -> Result<Vec<CostPoint>> {
    let vocab = model.config.vocab_size as u64;
    // Arbitrary valid token ids (a fixed linear congruential sequence).
    let ids: Vec<u32> = (0..caches.iter().max().unwrap() + rows.iter().max().unwrap())
        .map(|i| ((i as u64 * 2_654_435_761 + 12_345) % vocab) as u32)
        .collect();
    let mut points = Vec::new();
    for &ctx in caches {
        let mut cache = model.new_cache(ctx + rows.iter().max().unwrap())?;
        prefill(model, &ids[..ctx], &mut cache)?;
        // Warm-up: first touch of weights and buffers, kernel selection on GPUs.
        for &r in rows {
            time_step(model, &ids[ctx..ctx + r], &mut cache)?;
        }
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
        for _ in 0..repeats {
            for (i, &r) in rows.iter().enumerate() {
                times[i].push(time_step(model, &ids[ctx..ctx + r], &mut cache)?);
            }
        }
        let medians: Vec<f64> = times.iter_mut().map(|t| median(t)).collect();
        let one = rows
            .iter()
            .position(|&r| r == 1)
            .map(|i| medians[i])
            .unwrap_or(f64::NAN);
        for (i, &r) in rows.iter().enumerate() {
            points.push(CostPoint {
                cache: ctx,
                rows: r,
                median_ms: medians[i] * 1e3,
                min_ms: times[i].iter().copied().fold(f64::INFINITY, f64::min) * 1e3,
                ratio: medians[i] / one,
            });
        }
    }
    Ok(points)
}

fn prefill(model: &Transformer, ids: &[u32], cache: &mut KvCache) -> Result<()> {
    for (i, chunk) in ids.chunks(256).enumerate() {
        let pos: Vec<u32> = (0..chunk.len()).map(|j| (i * 256 + j) as u32).collect();
        model.forward(&model.embed(chunk)?, &pos, &BlockMask::Causal, cache)?;
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
