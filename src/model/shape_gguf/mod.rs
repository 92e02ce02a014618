//! `probespec shape-gguf`: a GGUF file of random weights in a published model shape, quantised in the
//! mix `llama-quantize` would use, with a real tokenizer, that probespec and llama.cpp both load.
//!
//! The speed of a forward pass depends on the shapes and types of the tensors, not on their values, so
//! such a file measures what a checkpoint of that shape would run at, on any machine, without
//! downloading gigabytes of weights. Its text is noise: every number measured with it must say the
//! weights are random.
//!
//! Weights are drawn from N(0, 0.02²), norms are 1; every chunk of rows has its own seed made from the
//! `--seed`, the tensor's name and the chunk's index, so a file is the same on every machine and thread
//! count. Tensors are generated, quantised and written one chunk at a time (see [`writer`]): an 8B model
//! needs a few hundred MB of memory.

mod mix;
mod vocab;
pub mod writer;

pub use mix::{QuantMix, Role};
pub use vocab::tokenizer_metadata;

use super::config::{Arch, ModelConfig};
use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Instant;
use writer::{GgufStream, TensorDecl};

/// What `probespec shape-gguf` was asked for.
#[derive(Debug, Clone)]
pub struct ShapeGgufOptions {
    pub shape: String,
    pub format: String,
    /// Folder with `tokenizer.json` and `tokenizer_config.json`.
    pub tokenizer: PathBuf,
    pub out: PathBuf,
    pub seed: u64,
}

/// The standard deviation of the random weights (the usual initialisation scale of these models).
const WEIGHT_STD: f32 = 0.02;
/// Values generated and quantised per task: big enough to amortise a task, small enough that a batch
/// of them per thread stays in a few hundred MB.
const CHUNK_VALUES: usize = 1 << 20;

/// How a tensor's values are made.
enum Fill {
    Random,
    Ones,
    Values(Vec<f32>),
}

struct Planned {
    decl: TensorDecl,
    fill: Fill,
}

/// Runs the subcommand: writes the file, prints its path on stdout and a summary on stderr.
pub fn run(o: &ShapeGgufOptions) -> Result<()> {
    let config = super::synthetic::shape_config(&o.shape)?;
    let mix = QuantMix::parse(&o.format)?;
    let t0 = Instant::now();
    let bytes = write_random_gguf(&config, &o.shape, mix, &o.tokenizer, &o.out, o.seed)?;
    eprintln!(
        "wrote {} ({:.2} GB, {} shape, {}, random weights) in {:.1} s",
        o.out.display(),
        bytes as f64 / 1e9,
        o.shape,
        mix.name(),
        t0.elapsed().as_secs_f64()
    );
    println!("{}", o.out.display());
    Ok(())
}

fn arch_name(a: Arch) -> &'static str {
    match a {
        Arch::Llama => "llama",
        Arch::Qwen3 => "qwen3",
    }
}

