//! GGUF files: the model's shape from the metadata, each tensor dequantised, repacked for the CPU
//! kernels or handed to candle's quantised matmul (`GgufMatrix`), and the tensors' placement checked
//! against the file before anything is read.

use super::checkpoint::{check_vocab, Activations, LoadOptions, LoadedModel};
use super::{Arch, Layer, Linear, ModelConfig, RmsNorm, Transformer, Weight};
use crate::kernels::{BlockFormat, BlockMatrix, PackedFormat, PackedMatrix};
use crate::tokenizer::TextTokenizer;
use anyhow::{bail, Context, Result};
use candle_core::quantized::{ggml_file as gguf_ggml, gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use std::path::Path;
use std::sync::Arc;

/// Models up to this many parameters are dequantised to dense weights on the CPU (about 4 GiB in f32).
const DENSE_CPU_MAX_PARAMS: usize = 1 << 30;

/// How a GGUF matrix is multiplied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GgufMatrix {
    /// Dequantised once at load (float formats; small models in formats without a block kernel).
    Dense,
    /// Kept in its blocks for the row-invariant CPU block kernel with f32 activations (Q4_0, Q4_1, Q8_0 on
    /// the CPU with `Activations::F32`): the same numbers as `Dense`, 4-7x fewer bytes read per token.
    Blocks(BlockFormat),
    /// Repacked for the row-invariant CPU kernel with 8-bit activations (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
    /// Q6_K on the CPU with `Activations::Q8`).
    Packed(PackedFormat),
    /// candle's quantised matmul: every format on a GPU, large models in other formats on the CPU.
    /// (On the CPU it quantises activations to 8 bits, computing each row alone.)
    Candle,
}

fn gguf_matrix(t: GgmlDType, device: &Device, params: usize, opts: &LoadOptions) -> GgufMatrix {
    match t {
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => GgufMatrix::Dense,
        _ if opts.dequantize => GgufMatrix::Dense,
        // The row-invariant CUDA kernels take dense weights: quantised ones are dequantised to the dtype.
        _ if !device.is_cpu()
            && super::Ops::for_model(device, opts.dtype).is_ok_and(|o| o == super::Ops::Exact) =>
        {
            GgufMatrix::Dense
        }
        // As on a GPU when the CPU is asked to take a GPU device's path (`PROBESPEC_OPS=candle`).
        _ if !device.is_cpu() || super::Ops::candle_forced() => GgufMatrix::Candle,
        _ => match (
            opts.activations,
            BlockFormat::of_ggml(t),
            PackedFormat::of_ggml(t),
        ) {
            (Activations::Q8, _, Some(f)) => GgufMatrix::Packed(f),
            (Activations::F32, Some(f), _) => GgufMatrix::Blocks(f),
            _ if params <= DENSE_CPU_MAX_PARAMS => GgufMatrix::Dense,
            _ => GgufMatrix::Candle,
        },
    }
}

pub(super) fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    if gguf_alignment(&mut file)? == Some(0) {
        bail!(
            "{} is not a readable GGUF file: general.alignment is 0",
            path.display()
        );
    }
    // Buffered: the header holds the tokenizer, a few hundred thousand short strings that candle's reader
    // takes one small read at a time (on a 128K vocabulary, half a second of system calls unbuffered).
    let ct = gguf_file::Content::read(&mut std::io::BufReader::with_capacity(1 << 20, &mut file))
        .map_err(|e| anyhow::anyhow!("{} is not a readable GGUF file: {e}", path.display()))?;
    let file_len = file.metadata()?.len();
    for (name, info) in &ct.tensor_infos {
        let Some(end) = tensor_end(ct.tensor_data_offset, info) else {
            bail!(
                "{} is corrupt: tensor {name} has an impossible size",
                path.display()
            );
        };
        if end > file_len {
            bail!(
                "{} is truncated: tensor {name} ends at byte {end} but the file has {file_len} bytes",
                path.display()
            );
        }
    }
    let config = gguf_config(&ct).with_context(|| format!("{} is not a usable model", path.display()))?;
    let tokenizer =
        TextTokenizer::from_gguf(&ct.metadata).with_context(|| format!("tokenizer of {}", path.display()))?;
    let data = TensorData::open(file);
    let model =
        build_from_gguf(&ct, config, &data, opts).with_context(|| format!("loading {}", path.display()))?;
    check_vocab(&model, &tokenizer)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        description: path.display().to_string(),
    })
}

