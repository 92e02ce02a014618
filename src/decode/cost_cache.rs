//! Where a model's cost curve comes from: measured once per machine, model, device and dtype and kept on
//! disk, so a process starts without a timing pass.
//!
//! A curve is a JSON file under `$PROBESPEC_COST_DIR`, else the model cache folder's `cost/`
//! (`${PROBESPEC_MODEL_DIR:-${XDG_CACHE_HOME:-~/.cache}/probespec}/cost`), named by a hash of its
//! [`CurveKey`]: the CPU (model, the SIMD variants the kernels can use, threads), the model file (path, size,
//! modification time), device, dtype, activations, the curve format, and the binary (version, size and
//! modification time: a rebuilt binary may have other kernels). A file that is missing, older than
//! [`MAX_AGE_DAYS`], of another key, or unreadable is measured again and rewritten (atomically: a
//! temporary file renamed over it); none of that is ever an error.
//!
//! In a process, [`curve_for`] hands out one curve per loaded model: the one injected with [`inject`]
//! (tests, callers that know better), else the model's file when [`attach`] gave it one (the
//! [`crate::session::Session`] does), else a fresh measurement kept in memory.

use super::cost_curve::{CostCurve, Samples, FIRST_TIMING_BUDGET};
use crate::model::Transformer;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Bumped whenever the curve's grid or meaning changes: older files are measured again.
pub const CURVE_FORMAT: u32 = 1;
/// A curve older than this is measured again (machines change: BIOS, governor, memory).
pub const MAX_AGE_DAYS: u64 = 30;

/// Everything a measured cost depends on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CurveKey {
    pub format: u32,
    /// The crate version and the executable's size and modification time.
    pub build: String,
    pub cpu: String,
    /// SIMD variants of the kernels the CPU has.
    pub cpu_features: Vec<String>,
    pub threads: usize,
    /// The model file (or folder, or hub id) with its size and modification time.
    pub model: String,
    pub device: String,
    pub dtype: String,
    /// Activations of quantised weights (q8, f32, or dequantised).
    pub activations: String,
}

impl CurveKey {
    /// The key of a model loaded from `model` (a file, a folder or a hub id) on this machine and binary.
    pub fn new(model: &str, device: &str, dtype: &str, activations: &str) -> Self {
        CurveKey {
            format: CURVE_FORMAT,
            build: build_identity(),
            cpu: crate::facts::cpu_model(),
            cpu_features: cpu_features(),
            threads: rayon::current_num_threads(),
            model: file_identity(model),
            device: device.to_string(),
            dtype: dtype.to_string(),
            activations: activations.to_string(),
        }
    }

    /// A stable 64-bit FNV-1a hash of the key, in hex, for the file name.
    fn hash(&self) -> String {
        crate::facts::fnv1a_hex(serde_json::to_string(self).unwrap_or_default().as_bytes())
    }
}

/// The crate version and the running executable's size and modification time.
fn build_identity() -> String {
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| format!("{} bytes, modified {}", m.len(), mtime(&m)))
        .unwrap_or_else(|| "unknown executable".into());
    format!("probespec {} ({exe})", env!("CARGO_PKG_VERSION"))
}

fn mtime(m: &std::fs::Metadata) -> u64 {
    m.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs())
}

/// A path with its size and modification time (a folder: the sum of its files' sizes and the latest
/// time); anything else (a hub id) as given.
fn file_identity(model: &str) -> String {
    let p = Path::new(model);
    let Ok(meta) = std::fs::metadata(p) else {
        return model.to_string();
    };
    let path = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let (size, time) = if meta.is_dir() {
        std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.metadata().ok())
            .filter(|m| m.is_file())
            .fold((0, 0), |(s, t), m| (s + m.len(), t.max(mtime(&m))))
    } else {
        (meta.len(), mtime(&meta))
    };
    format!("{} ({size} bytes, modified {time})", path.display())
}

fn cpu_features() -> Vec<String> {
    use crate::kernels::isa::Isa;
    [Isa::Avx2, Isa::Avx512, Isa::AvxVnni, Isa::Avx512Vnni]
        .into_iter()
        .filter(|i| i.available())
        .map(|i| format!("{i:?}"))
        .collect()
}

