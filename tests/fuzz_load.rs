//! Corrupt and inconsistent checkpoints give an error, never a panic. Tiny LLaMA and Qwen 3 checkpoints
//! are mutated a few hundred times each, from fixed seeds: a block-quantised GGUF by random bit flips,
//! overwritten words and truncations, its metadata and tensors by random field changes, and a config.json
//! by random field changes (zeros, negatives, huge numbers, wrong types, missing fields). Each case is
//! loaded in-process under `catch_unwind` and, when it loads, encodes a prompt, generates a few tokens
//! plainly and with ESP, and decodes them. A few cases also go through the binary: exit status 1 and one
//! line on stderr.

mod common;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use common::decoding::{esp, greedy};
use common::TinySpec;
use probespec::decode::generate::generate;
use probespec::decode::method::{EspTree, Method};
use probespec::model::load::{load_model, LoadOptions, ModelSource};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::path::Path;

#[derive(Debug)]
enum Outcome {
    Ran,
    Failed(String),
    Panicked(String),
}

/// Loads `source` and, when it loads, uses it; catches a panic anywhere in that.
fn attempt(source: &ModelSource) -> Outcome {
    let run = || -> anyhow::Result<()> {
        let opts = LoadOptions {
            device: candle_core::Device::Cpu,
            dtype: candle_core::DType::F32,
            dequantize: false,
            activations: Default::default(),
        };
        let m = load_model(source, &opts)?;
        let mut prompt = m.tokenizer.encode("w5 w6 w7 w5 w6")?;
        prompt.retain(|&t| (t as usize) < m.model.config.vocab_size);
        if prompt.is_empty() {
            prompt.push(0);
        }
        let params = greedy(4, vec![]);
        let mut ar = Method::Ar.drafter(0)?;
        let g = generate(&m.model, &prompt, ar.as_mut(), &params, &mut |_| Ok(()))?;
        m.tokenizer.decode(&g.tokens)?;
        let mut d = esp(10, 1, EspTree::Dynamic).drafter(0)?;
        generate(&m.model, &prompt, d.as_mut(), &params, &mut |_| Ok(()))?;
        Ok(())
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(Ok(())) => Outcome::Ran,
        Ok(Err(e)) => Outcome::Failed(format!("{e:#}")),
        Err(p) => Outcome::Panicked(
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        ),
    }
}

/// Tallies outcomes; fails with every panic's case and message.
#[derive(Default)]
struct Tally {
    ran: usize,
    failed: usize,
    /// A few of the errors, for the log.
    errors: Vec<String>,
    panics: Vec<String>,
}

impl Tally {
    fn add(&mut self, case: &str, o: Outcome) {
        match o {
            Outcome::Ran => self.ran += 1,
            Outcome::Failed(e) => {
                self.failed += 1;
                if self.errors.len() < 8 {
                    let first_line = e.lines().next().unwrap_or_default();
                    self.errors.push(format!("{case}: {first_line}"));
                }
            }
            Outcome::Panicked(msg) => self.panics.push(format!("{case}: {msg}")),
        }
    }

    fn check(&self, what: &str, min_failed: usize) {
        eprintln!(
            "{what}: {} ran, {} failed cleanly, {} panicked",
            self.ran,
            self.failed,
            self.panics.len()
        );
        for e in &self.errors {
            eprintln!("  {e}");
        }
        assert!(
            self.panics.is_empty(),
            "{what}: panics:\n{}",
            self.panics.join("\n")
        );
        assert!(
            self.failed >= min_failed,
            "{what}: only {} cases failed: the mutations do not reach the loader",
            self.failed
        );
    }
}

/// The binary on a corrupt model: exit status 1, one line on stderr, no panic.
fn binary_fails_cleanly(model: &Path) {
    common::binary::probespec(&[
        "--model",
        model.to_str().unwrap(),
        "--max-new-tokens",
        "4",
        "w5 w6",
    ])
    .errors_with("");
}

fn spec(seed: u64) -> TinySpec {
    if seed.is_multiple_of(2) {
        TinySpec::llama()
    } else {
        TinySpec::qwen3()
    }
}

/// Q8_0 embeddings, Q4_0 attention, Q4_1 MLP: the CPU block kernel's path, rows reordered for LLaMA.
fn write_gguf(spec: &TinySpec, path: &Path) {
    spec.write_gguf_as(path, common::mixed_block_format)
}