/// Where the tensors' bytes come from: the file mapped into memory, so that a tensor is read in place by
/// whatever keeps it (repacking, dequantising, or candle's copy), or read into a buffer where the file
/// cannot be mapped. candle's own reader reads each tensor into one buffer and copies it into a second:
/// on a 1B model that is 1.6 GB of freshly zeroed pages, most of the loading time.
enum TensorData {
    Mapped(memmap2::Mmap),
    Read(std::cell::RefCell<std::fs::File>),
}

/// One GGUF tensor as stored: its name, type, dims (outermost first) and bytes. Mapped bytes are
/// released from the process when it is dropped (see [`TensorData::release`]): by then whatever keeps
/// the tensor has its own copy, so the peak memory is the model's own weights plus one tensor, not also
/// the whole file.
struct RawTensor<'a> {
    name: String,
    dtype: GgmlDType,
    dims: Vec<usize>,
    bytes: std::borrow::Cow<'a, [u8]>,
    /// The mapping `bytes` borrow from, if any.
    map: Option<&'a memmap2::Mmap>,
}

impl Drop for RawTensor<'_> {
    fn drop(&mut self) {
        if let (Some(map), std::borrow::Cow::Borrowed(b)) = (self.map, &self.bytes) {
            TensorData::release(map, b);
        }
    }
}

impl RawTensor<'_> {
    fn qtensor(&self, dev: &Device) -> Result<QTensor> {
        // candle reads the bytes as its block type (f32 and f16 values, blocks with f16 heads) in place:
        // a mapped tensor at an offset the file's alignment leaves odd is copied to an allocation first.
        let aligned;
        let bytes = if (self.bytes.as_ptr() as usize).is_multiple_of(8) {
            &self.bytes[..]
        } else {
            aligned = self.bytes.to_vec();
            &aligned[..]
        };
        gguf_ggml::qtensor_from_ggml(self.dtype, bytes, self.dims.clone(), dev)
            .map_err(|e| anyhow::anyhow!("tensor {}: {e}", self.name))
    }
}

impl TensorData {
    fn open(file: std::fs::File) -> Self {
        // SAFETY: the mapping is read only and lives only while the model is built; every tensor's
        // extent was checked against the file's length. A file truncated by another process meanwhile
        // would fault (as it would for llama.cpp, which maps GGUF files the same way).
        match unsafe { memmap2::Mmap::map(&file) } {
            Ok(map) => {
                let _ = map.advise(memmap2::Advice::Sequential);
                TensorData::Mapped(map)
            }
            Err(_) => TensorData::Read(std::cell::RefCell::new(file)),
        }
    }

    /// Tensor `name`'s bytes (its extent is checked in `load_gguf`).
    fn tensor<'a>(&'a self, ct: &gguf_file::Content, name: &str) -> Result<RawTensor<'a>> {
        let info = ct
            .tensor_infos
            .get(name)
            .with_context(|| format!("tensor {name} is missing"))?;
        let start = (ct.tensor_data_offset + info.offset) as usize;
        let len = tensor_end(ct.tensor_data_offset, info).context("impossible size")? as usize - start;
        let (bytes, map) = match self {
            TensorData::Mapped(map) => (std::borrow::Cow::Borrowed(&map[start..start + len]), Some(map)),
            TensorData::Read(file) => {
                use std::io::{Read, Seek, SeekFrom};
                let mut file = file.borrow_mut();
                let mut buf = vec![0u8; len];
                file.seek(SeekFrom::Start(start as u64))?;
                file.read_exact(&mut buf)
                    .with_context(|| format!("reading tensor {name}"))?;
                (std::borrow::Cow::Owned(buf), None)
            }
        };
        Ok(RawTensor {
            name: name.to_string(),
            dtype: info.ggml_dtype,
            dims: info.shape.dims().to_vec(),
            bytes,
            map,
        })
    }

    /// Drops the mapped pages of `bytes` (a range of `map`) from the process.
    fn release(map: &memmap2::Mmap, bytes: &[u8]) {
        let offset = bytes.as_ptr() as usize - map.as_ptr() as usize;
        // SAFETY: the pages are a read-only file mapping; touching them again would read the file anew,
        // and nothing does: the one tensor borrowing them is being dropped.
        unsafe {
            let _ = map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, bytes.len());
        }
    }
}