/// The folder of the curve files: `$PROBESPEC_COST_DIR`, else `cost/` in the model cache folder.
pub fn cost_dir() -> PathBuf {
    match std::env::var_os("PROBESPEC_COST_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => crate::model::load::default_model_dir().join("cost"),
    }
}

/// What a curve file holds.
#[derive(Debug, Serialize, Deserialize)]
struct CurveFile {
    key: CurveKey,
    /// Seconds since the Unix epoch.
    measured_at: u64,
    curve: CostCurve,
    /// The runs behind the curve (absent in older files: complete).
    #[serde(default)]
    samples: Option<Samples>,
}

/// One model's curve file.
#[derive(Debug, Clone)]
pub struct CurveStore {
    pub path: PathBuf,
    pub key: CurveKey,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl CurveStore {
    /// The file for `key` in [`cost_dir`].
    pub fn new(key: CurveKey) -> Self {
        Self::in_dir(&cost_dir(), key)
    }

    pub fn in_dir(dir: &Path, key: CurveKey) -> Self {
        CurveStore {
            path: dir.join(format!("{}.json", key.hash())),
            key,
        }
    }

    /// The stored curve, when there is one of this key, fresh and well-formed, with its runs.
    pub fn load(&self) -> Option<(CostCurve, Option<Samples>)> {
        let text = std::fs::read_to_string(&self.path).ok()?;
        let file: CurveFile = serde_json::from_str(&text).ok()?;
        let age = now().saturating_sub(file.measured_at);
        (file.key == self.key && age <= MAX_AGE_DAYS * 86_400 && file.curve.check().is_ok())
            .then_some((file.curve, file.samples))
    }

    /// Writes `curve` and its runs (a temporary file renamed over the old one, so a reader never sees
    /// half a file).
    pub fn save(&self, curve: &CostCurve, samples: Option<&Samples>) -> Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let file = CurveFile {
            key: self.key.clone(),
            measured_at: now(),
            curve: curve.clone(),
            samples: samples.cloned(),
        };
        let tmp = self
            .path
            .with_extension(format!("json.{}.tmp", std::process::id()));
        std::fs::write(&tmp, serde_json::to_string_pretty(&file)? + "\n")
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            anyhow::anyhow!("cannot write {}: {e}", self.path.display())
        })
    }

    /// The stored curve, or a new measurement of `model` within [`FIRST_TIMING_BUDGET`] (continuing the
    /// stored one when its budget left it short), saved, with the seconds the timing took. A failed save
    /// is otherwise ignored: the curve is still good for this process. On a terminal a line says where
    /// the pause came from.
    pub fn load_or_measure(&self, model: &Transformer) -> Result<(CostCurve, Option<f64>)> {
        let prior = match self.load() {
            Some((c, None)) => return Ok((c, None)),
            Some((c, Some(s))) if s.complete() => return Ok((c, None)),
            Some((_, s)) => s,
            None => None,
        };
        let t = Instant::now();
        let (curve, samples) = CostCurve::measure_within(model, Some(FIRST_TIMING_BUDGET), prior.as_ref())?;
        let secs = t.elapsed().as_secs_f64();
        let saved = self.save(&curve, Some(&samples));
        if std::io::stderr().is_terminal() {
            match saved {
                Ok(()) => eprintln!(
                    "probespec: timed the forward cost curve for --bc auto in {secs:.1} s, saved to {}",
                    self.path.display()
                ),
                Err(e) => eprintln!(
                    "probespec: timed the forward cost curve for --bc auto in {secs:.1} s (not saved: {e:#})"
                ),
            }
        }
        Ok((curve, Some(secs)))
    }
}

/// Per loaded model (by [`Transformer::id`]): its curve once known, and its file.
#[derive(Default)]
struct Entry {
    curve: Option<Arc<CostCurve>>,
    store: Option<CurveStore>,
    /// Seconds the curve took to time in this process, until [`take_timing`] reports them.
    timed: Option<f64>,
}

fn registry() -> &'static Mutex<HashMap<u64, Entry>> {
    static REGISTRY: OnceLock<Mutex<HashMap<u64, Entry>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Gives `model` a curve file: its first [`curve_for`] reads it, or measures and writes it.
pub fn attach(model: &Transformer, store: CurveStore) {
    let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
    r.entry(model.id).or_default().store = Some(store);
}

