//! `probespec cost`: the forward cost curve, the number that decides whether speculation pays.
//!
//! A decoding step is one forward pass over a block of R rows after C cached tokens, plus the logits of
//! a row; speculation with a block of R rows pays when its acceptance beats cost(R)/cost(1). This
//! times exactly that step for a checkpoint (`--model`) or for random weights of a published shape
//! (`--shape llama3-8b`: the cost depends on shapes, not values), on any device and dtype, and prints
//! the median of `--repeats` runs per point and the ratio to one row.
//!
//! `--sequences` makes each row a sequence of its own, after its own cache: what decoding that many
//! sequences in one forward pass costs, against one.
//!
//! `--save` times the curve `--bc auto` prices blocks with (its own grid) and writes it to the cost cache,
//! replacing what was there.

use crate::decode::cost_curve::{median, time_grid, CostCurve};
use crate::model::synthetic::{random_model, shape_config};
use crate::model::Transformer;
use crate::session::{ModelOptions, Session};
use anyhow::{bail, Result};
use std::path::PathBuf;
use std::time::Instant;

/// What `probespec cost` measures.
#[derive(Debug, Clone)]
pub struct CostOptions {
    pub model: ModelOptions,
    /// Random weights of a published shape (llama3-8b, qwen3-8b, smollm2-135m) instead of a checkpoint.
    pub shape: Option<String>,
    /// Block sizes (rows per forward pass).
    pub rows: Vec<usize>,
    /// Each row its own sequence after its own cache: the cost of decoding that many sequences together.
    pub sequences: bool,
    /// Cached tokens before the block.
    pub cache: Vec<usize>,
    /// Timed runs per point (the median is reported).
    pub repeats: usize,
    /// One JSON object instead of the table.
    pub json: bool,
    /// Time `--bc auto`'s curve and save it in the cost cache.
    pub save: bool,
    /// Also draw the curve (cost / cost of one row) as an SVG chart in this file.
    pub svg: Option<PathBuf>,
    /// llama-bench's JSON output (`-o json -p 1,... -n 0 -d C`) on the same model, drawn beside it.
    pub peer: Option<PathBuf>,
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
    if a.save {
        return save(a);
    }
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
    // A peer file that cannot be read fails before the timing, not after it.
    let peer = a
        .peer
        .as_deref()
        .map(super::cost_chart::peer_curves)
        .transpose()?;
    let points = cost_curve(&model, &a.cache, &a.rows, a.repeats, a.sequences)?;
    if let Some(svg) = &a.svg {
        let mut curves =
            super::cost_chart::curves_of(points.iter().map(|p| (p.cache, p.rows, p.ratio)), "probespec");
        curves.extend(peer.into_iter().flatten());
        // A model file is named by its file name, not its whole path.
        let short = std::path::Path::new(&name)
            .file_name()
            .map_or(name.clone(), |f| f.to_string_lossy().into_owned());
        let title = format!("{short}: a block's cost over one row's");
        let chart = super::cost_chart::render_svg(&title, &curves)?;
        super::write_atomic(svg, chart.as_bytes())?;
    }
    let device = format!("{:?}", model.device.location());
    let dtype = model.dtype.as_str();
    // A block's cost depends on the threads that share it.
    let threads = crate::facts::threads();
    let mut text = String::new();
    if a.json {
        let v = serde_json::json!({ "model": name, "device": device, "dtype": dtype, "threads": threads,
                                    "repeats": a.repeats, "sequences": a.sequences, "points": points });
        text.push_str(&format!("{v}\n"));
    } else {
        let each = if a.sequences {
            ", each row a sequence of its own"
        } else {
            ""
        };
        text.push_str(&format!(
            "{name} on {device}, {dtype}, {threads} threads, median of {} runs{each}\n",
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

/// `probespec cost --save`: measures the model's `--bc auto` curve and writes it to the cost cache.
fn save(a: &CostOptions) -> Result<()> {
    if a.shape.is_some() {
        bail!("--save keeps the curve of a model file: it cannot be used with --shape");
    }
    let s = Session::load(&a.model)?;
    let t = Instant::now();
    let (curve, samples) = CostCurve::measure(&s.model)?;
    let secs = t.elapsed().as_secs_f64();
    s.cost_store.save(&curve, Some(&samples))?;
    let mut text = String::new();
    if a.json {
        let v = serde_json::json!({ "model": s.description, "path": s.cost_store.path,
                                    "seconds": secs, "curve": curve });
        text.push_str(&format!("{v}\n"));
    } else {
        text.push_str(&format!(
            "{}: --bc auto's cost curve timed in {secs:.1} s, saved to {}\n",
            s.description,
            s.cost_store.path.display()
        ));
        text.push_str(&format!(
            "{:>7} {:>5} {:>11} {:>12}\n",
            "cache", "rows", "ms", "cost/cost(1)"
        ));
        for (c, line) in curve.contexts.iter().zip(&curve.seconds) {
            for (r, t) in curve.rows.iter().zip(line) {
                text.push_str(&format!(
                    "{c:>7} {r:>5} {:>11.3} {:>12.2}\n",
                    t * 1e3,
                    t / line[0]
                ));
            }
        }
    }
    super::write_stdout(&text)
}

/// Times a decoding step of each block size after each cache size (rows interleaved within a repeat,
/// so that drifts of the machine spread over all sizes); with `sequences`, each row a sequence of its
/// own.
pub fn cost_curve(
    model: &Transformer,
    caches: &[usize],
    rows: &[usize],
    repeats: usize,
    sequences: bool,
) -> Result<Vec<CostPoint>> {
    let samples = time_grid(model, caches, rows, repeats, sequences)?;
    let mut points = Vec::new();
    for (&ctx, mut times) in caches.iter().zip(samples) {
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
