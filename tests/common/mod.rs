//! Code shared by the integration tests (each tests/*.rs is its own crate, so not every test uses all of it).
//!
//! - here: tiny random LLaMA / Qwen 3 checkpoints written to disk as HF folders and GGUF files, the path of
//!   the real SmolLM2 model, and the exact sampling distribution with the chi-square statistics that test
//!   samples against it;
//! - [`decoding`]: the test prompts, the method configurations, and the lossless check (every method
//!   token-identical to plain decoding);
//! - [`binary`]: running the `probespec` binary and checking how it exits.
#![allow(dead_code)]

pub mod binary;
pub mod decoding;
pub mod server;

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TinyArch {
    Llama,
    Qwen3,
}

pub struct TinySpec {
    pub arch: TinyArch,
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub max_pos: usize,
    pub tied: bool,
    /// Standard deviation of the random weights: larger makes sharper, more repetitive greedy output.
    pub scale: f32,
    pub seed: u64,
}

impl TinySpec {
    pub fn llama() -> Self {
        TinySpec {
            arch: TinyArch::Llama,
            vocab: 256,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate: 128,
            max_pos: 512,
            tied: false,
            scale: 0.15,
            seed: 1,
        }
    }

    pub fn qwen3() -> Self {
        // Qwen 3 has an explicit head_dim that need not be hidden / heads.
        TinySpec {
            arch: TinyArch::Qwen3,
            head_dim: 24,
            tied: true,
            seed: 2,
            scale: 0.3,
            ..Self::llama()
        }
    }