/// Where the tensor data of a GGUF starts: what comes before is the header (metadata, tensor table).
fn header_len(path: &Path) -> usize {
    let mut f = std::fs::File::open(path).unwrap();
    candle_core::quantized::gguf_file::Content::read(&mut f)
        .unwrap()
        .tensor_data_offset as usize
}

/// Random bit flips, overwritten words and truncations, mostly in the header.
fn mutate_bytes(bytes: &[u8], header: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut b = bytes.to_vec();
    match rng.random_range(0..6) {
        0 => {
            for _ in 0..rng.random_range(1..=4) {
                let i = rng.random_range(0..header);
                b[i] ^= 1 << rng.random_range(0..8);
            }
        }
        1 | 2 => {
            // A length, count, type or value of the header replaced by an extreme.
            let i = rng.random_range(0..header - 8);
            let v: u64 = [
                0,
                1,
                2,
                3,
                0xff,
                0x7fff_ffff,
                0xffff_ffff,
                u64::MAX,
                1 << 40,
                rng.random(),
            ][rng.random_range(0..10)];
            let width = if rng.random_bool(0.5) { 4 } else { 8 };
            b[i..i + width].copy_from_slice(&v.to_le_bytes()[..width]);
        }
        3 => {
            let n = b.len();
            for _ in 0..rng.random_range(1..=16) {
                b[rng.random_range(0..n)] = rng.random();
            }
        }
        4 => b.truncate(rng.random_range(0..header)),
        _ => b.truncate(rng.random_range(0..bytes.len())),
    }
    b
}

#[test]
fn gguf_byte_mutations_never_panic() {
    let dir = common::tempdir();
    let originals: Vec<(Vec<u8>, usize)> = (0..2)
        .map(|s| {
            let p = dir.path().join(format!("orig{s}.gguf"));
            write_gguf(&spec(s), &p);
            (std::fs::read(&p).unwrap(), header_len(&p))
        })
        .collect();
    let path = dir.path().join("case.gguf");
    let mut tally = Tally::default();
    let mut through_binary = 0;
    for seed in 0..300u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let (bytes, header) = &originals[(seed % 2) as usize];
        std::fs::write(&path, mutate_bytes(bytes, *header, &mut rng)).unwrap();
        let o = attempt(&ModelSource::Gguf(path.clone()));
        if matches!(o, Outcome::Failed(_)) && through_binary < 4 && seed % 7 == 0 {
            binary_fails_cleanly(&path);
            through_binary += 1;
        }
        tally.add(&format!("seed {seed}"), o);
    }
    tally.check("GGUF byte mutations", 100);
    assert_eq!(through_binary, 4, "too few failing cases went through the binary");
}

/// A metadata value of another type or an extreme value, a key removed, or a tensor of another shape.
fn mutate_gguf_fields(path: &Path, rng: &mut StdRng) -> String {
    let mut what = String::new();
    common::edit_gguf(path, |md, tensors| {
        for _ in 0..rng.random_range(1..=2) {
            if rng.random_bool(0.1) {
                // candle's reader divides by it.
                let v = [
                    Value::U32(0),
                    Value::U8(0),
                    Value::U32(1),
                    Value::U32(64),
                    Value::I32(-1),
                ][rng.random_range(0..5)]
                .clone();
                what += &format!("general.alignment = {v:?}; ");
                md.insert("general.alignment".into(), v);
            } else if rng.random_bool(0.7) {
                let mut keys: Vec<String> = md.keys().cloned().collect();
                keys.sort();
                let k = keys[rng.random_range(0..keys.len())].clone();
                let v = match rng.random_range(0..11) {
                    0 => Some(Value::U32(0)),
                    1 => Some(Value::U32(1)),
                    2 => Some(Value::U32(3)),
                    3 => Some(Value::U32(u32::MAX)),
                    4 => Some(Value::U64(u64::MAX)),
                    5 => Some(Value::I32(-1)),
                    6 => Some(Value::F32(f32::NAN)),
                    7 => Some(Value::F32(-1.0)),
                    8 => Some(Value::String("x".into())),
                    9 => Some(Value::Array(vec![])),
                    _ => None,
                };
                what += &format!("{k} = {v:?}; ");
                match v {
                    Some(v) => md.insert(k, v),
                    None => md.remove(&k),
                };
            } else {
                let i = rng.random_range(0..tensors.len());
                let shape: Vec<usize> = match rng.random_range(0..4) {
                    0 => vec![32],
                    1 => vec![32, 32],
                    2 => vec![64, 32],
                    _ => vec![2, 32, 32],
                };
                let t = candle_core::Tensor::ones(
                    shape.as_slice(),
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )
                .unwrap();
                what += &format!("{} -> {shape:?}; ", tensors[i].0);
                tensors[i].1 = QTensor::quantize(&t, GgmlDType::F32).unwrap();
            }
        }
    });
    what
}