fn build_from_gguf(
    ct: &gguf_file::Content,
    config: ModelConfig,
    data: &TensorData,
    opts: &LoadOptions,
) -> Result<Transformer> {
    let dev = &opts.device;
    let params: usize = ct.tensor_infos.values().map(|i| i.shape.elem_count()).sum();
    let read = |name: &str| -> Result<RawTensor> { data.tensor(ct, name) };
    let c = &config;
    let dense =
        |t: &RawTensor| -> Result<Tensor> { Ok(t.qtensor(dev)?.dequantize(dev)?.to_dtype(opts.dtype)?) };
    // llama.cpp's converter interleaves the two RoPE halves of every LLaMA q/k head;
    // reorder them so one RoPE convention serves every format: dense, block and packed weights get
    // their rows reordered, candle-quantised ones their outputs.
    let linear_rows = |t: RawTensor, rows: Option<Vec<u32>>| -> Result<Linear> {
        let linear = match gguf_matrix(t.dtype, dev, params, opts) {
            GgufMatrix::Dense => {
                let w = dense(&t)?;
                let w = match rows {
                    Some(r) => w.index_select(&Tensor::new(r.as_slice(), dev)?, 0)?,
                    None => w,
                };
                Linear::new(Weight::Dense(w), None)
            }
            GgufMatrix::Blocks(f) => {
                let [n, k] = t.dims[..] else {
                    bail!("tensor {} is not a matrix", t.name)
                };
                let b = BlockMatrix::new(f, n, k, t.bytes.to_vec())?;
                let b = match rows {
                    Some(r) => b.select_rows(&r),
                    None => b,
                };
                Linear::new(Weight::Blocks(b), None)
            }
            GgufMatrix::Packed(f) => {
                let [n, k] = t.dims[..] else {
                    bail!("tensor {} is not a matrix", t.name)
                };
                let p = PackedMatrix::from_gguf(f, n, k, &t.bytes, rows.as_deref())?;
                Linear::new(Weight::Packed(Arc::new(p)), None)
            }
            GgufMatrix::Candle => {
                let q = t.qtensor(dev)?;
                let l = Linear::new(Weight::Quantized(QMatMul::from_arc(Arc::new(q))?), None);
                match rows {
                    Some(r) => l.with_out_perm(Tensor::new(r.as_slice(), dev)?),
                    None => l,
                }
            }
        };
        Ok(linear)
    };
    let linear = |t: RawTensor| linear_rows(t, None);
    let rope_linear = |t: RawTensor, heads: usize| -> Result<Linear> {
        let rows = (c.arch == Arch::Llama).then(|| unpermute_index(heads, c.head_dim));
        linear_rows(t, rows)
    };
    let norm = |t: RawTensor| -> Result<RmsNorm> { Ok(RmsNorm::new(dense(&t)?, c.rms_norm_eps)) };
    // The table stays packed where the output projection reads it so (and is shared with it when
    // tied).
    let (embed, tied_head) = {
        let t = read("token_embd.weight")?;
        match gguf_matrix(t.dtype, dev, params, opts) {
            GgufMatrix::Packed(f) => {
                let [n, k] = t.dims[..] else {
                    bail!("tensor {} is not a matrix", t.name)
                };
                let matrix = Arc::new(PackedMatrix::from_gguf(f, n, k, &t.bytes, None)?);
                let head = Linear::new(Weight::Packed(matrix.clone()), None);
                let embed = super::Embeddings::Packed {
                    matrix,
                    dtype: opts.dtype,
                };
                (embed, config.tie_word_embeddings.then_some(head))
            }
            _ => {
                let embed = super::Embeddings::Dense(dense(&t)?);
                (embed, config.tie_word_embeddings.then(|| linear(t)).transpose()?)
            }
        }
    };
    let mut layers = Vec::with_capacity(c.num_layers);
    for i in 0..c.num_layers {
        let p = format!("blk.{i}");
        let (q_norm, k_norm) = if c.qk_norm() {
            (
                Some(norm(read(&format!("{p}.attn_q_norm.weight"))?)?),
                Some(norm(read(&format!("{p}.attn_k_norm.weight"))?)?),
            )
        } else {
            (None, None)
        };
        layers.push(Layer {
            attn_norm: norm(read(&format!("{p}.attn_norm.weight"))?)?,
            q_proj: rope_linear(read(&format!("{p}.attn_q.weight"))?, c.num_heads)?,
            k_proj: rope_linear(read(&format!("{p}.attn_k.weight"))?, c.num_kv_heads)?,
            v_proj: linear(read(&format!("{p}.attn_v.weight"))?)?,
            o_proj: linear(read(&format!("{p}.attn_output.weight"))?)?,
            q_norm,
            k_norm,
            mlp_norm: norm(read(&format!("{p}.ffn_norm.weight"))?)?,
            gate_proj: linear(read(&format!("{p}.ffn_gate.weight"))?)?,
            up_proj: linear(read(&format!("{p}.ffn_up.weight"))?)?,
            down_proj: linear(read(&format!("{p}.ffn_down.weight"))?)?,
        });
    }
    let final_norm = norm(read("output_norm.weight")?)?;
    let lm_head = match tied_head {
        Some(head) => head,
        None => linear(read("output.weight")?)?,
    };
    let rope_factors = if ct.tensor_infos.contains_key("rope_freqs.weight") {
        let t = read("rope_freqs.weight")?;
        Some(
            t.qtensor(dev)?
                .dequantize(dev)?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?,
        )
    } else {
        None
    };
    Transformer::new(config, embed, layers, final_norm, lm_head, rope_factors)
}