    pub fn config_json(&self) -> serde_json::Value {
        match self.arch {
            TinyArch::Llama => json!({
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": self.vocab,
                "hidden_size": self.hidden,
                "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64, "rope_type": "llama3"
                },
                "max_position_embeddings": self.max_pos,
                "tie_word_embeddings": self.tied,
                "bos_token_id": 1,
                "eos_token_id": 2,
            }),
            TinyArch::Qwen3 => json!({
                "model_type": "qwen3",
                "architectures": ["Qwen3ForCausalLM"],
                "vocab_size": self.vocab,
                "hidden_size": self.hidden,
                "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "attention_bias": false,
                "max_position_embeddings": self.max_pos,
                "sliding_window": null,
                "max_window_layers": self.layers,
                "tie_word_embeddings": self.tied,
                "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-6,
                "use_sliding_window": false,
                "hidden_act": "silu",
                "bos_token_id": 1,
                "eos_token_id": 2,
            }),
        }
    }

    /// Random weights under Hugging Face names.
    pub fn weights(&self) -> HashMap<String, Tensor> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut w = HashMap::new();
        let mut randn = |shape: &[usize], scale: f32| -> Tensor {
            let n: usize = shape.iter().product();
            // Sum of uniforms: close enough to normal for test weights, and dependency-free.
            let v: Vec<f32> = (0..n)
                .map(|_| (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * scale * 1.7)
                .collect();
            Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
        };
        let (d, hd, s) = (self.hidden, self.head_dim, self.scale);
        w.insert("model.embed_tokens.weight".into(), randn(&[self.vocab, d], 1.0));
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            let norm = |name: &str, n: usize, w: &mut HashMap<String, Tensor>, rng_t: Tensor| {
                let _ = n;
                w.insert(format!("{p}.{name}.weight"), (rng_t + 1.0).unwrap());
            };
            norm("input_layernorm", d, &mut w, randn(&[d], 0.1));
            norm("post_attention_layernorm", d, &mut w, randn(&[d], 0.1));
            w.insert(
                format!("{p}.self_attn.q_proj.weight"),
                randn(&[self.heads * hd, d], s),
            );
            w.insert(
                format!("{p}.self_attn.k_proj.weight"),
                randn(&[self.kv_heads * hd, d], s),
            );
            w.insert(
                format!("{p}.self_attn.v_proj.weight"),
                randn(&[self.kv_heads * hd, d], s),
            );
            w.insert(
                format!("{p}.self_attn.o_proj.weight"),
                randn(&[d, self.heads * hd], s),
            );
            if self.arch == TinyArch::Qwen3 {
                norm("self_attn.q_norm", hd, &mut w, randn(&[hd], 0.1));
                norm("self_attn.k_norm", hd, &mut w, randn(&[hd], 0.1));
            }
            w.insert(
                format!("{p}.mlp.gate_proj.weight"),
                randn(&[self.intermediate, d], s),
            );
            w.insert(
                format!("{p}.mlp.up_proj.weight"),
                randn(&[self.intermediate, d], s),
            );
            w.insert(
                format!("{p}.mlp.down_proj.weight"),
                randn(&[d, self.intermediate], s),
            );
        }
        w.insert("model.norm.weight".into(), (randn(&[d], 0.1) + 1.0).unwrap());
        if !self.tied {
            w.insert("lm_head.weight".into(), randn(&[self.vocab, d], s));
        }
        w
    }

    /// Token strings of the tiny vocabulary: ids 0..=3 are specials, the rest single words.
    pub fn vocab_strings(&self) -> Vec<String> {
        (0..self.vocab)
            .map(|i| match i {
                0 => "<unk>".to_string(),
                1 => "<s>".to_string(),
                2 => "</s>".to_string(),
                3 => "<|im_end|>".to_string(),
                _ => format!("w{i}"),
            })
            .collect()
    }

    /// Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json.
    pub fn write_hf(&self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), self.config_json().to_string()).unwrap();
        candle_core::safetensors::save(&self.weights(), dir.join("model.safetensors")).unwrap();
        let vocab: serde_json::Map<String, serde_json::Value> = self
            .vocab_strings()
            .into_iter()
            .enumerate()
            .map(|(i, s)| (s, json!(i)))
            .collect();
        let added: Vec<serde_json::Value> = (0..4)
            .map(|i| json!({"id": i, "content": self.vocab_strings()[i], "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
            .collect();
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": null,
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        });
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        let tcfg = json!({
            "bos_token": "<s>",
            "eos_token": "</s>",
            "add_bos_token": false,
            "chat_template": "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}{% if add_generation_prompt %}w4 {% if enable_thinking is defined and enable_thinking is false %}w5 {% endif %}{% endif %}"
        });
        std::fs::write(dir.join("tokenizer_config.json"), tcfg.to_string()).unwrap();
    }

    /// Writes the same weights as an f32 GGUF the way llama.cpp's converter does (LLaMA q/k rows
    /// interleaved per head), with a byte-level BPE tokenizer in the metadata.
    pub fn write_gguf(&self, path: &Path) {
        self.write_gguf_as(path, |_| candle_core::quantized::GgmlDType::F32)
    }

    /// [`Self::write_gguf`] with each matrix stored in the format `format(name)` picks (norms stay f32).
    pub fn write_gguf_as(&self, path: &Path, format: impl Fn(&str) -> candle_core::quantized::GgmlDType) {
        self.write_gguf_impl(path, format, false)
    }

    /// The weights of [`Self::write_gguf_as`] (rounded by each matrix's format), dequantised and stored
    /// as f32.
    pub fn write_gguf_dequantized(
        &self,
        path: &Path,
        format: impl Fn(&str) -> candle_core::quantized::GgmlDType,
    ) {
        self.write_gguf_impl(path, format, true)
    }

    fn write_gguf_impl(
        &self,
        path: &Path,
        format: impl Fn(&str) -> candle_core::quantized::GgmlDType,
        dequantized: bool,
    ) {
        let arch = match self.arch {
            TinyArch::Llama => "llama",
            TinyArch::Qwen3 => "qwen3",
        };
        let w = self.weights();
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut add = |name: String, t: &Tensor| {
            let f = if t.rank() == 2 {
                format(&name)
            } else {
                candle_core::quantized::GgmlDType::F32
            };
            let mut q = QTensor::quantize(t, f).unwrap();
            if dequantized {
                let d = q.dequantize(&Device::Cpu).unwrap();
                q = QTensor::quantize(&d, candle_core::quantized::GgmlDType::F32).unwrap();
            }
            tensors.push((name, q))
        };
        let permute = |t: &Tensor, heads: usize| -> Tensor {
            if self.arch != TinyArch::Llama {
                return t.clone();
            }
            let (rows, cols) = t.dims2().unwrap();
            t.reshape((heads, 2, rows / heads / 2, cols))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .reshape((rows, cols))
                .unwrap()
        };
        add("token_embd.weight".into(), &w["model.embed_tokens.weight"]);
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            let b = format!("blk.{i}");
            add(
                format!("{b}.attn_norm.weight"),
                &w[&format!("{p}.input_layernorm.weight")],
            );
            add(
                format!("{b}.ffn_norm.weight"),
                &w[&format!("{p}.post_attention_layernorm.weight")],
            );
            add(
                format!("{b}.attn_q.weight"),
                &permute(&w[&format!("{p}.self_attn.q_proj.weight")], self.heads),
            );
            add(
                format!("{b}.attn_k.weight"),
                &permute(&w[&format!("{p}.self_attn.k_proj.weight")], self.kv_heads),
            );
            add(
                format!("{b}.attn_v.weight"),
                &w[&format!("{p}.self_attn.v_proj.weight")],
            );
            add(
                format!("{b}.attn_output.weight"),
                &w[&format!("{p}.self_attn.o_proj.weight")],
            );
            if self.arch == TinyArch::Qwen3 {
                add(
                    format!("{b}.attn_q_norm.weight"),
                    &w[&format!("{p}.self_attn.q_norm.weight")],
                );
                add(
                    format!("{b}.attn_k_norm.weight"),
                    &w[&format!("{p}.self_attn.k_norm.weight")],
                );
            }
            add(
                format!("{b}.ffn_gate.weight"),
                &w[&format!("{p}.mlp.gate_proj.weight")],
            );
            add(
                format!("{b}.ffn_up.weight"),
                &w[&format!("{p}.mlp.up_proj.weight")],
            );
            add(
                format!("{b}.ffn_down.weight"),
                &w[&format!("{p}.mlp.down_proj.weight")],
            );
        }
        add("output_norm.weight".into(), &w["model.norm.weight"]);
        if !self.tied {
            add("output.weight".into(), &w["lm_head.weight"]);
        }
        use gguf_file::Value as V;
        let mut md: Vec<(String, V)> = vec![
            ("general.architecture".into(), V::String(arch.into())),
            (format!("{arch}.context_length"), V::U32(self.max_pos as u32)),
            (format!("{arch}.embedding_length"), V::U32(self.hidden as u32)),
            (
                format!("{arch}.feed_forward_length"),
                V::U32(self.intermediate as u32),
            ),
            (format!("{arch}.block_count"), V::U32(self.layers as u32)),
            (format!("{arch}.attention.head_count"), V::U32(self.heads as u32)),
            (
                format!("{arch}.attention.head_count_kv"),
                V::U32(self.kv_heads as u32),
            ),
            (
                format!("{arch}.attention.key_length"),
                V::U32(self.head_dim as u32),
            ),
            (
                format!("{arch}.rope.dimension_count"),
                V::U32(self.head_dim as u32),
            ),
            (
                format!("{arch}.attention.layer_norm_rms_epsilon"),
                V::F32(if self.arch == TinyArch::Llama { 1e-5 } else { 1e-6 }),
            ),
            (
                format!("{arch}.rope.freq_base"),
                V::F32(if self.arch == TinyArch::Llama {
                    500000.0
                } else {
                    1000000.0
                }),
            ),
            ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), V::String("gpt-2".into())),
            (
                "tokenizer.ggml.tokens".into(),
                V::Array(self.vocab_strings().into_iter().map(V::String).collect()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                V::Array(
                    (0..self.vocab)
                        .map(|i| V::I32(if i < 4 { 3 } else { 1 }))
                        .collect(),
                ),
            ),
            ("tokenizer.ggml.merges".into(), V::Array(vec![])),
            ("tokenizer.ggml.bos_token_id".into(), V::U32(1)),
            ("tokenizer.ggml.eos_token_id".into(), V::U32(2)),
        ];
        if self.arch == TinyArch::Llama {
            // llama.cpp stores LLaMA 3.1 rope scaling as per-frequency factors.
            let cfg: probespec::model::ModelConfig =
                probespec::model::ModelConfig::from_hf_json(&self.config_json().to_string()).unwrap();
            let plain = probespec::model::ModelConfig {
                rope_scaling: None,
                ..cfg.clone()
            };
            let factors: Vec<f32> = plain
                .rope_inv_freq()
                .iter()
                .zip(cfg.rope_inv_freq())
                .map(|(a, b)| a / b)
                .collect();
            let n = factors.len();
            add(
                "rope_freqs.weight".into(),
                &Tensor::from_vec(factors, n, &Device::Cpu).unwrap(),
            );
        }
        let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut f = std::fs::File::create(path).unwrap();
        gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
        md.clear();
    }
}