#[test]
fn gguf_field_changes_never_panic() {
    let dir = common::tempdir();
    let originals: Vec<Vec<u8>> = (0..2)
        .map(|s| {
            let p = dir.path().join(format!("orig{s}.gguf"));
            write_gguf(&spec(s), &p);
            std::fs::read(&p).unwrap()
        })
        .collect();
    let path = dir.path().join("case.gguf");
    let mut tally = Tally::default();
    let mut through_binary = 0;
    for seed in 0..200u64 {
        let mut rng = StdRng::seed_from_u64(1000 + seed);
        std::fs::write(&path, &originals[(seed % 2) as usize]).unwrap();
        let what = mutate_gguf_fields(&path, &mut rng);
        let o = attempt(&ModelSource::Gguf(path.clone()));
        if matches!(o, Outcome::Failed(_)) && through_binary < 3 && seed % 5 == 0 {
            binary_fails_cleanly(&path);
            through_binary += 1;
        }
        tally.add(&format!("seed {seed} ({what})"), o);
    }
    tally.check("GGUF field changes", 60);
    assert_eq!(through_binary, 3, "too few failing cases went through the binary");
}

/// One to three config.json fields (nested rope_scaling ones included) set to a zero, a negative, a huge
/// number, another type, or removed.
fn mutate_config(cfg: &mut serde_json::Value, rng: &mut StdRng) -> String {
    let mut what = String::new();
    for _ in 0..rng.random_range(1..=3) {
        let mut fields: Vec<String> = cfg.as_object().unwrap().keys().cloned().collect();
        if cfg.get("rope_scaling").is_some_and(|r| r.is_object()) {
            fields.extend(
                cfg["rope_scaling"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(|k| format!("rope_scaling.{k}")),
            );
        }
        fields.sort();
        let f = fields[rng.random_range(0..fields.len())].clone();
        let v = [
            json!(0),
            json!(1),
            json!(-1),
            json!(3),
            json!(-1e9),
            json!(0.5),
            json!(1e300),
            json!(u64::MAX),
            json!(1u64 << 40),
            json!(1u64 << 31),
            json!("str"),
            json!([]),
            json!({}),
            json!(true),
            serde_json::Value::Null,
        ];
        let remove = rng.random_range(0..(v.len() + 2)) >= v.len();
        let v = v[rng.random_range(0..v.len())].clone();
        what += &format!(
            "{f} = {}; ",
            if remove { "removed".into() } else { v.to_string() }
        );
        let (obj, key) = match f.strip_prefix("rope_scaling.") {
            Some(k) => (cfg["rope_scaling"].as_object_mut().unwrap(), k.to_string()),
            None => (cfg.as_object_mut().unwrap(), f.clone()),
        };
        if remove {
            obj.remove(&key);
        } else {
            obj.insert(key, v);
        }
    }
    what
}

#[test]
fn config_field_changes_never_panic() {
    let dirs: Vec<tempfile::TempDir> = (0..2)
        .map(|s| {
            let d = common::tempdir();
            spec(s).write_hf(d.path());
            d
        })
        .collect();
    let mut tally = Tally::default();
    let mut through_binary = 0;
    for seed in 0..300u64 {
        let mut rng = StdRng::seed_from_u64(2000 + seed);
        let s = spec(seed);
        let dir = dirs[(seed % 2) as usize].path();
        let mut cfg = s.config_json();
        let what = mutate_config(&mut cfg, &mut rng);
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let o = attempt(&ModelSource::HfDir(dir.to_path_buf()));
        if matches!(o, Outcome::Failed(_)) && through_binary < 3 && seed % 5 == 0 {
            binary_fails_cleanly(dir);
            through_binary += 1;
        }
        tally.add(&format!("seed {seed} ({what})"), o);
    }
    tally.check("config.json field changes", 60);
    assert_eq!(through_binary, 3, "too few failing cases went through the binary");
}