/// llama.cpp's tensors of a dense LLaMA / Qwen 3 model with their types in `mix`, in file order.
fn plan(c: &ModelConfig, mix: QuantMix) -> Result<Vec<Planned>> {
    let (d, hd, ff, n) = (c.hidden_size, c.head_dim, c.intermediate_size, c.num_layers);
    let tied = c.tie_word_embeddings;
    let mut out = Vec::new();
    let mut add = |name: String, dims: Vec<usize>, role: Role, fill: Fill| -> Result<()> {
        let cols = *dims.last().unwrap_or(&1);
        let dtype = mix.tensor_type(role, cols, n, tied)?;
        out.push(Planned {
            decl: TensorDecl { name, dims, dtype },
            fill,
        });
        Ok(())
    };
    if let Some(factors) = rope_factors(c) {
        add(
            "rope_freqs.weight".into(),
            vec![hd / 2],
            Role::Vector,
            Fill::Values(factors),
        )?;
    }
    add(
        "token_embd.weight".into(),
        vec![c.vocab_size, d],
        Role::TokenEmbedding,
        Fill::Random,
    )?;
    for i in 0..n {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        add(p("attn_norm"), vec![d], Role::Vector, Fill::Ones)?;
        add(p("attn_q"), vec![c.num_heads * hd, d], Role::Matrix, Fill::Random)?;
        add(
            p("attn_k"),
            vec![c.num_kv_heads * hd, d],
            Role::Matrix,
            Fill::Random,
        )?;
        add(
            p("attn_v"),
            vec![c.num_kv_heads * hd, d],
            Role::AttnV { layer: i },
            Fill::Random,
        )?;
        add(
            p("attn_output"),
            vec![d, c.num_heads * hd],
            Role::Matrix,
            Fill::Random,
        )?;
        if c.qk_norm() {
            add(p("attn_q_norm"), vec![hd], Role::Vector, Fill::Ones)?;
            add(p("attn_k_norm"), vec![hd], Role::Vector, Fill::Ones)?;
        }
        add(p("ffn_norm"), vec![d], Role::Vector, Fill::Ones)?;
        add(p("ffn_gate"), vec![ff, d], Role::Matrix, Fill::Random)?;
        add(p("ffn_up"), vec![ff, d], Role::Matrix, Fill::Random)?;
        add(
            p("ffn_down"),
            vec![d, ff],
            Role::FfnDown { layer: i },
            Fill::Random,
        )?;
    }
    add("output_norm.weight".into(), vec![d], Role::Vector, Fill::Ones)?;
    if !tied {
        add(
            "output.weight".into(),
            vec![c.vocab_size, d],
            Role::Output,
            Fill::Random,
        )?;
    }
    Ok(out)
}

/// LLaMA 3.1's RoPE rescaling as llama.cpp stores it: `rope_freqs.weight[i]` divides frequency `i`
/// (the unscaled frequency over the scaled one).
fn rope_factors(c: &ModelConfig) -> Option<Vec<f32>> {
    c.rope_scaling.as_ref()?;
    let unscaled = ModelConfig {
        rope_scaling: None,
        ..c.clone()
    }
    .rope_inv_freq();
    Some(
        unscaled
            .iter()
            .zip(c.rope_inv_freq())
            .map(|(u, s)| u / s)
            .collect(),
    )
}

/// The model metadata llama.cpp reads for `general.architecture` llama / qwen3.
fn model_metadata(c: &ModelConfig, label: &str, mix: QuantMix, seed: u64) -> Vec<(String, Value)> {
    let a = arch_name(c.arch);
    let u = |x: usize| Value::U32(x as u32);
    let mut md = vec![
        ("general.architecture".to_string(), Value::String(a.into())),
        ("general.type".to_string(), Value::String("model".into())),
        (
            "general.name".to_string(),
            Value::String(format!("{label} shape, random weights")),
        ),
        (
            "general.description".to_string(),
            Value::String(format!(
                "Random weights (N(0, {WEIGHT_STD}^2), norms 1, seed {seed}) in the shape of {label}, \
                 {} mix, written by probespec shape-gguf for speed measurements: its text is noise.",
                mix.name()
            )),
        ),
        ("general.file_type".to_string(), Value::U32(mix.file_type())),
        ("general.quantization_version".to_string(), Value::U32(2)),
    ];
    let arch_keys = [
        ("vocab_size", u(c.vocab_size)),
        ("context_length", u(c.max_position_embeddings)),
        ("embedding_length", u(c.hidden_size)),
        ("block_count", u(c.num_layers)),
        ("feed_forward_length", u(c.intermediate_size)),
        ("attention.head_count", u(c.num_heads)),
        ("attention.head_count_kv", u(c.num_kv_heads)),
        ("attention.key_length", u(c.head_dim)),
        ("attention.value_length", u(c.head_dim)),
        ("rope.dimension_count", u(c.head_dim)),
        ("rope.freq_base", Value::F32(c.rope_theta)),
        (
            "attention.layer_norm_rms_epsilon",
            Value::F32(c.rms_norm_eps as f32),
        ),
    ];
    md.extend(arch_keys.into_iter().map(|(k, v)| (format!("{a}.{k}"), v)));
    md
}