/// Block formats of a llama.cpp-style mixed GGUF: Q8_0 embeddings (and so the tied vocabulary
/// projection), Q4_0 attention, Q4_1 MLP.
#[allow(dead_code)]
pub fn mixed_block_format(name: &str) -> candle_core::quantized::GgmlDType {
    use candle_core::quantized::GgmlDType;
    if name.starts_with("token_embd") || name.starts_with("output.") {
        GgmlDType::Q8_0
    } else if name.contains("attn") {
        GgmlDType::Q4_0
    } else {
        GgmlDType::Q4_1
    }
}

/// The real SmolLM2-135M-Instruct GGUF. Panics with the fetch command when it is missing.
pub fn smollm2_path() -> PathBuf {
    let p = probespec::model::load::default_model_path();
    assert!(
        p.is_file(),
        "SmolLM2 GGUF not found at {}: run `make model` (scripts/fetch-model.sh) to fetch it",
        p.display()
    );
    p
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// The device the tiny-model tests run on: the CPU, or the one `PROBESPEC_TEST_DEVICE` names (`cuda`,
/// `metal`; used by scripts/gpu-check.sh on a GPU machine). The name is checked, never ignored.
pub fn test_device() -> Device {
    match std::env::var("PROBESPEC_TEST_DEVICE").as_deref() {
        Err(_) | Ok("cpu") => Device::Cpu,
        Ok("cuda") => Device::new_cuda(0).expect("PROBESPEC_TEST_DEVICE=cuda but no CUDA device"),
        Ok("metal") => Device::new_metal(0).expect("PROBESPEC_TEST_DEVICE=metal but no Metal device"),
        Ok(other) => panic!("PROBESPEC_TEST_DEVICE={other}: expected cpu, cuda or metal"),
    }
}

/// Loads a tiny checkpoint written to a fresh temporary folder (kept alive by the returned guard), in
/// f32 on [`test_device`].
pub fn load_tiny(spec: &TinySpec) -> (tempfile::TempDir, probespec::model::Transformer) {
    load_tiny_as(spec, candle_core::DType::F32)
}

/// [`load_tiny`] in `dtype`.
pub fn load_tiny_as(
    spec: &TinySpec,
    dtype: candle_core::DType,
) -> (tempfile::TempDir, probespec::model::Transformer) {
    let dir = tempdir();
    spec.write_hf(dir.path());
    let source = probespec::model::load::ModelSource::HfDir(dir.path().to_path_buf());
    let m = load_as(&source, dtype, Default::default());
    (dir, m)
}

/// A model from `source` on [`test_device`] in `dtype`, its GGUF quantised weights (if any) multiplied
/// with `activations`.
pub fn load_as(
    source: &probespec::model::load::ModelSource,
    dtype: candle_core::DType,
    activations: probespec::model::load::Activations,
) -> probespec::model::Transformer {
    let opts = probespec::model::load::LoadOptions {
        device: test_device(),
        dtype,
        dequantize: false,
        activations,
    };
    probespec::model::load::load_model(source, &opts)
        .unwrap_or_else(|e| panic!("loading {source:?} in {dtype:?}: {e:#}"))
        .model
}

/// Rewrites a GGUF file after `edit` changed its metadata and tensors (what a corrupt or inconsistent
/// file looks like to the loader).
pub fn edit_gguf(
    path: &Path,
    edit: impl FnOnce(&mut HashMap<String, gguf_file::Value>, &mut Vec<(String, QTensor)>),
) {
    let mut file = std::fs::File::open(path).unwrap();
    let mut ct = gguf_file::Content::read(&mut file).unwrap();
    let mut names: Vec<String> = ct.tensor_infos.keys().cloned().collect();
    names.sort();
    let mut tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|n| {
            let t = ct.tensor(&mut file, &n, &Device::Cpu).unwrap();
            (n, t)
        })
        .collect();
    drop(file);
    edit(&mut ct.metadata, &mut tensors);
    let mut keys: Vec<&String> = ct.metadata.keys().collect();
    keys.sort();
    let md: Vec<(&str, &gguf_file::Value)> =
        keys.into_iter().map(|k| (k.as_str(), &ct.metadata[k])).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md, &t_refs).unwrap();
}