/// The integer `general.alignment` of a GGUF file, read ahead of candle's reader, which divides by it
/// (and panics when it is 0). `None` when the key is absent, not an integer candle reads, or the header
/// is unreadable (candle then reports what is wrong). Leaves the file at its start.
fn gguf_alignment(file: &mut std::fs::File) -> Result<Option<u64>> {
    use std::io::{BufReader, Read, Seek, SeekFrom};
    struct Scan<'a> {
        r: BufReader<&'a mut std::fs::File>,
        pos: u64,
        len: u64,
        /// Lengths are u64 from version 2 on, u32 before.
        wide: bool,
    }
    impl Scan<'_> {
        fn int(&mut self, bytes: usize) -> std::io::Result<u64> {
            let mut b = [0u8; 8];
            self.r.read_exact(&mut b[..bytes])?;
            self.pos += bytes as u64;
            Ok(u64::from_le_bytes(b))
        }
        fn length(&mut self) -> std::io::Result<u64> {
            self.int(if self.wide { 8 } else { 4 })
        }
        /// Skips `n` bytes; false when that passes the end of the file.
        fn skip_bytes(&mut self, n: u64) -> std::io::Result<bool> {
            if n > self.len.saturating_sub(self.pos) {
                return Ok(false);
            }
            self.r.seek_relative(n as i64)?;
            self.pos += n;
            Ok(true)
        }
        /// Skips a value of GGUF type `ty`; false when it cannot.
        fn skip(&mut self, ty: u64, depth: usize) -> std::io::Result<bool> {
            let size = match ty {
                0 | 1 | 7 => 1,
                2 | 3 => 2,
                4..=6 => 4,
                10..=12 => 8,
                8 => self.length()?,
                9 if depth < 4 => {
                    let elem = self.int(4)?;
                    for _ in 0..self.length()? {
                        if !self.skip(elem, depth + 1)? {
                            return Ok(false);
                        }
                    }
                    0
                }
                _ => return Ok(false),
            };
            self.skip_bytes(size)
        }
        fn alignment(&mut self) -> std::io::Result<Option<u64>> {
            if self.int(4)? != 0x4655_4747 {
                return Ok(None);
            }
            self.wide = self.int(4)? >= 2;
            let _tensors = self.length()?;
            for _ in 0..self.length()? {
                let key_len = self.length()?;
                if key_len > self.len.saturating_sub(self.pos) {
                    return Ok(None);
                }
                let mut key = vec![0u8; key_len as usize];
                self.r.read_exact(&mut key)?;
                self.pos += key_len;
                let ty = self.int(4)?;
                if key == b"general.alignment" {
                    // The integer types candle takes the alignment from: u8, i8, u16, i16, u32, i32.
                    return Ok(match ty {
                        0..=5 => Some(self.int([1, 1, 2, 2, 4, 4][ty as usize])?),
                        _ => None,
                    });
                }
                if !self.skip(ty, 0)? {
                    return Ok(None);
                }
            }
            Ok(None)
        }
    }
    let len = file.metadata()?.len();
    let found = Scan {
        r: BufReader::new(&mut *file),
        pos: 0,
        len,
        wide: true,
    }
    .alignment()
    .unwrap_or(None);
    file.seek(SeekFrom::Start(0))?;
    Ok(found)
}