/// Writes a GGUF of `config`'s shape with random weights in `mix` and the tokenizer in `tokenizer_dir`
/// to `out` (through `out.part`, renamed when complete). Returns the file's size in bytes.
pub fn write_random_gguf(
    config: &ModelConfig,
    label: &str,
    mix: QuantMix,
    tokenizer_dir: &Path,
    out: &Path,
    seed: u64,
) -> Result<u64> {
    let mut metadata = model_metadata(config, label, mix, seed);
    metadata.extend(
        tokenizer_metadata(tokenizer_dir, config.vocab_size, config.bos_token_id)
            .with_context(|| format!("tokenizer in {}", tokenizer_dir.display()))?,
    );
    let planned = plan(config, mix)?;
    let decls: Vec<TensorDecl> = planned.iter().map(|p| p.decl.clone()).collect();
    let part = PathBuf::from(format!("{}.part", out.display()));
    let file = std::fs::File::create(&part).with_context(|| format!("cannot create {}", part.display()))?;
    let mut stream = GgufStream::begin(std::io::BufWriter::new(file), &metadata, &decls)?;
    let t0 = Instant::now();
    for p in &planned {
        match &p.fill {
            Fill::Random => write_random_matrix(&mut stream, &p.decl, seed)?,
            Fill::Ones => stream.write(&f32_bytes(&vec![1.0; p.decl.dims.iter().product()]))?,
            Fill::Values(v) => stream.write(&f32_bytes(v))?,
        }
        if p.decl.name.ends_with("ffn_down.weight") {
            eprintln!(
                "{} written ({:.1} s)",
                p.decl.name.trim_end_matches(".ffn_down.weight"),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    stream.finish()?;
    std::fs::rename(&part, out)
        .with_context(|| format!("cannot rename {} to {}", part.display(), out.display()))?;
    Ok(std::fs::metadata(out)?.len())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// FNV-1a of a tensor name: part of every chunk's seed.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// SplitMix64's finaliser: spreads the combined seed over all bits.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A random `[rows, cols]` matrix in its type, generated and quantised chunk by chunk on every thread,
/// written in order.
fn write_random_matrix<W: std::io::Write + std::io::Seek>(
    stream: &mut GgufStream<W>,
    decl: &TensorDecl,
    seed: u64,
) -> Result<()> {
    let &[rows, cols] = decl.dims.as_slice() else {
        anyhow::bail!("{} is not a matrix", decl.name);
    };
    let per_chunk = (CHUNK_VALUES / cols).max(1);
    let chunks = rows.div_ceil(per_chunk);
    let tensor_seed = mix64(seed ^ name_hash(&decl.name));
    let normal = Normal::new(0f32, WEIGHT_STD)?;
    let batch = 2 * rayon::current_num_threads();
    for first in (0..chunks).step_by(batch) {
        let parts: Vec<Result<Vec<u8>>> = (first..chunks.min(first + batch))
            .into_par_iter()
            .map(|chunk| {
                let r = per_chunk.min(rows - chunk * per_chunk);
                let mut rng = StdRng::seed_from_u64(mix64(tensor_seed ^ chunk as u64));
                let values: Vec<f32> = (0..r * cols).map(|_| normal.sample(&mut rng)).collect();
                quantize(values, r, cols, decl.dtype)
            })
            .collect();
        for p in parts {
            stream.write(&p?)?;
        }
    }
    Ok(())
}

fn quantize(values: Vec<f32>, rows: usize, cols: usize, dtype: GgmlDType) -> Result<Vec<u8>> {
    if dtype == GgmlDType::F32 {
        return Ok(f32_bytes(&values));
    }
    let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu)?;
    Ok(QTensor::quantize(&t, dtype)?.data()?.into_owned())
}