/// The distribution `probespec::decode::sampling::Sampler::pick` draws from for a row of logits, computed
/// independently in f64 from the rules its documentation states: softmax of `logits / temperature`; with
/// top-k, the k most likely tokens (ties: lower id first); with top-p < 1, of those sorted by probability,
/// the shortest prefix whose renormalised cumulative probability reaches top-p; renormalised. Panics when
/// the nucleus boundary is too close to call in f32 (the test's context would then be ambiguous).
pub fn sampling_probs(logits: &[f32], p: &probespec::decode::sampling::SamplingParams) -> Vec<f64> {
    assert!(p.temperature > 0.0, "greedy decoding has no distribution to test");
    let t = p.temperature as f64;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut w: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l as f64 - max) / t).exp()))
        .collect();
    w.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        w.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let total: f64 = w.iter().map(|x| x.1).sum();
        let mut acc = 0.0;
        let mut keep = w.len();
        for (i, x) in w.iter().enumerate() {
            acc += x.1 / total;
            if acc >= p.top_p as f64 {
                assert!(
                    (acc - p.top_p as f64).abs() > 1e-5 && (acc - x.1 / total - p.top_p as f64).abs() > 1e-5,
                    "nucleus boundary within 1e-5 of top-p: ambiguous in f32"
                );
                keep = i + 1;
                break;
            }
        }
        w.truncate(keep);
    }
    let total: f64 = w.iter().map(|x| x.1).sum();
    let mut probs = vec![0.0; logits.len()];
    for (i, x) in w {
        probs[i] = x / total;
    }
    probs
}