/// The byte where a GGUF tensor's data ends, `None` when its declared size overflows.
fn tensor_end(data_offset: u64, info: &gguf_file::TensorInfo) -> Option<u64> {
    let elems = info
        .shape
        .dims()
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))?;
    let bytes =
        (elems / info.ggml_dtype.block_size() as u64).checked_mul(info.ggml_dtype.type_size() as u64)?;
    data_offset.checked_add(info.offset)?.checked_add(bytes)
}

/// The model's config from the GGUF metadata, once every tensor the model reads is checked to have the
/// shape that config implies (before anything is read, reordered or reshaped).
fn gguf_config(ct: &gguf_file::Content) -> Result<ModelConfig> {
    let dims = |name: &str| -> Result<&[usize]> {
        Ok(ct
            .tensor_infos
            .get(name)
            .with_context(|| format!("tensor {name} is missing"))?
            .shape
            .dims())
    };
    let &[vocab, _] = dims("token_embd.weight")? else {
        bail!(
            "tensor token_embd.weight has shape {:?}, expected two dimensions",
            dims("token_embd.weight")?
        );
    };
    let tied = !ct.tensor_infos.contains_key("output.weight");
    let c = ModelConfig::from_gguf(&ct.metadata, vocab, tied)?;
    let (d, hd, ff) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (q_rows, kv_rows) = (c.num_heads * hd, c.num_kv_heads * hd);
    let mut want: Vec<(String, Vec<usize>)> = vec![
        ("token_embd.weight".into(), vec![vocab, d]),
        ("output_norm.weight".into(), vec![d]),
    ];
    if !tied {
        want.push(("output.weight".into(), vec![vocab, d]));
    }
    if ct.tensor_infos.contains_key("rope_freqs.weight") {
        want.push(("rope_freqs.weight".into(), vec![hd / 2]));
    }
    for i in 0..c.num_layers {
        let mut layer = vec![
            ("attn_norm", vec![d]),
            ("ffn_norm", vec![d]),
            ("attn_q", vec![q_rows, d]),
            ("attn_k", vec![kv_rows, d]),
            ("attn_v", vec![kv_rows, d]),
            ("attn_output", vec![d, q_rows]),
            ("ffn_gate", vec![ff, d]),
            ("ffn_up", vec![ff, d]),
            ("ffn_down", vec![d, ff]),
        ];
        if c.qk_norm() {
            layer.extend([("attn_q_norm", vec![hd]), ("attn_k_norm", vec![hd])]);
        }
        want.extend(
            layer
                .into_iter()
                .map(|(name, shape)| (format!("blk.{i}.{name}.weight"), shape)),
        );
    }
    for (name, shape) in want {
        let got = dims(&name)?;
        if got != shape.as_slice() {
            bail!("tensor {name} has shape {got:?}, but the metadata implies {shape:?}");
        }
    }
    Ok(c)
}