/// Sets the curve `model` is priced with in this process (nothing is measured or written).
pub fn inject(model: &Transformer, curve: CostCurve) {
    let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
    r.entry(model.id).or_default().curve = Some(Arc::new(curve));
}

/// The curve of `model`: injected, read from its file, or measured (once per process and model).
pub fn curve_for(model: &Transformer) -> Result<Arc<CostCurve>> {
    // Held while measuring: two drafters of one model never time it twice.
    let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
    let entry = r.entry(model.id).or_default();
    if let Some(c) = &entry.curve {
        return Ok(c.clone());
    }
    let (curve, timed) = match &entry.store {
        Some(store) => store.load_or_measure(model)?,
        None => {
            let t = Instant::now();
            let (curve, _) = CostCurve::measure_within(model, Some(FIRST_TIMING_BUDGET), None)?;
            (curve, Some(t.elapsed().as_secs_f64()))
        }
    };
    let curve = Arc::new(curve);
    entry.curve = Some(curve.clone());
    entry.timed = timed;
    Ok(curve)
}

/// The seconds [`curve_for`] spent timing `model`'s curve since the last call, if it timed one: the
/// decoding statistics of the generation that paid for it say so.
pub fn take_timing(model: &Transformer) -> Option<f64> {
    let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
    r.get_mut(&model.id).and_then(|e| e.timed.take())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> CurveKey {
        CurveKey::new("no/such-model", "cpu", "f32", "q8")
    }

    #[test]
    fn a_saved_curve_is_read_back_and_a_bad_file_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = CurveStore::in_dir(&dir.path().join("cost"), key());
        assert!(store.load().is_none(), "nothing saved yet");
        // Binary fractions: they survive the trip through decimal text exactly.
        let curve = CostCurve::from_fn(|c, r| r as f64 / 1024.0 + c as f64 / 65536.0, 0.125);
        store.save(&curve, None).unwrap();
        assert_eq!(store.load(), Some((curve.clone(), None)));
        // The runs behind a curve come back with it.
        let samples = Samples {
            contexts: vec![64],
            rows: vec![1, 2],
            points: vec![vec![vec![0.5], vec![0.75, 1.0]]],
            extra: vec![0.25],
        };
        assert!(!samples.complete());
        store.save(&curve, Some(&samples)).unwrap();
        assert_eq!(store.load(), Some((curve.clone(), Some(samples))));
        // No temporary file is left behind.
        assert_eq!(
            std::fs::read_dir(store.path.parent().unwrap()).unwrap().count(),
            1
        );
        // Another key (another dtype) has its own file.
        let other = CurveStore::in_dir(
            &dir.path().join("cost"),
            CurveKey::new("no/such-model", "cpu", "bf16", "q8"),
        );
        assert_ne!(other.path, store.path);
        assert!(other.load().is_none());
        // Stale: too old, or written for another key under the same name.
        let mut file: CurveFile =
            serde_json::from_str(&std::fs::read_to_string(&store.path).unwrap()).unwrap();
        file.measured_at -= (MAX_AGE_DAYS + 1) * 86_400;
        std::fs::write(&store.path, serde_json::to_string(&file).unwrap()).unwrap();
        assert!(store.load().is_none(), "older than {MAX_AGE_DAYS} days");
        file.measured_at = now();
        file.key.threads += 1;
        std::fs::write(&store.path, serde_json::to_string(&file).unwrap()).unwrap();
        assert!(store.load().is_none(), "another key");
        // Corrupt and malformed files read as absent.
        std::fs::write(&store.path, "{not json").unwrap();
        assert!(store.load().is_none());
        file.key = key();
        file.curve.seconds[0].pop();
        std::fs::write(&store.path, serde_json::to_string(&file).unwrap()).unwrap();
        assert!(store.load().is_none());
        // An unwritable place is an error of `save` alone.
        let blocked = CurveStore::in_dir(&store.path.join("sub"), key());
        assert!(blocked.save(&curve, None).is_err());
        assert!(blocked.load().is_none());
    }

    #[test]
    fn keys_name_their_parts() {
        let k = key();
        assert_eq!(k.format, CURVE_FORMAT);
        assert!(k.build.contains(env!("CARGO_PKG_VERSION")), "{}", k.build);
        assert_eq!(k.model, "no/such-model");
        assert!(k.threads >= 1);
        // The hash is a function of the key alone.
        assert_eq!(k.hash(), key().hash());
    }
}