/// Pearson chi-square goodness of fit of observed `counts` to category probabilities `probs` (which may
/// leave out categories: their mass is pooled). Categories with an expected count under 5 are pooled into
/// one bin, which joins the smallest kept bin when its own expected count is under 5. The statistic is
/// infinite when a category of probability 0 was observed. Returns (statistic, degrees of freedom).
pub fn chi_square_gof<K: Copy + Ord + std::hash::Hash>(
    counts: &HashMap<K, usize>,
    probs: &HashMap<K, f64>,
) -> (f64, usize) {
    let n = counts.values().sum::<usize>() as f64;
    let impossible = counts
        .iter()
        .any(|(k, &c)| c > 0 && probs.get(k).is_some_and(|&p| p <= 0.0));
    let mut cats: Vec<(K, f64)> = probs.iter().map(|(&k, &p)| (k, p)).collect();
    cats.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut bins: Vec<(f64, f64)> = Vec::new(); // (observed, expected)
    for (k, p) in cats {
        if n * p < 5.0 {
            break;
        }
        bins.push((*counts.get(&k).unwrap_or(&0) as f64, n * p));
    }
    let rest = (
        n - bins.iter().map(|b| b.0).sum::<f64>(),
        (n - bins.iter().map(|b| b.1).sum::<f64>()).max(0.0),
    );
    if rest.1 >= 5.0 || bins.is_empty() {
        bins.push(rest);
    } else {
        let last = bins.last_mut().unwrap();
        last.0 += rest.0;
        last.1 += rest.1;
    }
    let stat = if impossible {
        f64::INFINITY
    } else {
        bins.iter().map(|(o, e)| (o - e).powi(2) / e).sum()
    };
    (stat, bins.len().saturating_sub(1))
}

/// Two-sample chi-square homogeneity statistic over categories, pooling those with a combined count under
/// 10 into one bin; returns (statistic, degrees of freedom).
pub fn chi_square<K: Copy + Ord + std::hash::Hash>(
    a: &HashMap<K, usize>,
    b: &HashMap<K, usize>,
) -> (f64, usize) {
    let (na, nb) = (a.values().sum::<usize>() as f64, b.values().sum::<usize>() as f64);
    let mut keys: Vec<K> = a.keys().chain(b.keys()).copied().collect();
    keys.sort();
    keys.dedup();
    let (mut bins, mut rest) = (Vec::new(), (0.0, 0.0));
    for k in keys {
        let (x, y) = (*a.get(&k).unwrap_or(&0) as f64, *b.get(&k).unwrap_or(&0) as f64);
        if x + y < 10.0 {
            rest.0 += x;
            rest.1 += y;
        } else {
            bins.push((x, y));
        }
    }
    if rest.0 + rest.1 > 0.0 {
        bins.push(rest);
    }
    let mut stat = 0.0;
    for (x, y) in &bins {
        let tot = x + y;
        let (ea, eb) = (tot * na / (na + nb), tot * nb / (na + nb));
        stat += (x - ea).powi(2) / ea + (y - eb).powi(2) / eb;
    }
    (stat, bins.len().saturating_sub(1))
}

/// Upper 0.1% point of chi-square with `df` degrees of freedom (Wilson-Hilferty approximation).
pub fn chi_square_critical_001(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.090; // one-sided 0.999 normal quantile
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}