/// Row order that turns llama.cpp's interleaved q/k rows back into Hugging Face order:
/// HF row (h, j, i) = GGUF row (h, i, j) for head h, half j in {0, 1}, pair index i.
pub fn unpermute_index(heads: usize, head_dim: usize) -> Vec<u32> {
    let half = head_dim / 2;
    let mut idx = Vec::with_capacity(heads * head_dim);
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..half {
                idx.push((h * head_dim + 2 * i + j) as u32);
            }
        }
    }
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapped file and a read one give every tensor the same bytes, and dropping a mapped tensor (which
    /// releases its pages) leaves the file readable (the next read maps them in again).
    #[test]
    fn mapped_and_read_tensors_are_the_same_bytes() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 64.0 * 32.0, &dev)?.reshape((64, 32))?;
        let b = Tensor::arange(0f32, 3.0 * 256.0, &dev)?
            .reshape((3, 256))?
            .affine(0.01, -1.0)?;
        let qa = QTensor::quantize(&a, GgmlDType::Q4_0)?;
        let qb = QTensor::quantize(&b, GgmlDType::Q6K)?;
        let path = std::env::temp_dir().join(format!("probespec-mapped-{}.gguf", std::process::id()));
        gguf_file::write(&mut std::fs::File::create(&path)?, &[], &[("a", &qa), ("b", &qb)])?;
        let mut file = std::fs::File::open(&path)?;
        let ct = gguf_file::Content::read(&mut file)?;
        let mapped = TensorData::open(std::fs::File::open(&path)?);
        assert!(matches!(mapped, TensorData::Mapped(_)));
        let read = TensorData::Read(std::cell::RefCell::new(file));
        for (name, q) in [("a", &qa), ("b", &qb)] {
            let m = mapped.tensor(&ct, name)?;
            let r = read.tensor(&ct, name)?;
            assert_eq!((m.dtype, &m.dims), (q.dtype(), &q.shape().dims().to_vec()));
            assert_eq!((r.dtype, &r.dims), (m.dtype, &m.dims));
            assert_eq!(m.bytes, q.data()?, "{name}: mapped bytes");
            assert_eq!(r.bytes, q.data()?, "{name}: read bytes");
            drop(m);
            assert_eq!(
                mapped.tensor(&ct, name)?.bytes,
                q.data()?,
                "{name}: after release"
            );
        }
        std::fs::remove_file(&path)?;
        Ok(())
    }

    /// A mapped tensor at an odd offset (a file whose alignment allows it) reads the same values: candle
    /// takes the bytes as f32 in place, which needs them aligned (a debug build checks it).
    #[test]
    fn a_misaligned_tensor_reads_its_values() -> Result<()> {
        let values = [1.5f32, -2.0, 3.25, 0.0];
        let mut file = vec![0u8; 1 + 4 * values.len()];
        for (at, v) in file[1..].chunks_exact_mut(4).zip(values) {
            at.copy_from_slice(&v.to_le_bytes());
        }
        let t = RawTensor {
            name: "x".into(),
            dtype: GgmlDType::F32,
            dims: vec![values.len()],
            bytes: std::borrow::Cow::Borrowed(&file[1..]),
            map: None,
        };
        let read = t
            .qtensor(&Device::Cpu)?
            .dequantize(&Device::Cpu)?
            .to_vec1::<f32>()?;
        assert_eq!(read, values);
        Ok(())
    }
}
