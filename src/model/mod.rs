//! The transformer forward pass shared by every decoding strategy.
//!
//! `forward(block embeddings, positions, mask, KV cache) -> hidden states`, then `logits(hidden, rows)`.
//! Unlike candle-transformers' stock models this takes explicit position ids, an arbitrary additive
//! attention mask over [cache + block], raw embedding vectors as inputs (ESP's mask tokens are vectors),
//! and computes logits only for the rows a caller reads. LLaMA and Qwen 3 are one model with switches.

mod batch;
pub mod checkpoint;
pub mod config;
mod flat;
pub mod gguf;
pub mod kv_cache;
pub mod linear;
pub mod load;
pub mod ops;
mod safetensors;
pub mod shape_gguf;
pub mod synthetic;

pub use batch::SequenceBlock;
pub use config::{Arch, ModelConfig};
pub use kv_cache::KvCache;
pub use linear::{Linear, Weight};
pub use load::{load_model, LoadedModel, ModelSource};
pub use ops::Ops;

use crate::kernels::PackedMatrix;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// Bytes of a product's weights the pool's worker is asked to prefetch while the caller works alone.
const HINT_BYTES: usize = 128 << 10;

pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
    /// The weight's values when it is an f32 vector on the CPU: what the layers on flat buffers read.
    values: Option<Vec<f32>>,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        let cpu_f32 = weight.device().is_cpu() && weight.dtype() == DType::F32 && weight.rank() == 1;
        RmsNorm {
            values: cpu_f32.then(|| weight.to_vec1().ok()).flatten(),
            weight,
            eps: eps as f32,
        }
    }

    /// Each row of `xs` (rows of the weight's length) normalised into `out`, as [`RmsNorm::forward`]
    /// with the kernels computes it; `None` when the weight is not an f32 vector on the CPU.
    pub fn rows_into(&self, xs: &[f32], out: &mut Vec<f32>) -> Option<()> {
        let w = self.values.as_deref()?;
        out.resize(xs.len(), 0.0);
        crate::kernels::elementwise::rms_norm_slices_with(
            crate::kernels::Width::best(),
            xs,
            w,
            self.eps,
            out,
        );
        Some(())
    }

    /// Normalises over the last dimension, whatever the leading shape: with probespec's kernel when
    /// `kernels` (f32 on the CPU), else candle's op (which also computes each row alone).
    pub fn forward(&self, x: &Tensor, kernels: bool) -> Result<Tensor> {
        if kernels && x.dtype() == DType::F32 && self.weight.dtype() == DType::F32 {
            return Ok(crate::kernels::rms_norm_f32(x, &self.weight, self.eps)?);
        }
        Ok(candle_nn::ops::rms_norm(
            &x.contiguous()?,
            &self.weight,
            self.eps,
        )?)
    }
}

pub struct Layer {
    pub attn_norm: RmsNorm,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// Qwen 3's per-head RMSNorm on queries and keys.
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub mlp_norm: RmsNorm,
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

/// The attention pattern of a block: plain causal (prefill, one-token steps), or an additive mask of shape
/// `[block rows, cached rows + block rows]` with 0 where a row may look and -inf where it may not.
pub enum BlockMask {
    Causal,
    Additive(Tensor),
}

/// The input embedding table: dense, or a GGUF file's packed quantised matrix (shared with a tied
/// output projection), whose rows are dequantised as they are looked up. A dense f32 copy of a 1B
/// model's 128256 x 2048 table alone is 1 GiB, more than the whole Q4_K_M file.
pub enum Embeddings {
    Dense(Tensor),
    Packed {
        matrix: Arc<PackedMatrix>,
        /// The dtype looked-up rows are returned in.
        dtype: DType,
    },
}

impl From<Tensor> for Embeddings {
    fn from(t: Tensor) -> Self {
        Embeddings::Dense(t)
    }
}

impl Embeddings {
    fn device(&self) -> Device {
        match self {
            Embeddings::Dense(t) => t.device().clone(),
            Embeddings::Packed { .. } => Device::Cpu,
        }
    }

    fn dtype(&self) -> DType {
        match self {
            Embeddings::Dense(t) => t.dtype(),
            Embeddings::Packed { dtype, .. } => *dtype,
        }
    }

    /// Rows `ids` (all within the vocabulary): `[ids.len(), hidden]`. Packed rows are the values the
    /// dense table would hold (`PackedMatrix::dequantize_row` is candle's dequantisation).
    fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Embeddings::Dense(t) => Ok(t.index_select(&Tensor::new(ids, t.device())?, 0)?),
            Embeddings::Packed { matrix, dtype } => {
                let d = matrix.dims().1;
                let mut out = vec![0f32; ids.len() * d];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(d)) {
                    matrix.dequantize_row(id as usize, row);
                }
                Ok(Tensor::from_vec(out, (ids.len(), d), &Device::Cpu)?.to_dtype(*dtype)?)
            }
        }
    }

    /// The whole table, dense (a temporary copy for a packed one).
    pub fn table(&self) -> Result<Tensor> {
        match self {
            Embeddings::Dense(t) => Ok(t.clone()),
            Embeddings::Packed { matrix, dtype } => {
                Ok(Tensor::from_vec(matrix.dequantize(), matrix.dims(), &Device::Cpu)?.to_dtype(*dtype)?)
            }
        }
    }
}

pub struct Transformer {
    pub config: ModelConfig,
    pub embed_tokens: Embeddings,
    pub layers: Vec<Layer>,
    pub norm: RmsNorm,
    pub lm_head: Linear,
    /// RoPE tables `[max positions, head_dim / 2]`, gathered by position id per block.
    cos: Tensor,
    sin: Tensor,
    pub device: Device,
    pub dtype: DType,
    /// Which code computes the layers (see [`Ops`]); set before making caches ([`Transformer::with_ops`]).
    ops: Ops,
    /// What the CPU kernels' KV cache holds ([`Transformer::with_kv_dtype`]).
    kv_dtype: DType,
    /// Unique per constructed model in this process: what caches of per-model measurements are keyed by.
    pub id: u64,
}

impl Transformer {
    pub fn new(
        config: ModelConfig,
        embed_tokens: Embeddings,
        layers: Vec<Layer>,
        norm: RmsNorm,
        lm_head: Linear,
        rope_freq_factors: Option<Vec<f32>>,
    ) -> Result<Self> {
        let device = embed_tokens.device();
        let dtype = embed_tokens.dtype();
        let mut inv_freq = config.rope_inv_freq();
        if let Some(f) = rope_freq_factors {
            if f.len() != inv_freq.len() {
                bail!("rope_freqs has {} entries, expected {}", f.len(), inv_freq.len());
            }
            inv_freq.iter_mut().zip(f).for_each(|(x, f)| *x /= f);
        }
        let n = config.max_position_embeddings;
        let half = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), &device)?;
        let t = Tensor::arange(0u32, n as u32, &device)?
            .to_dtype(DType::F32)?
            .reshape((n, 1))?;
        let freqs = t.matmul(&inv_freq)?;
        let ops = Ops::for_model(&device, dtype)?;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(Transformer {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            cos: freqs.cos()?.to_dtype(dtype)?,
            sin: freqs.sin()?.to_dtype(dtype)?,
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            device,
            dtype,
            ops,
            kv_dtype: DEFAULT_KV_DTYPE,
        })
    }

    /// The model computed by `ops` instead (an error where they cannot run); caches made before do not
    /// fit it.
    pub fn with_ops(mut self, ops: Ops) -> Result<Self> {
        ops.check(&self.device, self.dtype)?;
        self.ops = ops;
        Ok(self)
    }

    pub fn ops(&self) -> Ops {
        self.ops
    }

    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let c = &self.config;
        KvCache::new(
            c.num_layers,
            capacity,
            c.num_kv_heads,
            c.head_dim,
            self.cache_dtype(),
            &self.device,
            self.cpu_kernels(),
        )
    }

    /// The cache's dtype: the model's, except for the CPU kernels ([`Transformer::with_kv_dtype`]) and
    /// the row-invariant products in f16 / bf16, which read the keys and values as f32 (the same values,
    /// converted once when written).
    fn cache_dtype(&self) -> DType {
        match self.ops {
            Ops::Kernels => self.kv_dtype,
            Ops::Exact if self.device.is_cpu() => DType::F32,
            _ => self.dtype,
        }
    }

    /// Whether a row's hidden states do not depend on the rows beside it in a block (probespec's kernels,
    /// not candle's ops): a prompt prefilled in parts, or decoded beside other sequences, gives the bits
    /// it gets alone.
    pub fn row_invariant(&self) -> bool {
        self.ops.row_invariant()
    }

    /// Bytes one row (position) of a KV cache takes: keys and values of every layer.
    pub fn kv_bytes_per_row(&self) -> usize {
        let c = &self.config;
        2 * c.num_layers * c.num_kv_heads * c.head_dim * self.cache_dtype().size_in_bytes()
    }

    /// Keys and values cached in `dtype` (f32 or bf16) by the CPU kernels, which an f32 model on the CPU
    /// runs (other ops keep their own cache: the model's dtype, or f32 for `--dtype f16/bf16` on the
    /// CPU). Caches made before do not change.
    pub fn with_kv_dtype(mut self, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            bail!("the KV cache holds f32 or bf16, not {}", dtype.as_str());
        }
        self.kv_dtype = dtype;
        Ok(self)
    }

    /// What the KV cache holds: [`Transformer::with_kv_dtype`]'s under the CPU kernels, else the
    /// cache's own dtype.
    pub fn kv_dtype(&self) -> DType {
        self.cache_dtype()
    }

    /// Whether the layer runs probespec's own CPU kernels (f32 on the CPU: row-invariant, so a block
    /// verifies exactly what plain decoding computes) rather than candle's ops.
    fn cpu_kernels(&self) -> bool {
        self.ops == Ops::Kernels
    }

    /// Input embeddings of `ids`: `[ids.len(), hidden]`.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let vocab = self.config.vocab_size as u32;
        if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
            bail!("token id {bad} is outside the model's vocabulary of {vocab}");
        }
        self.embed_tokens.rows(ids)
    }

    /// Runs a block of `x.dim(0)` rows (`x`: `[rows, hidden]` input embeddings) at `positions`, appending
    /// the block's keys and values to `cache`. Returns final-norm hidden states `[rows, hidden]`. One
    /// sequence's [`Transformer::forward_batch`].
    pub fn forward(
        &self,
        x: &Tensor,
        positions: &[u32],
        mask: &BlockMask,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let mut block = [SequenceBlock {
            x,
            positions,
            mask,
            cache,
        }];
        let mut hidden = self.forward_batch(&mut block)?;
        Ok(hidden.pop().expect("one block, one output"))
    }

    /// The layers one candle tensor per step: every op and device. (`forward_batch` checked the
    /// positions and the cache's room.)
    fn forward_tensors(
        &self,
        x: &Tensor,
        positions: &[u32],
        mask: &BlockMask,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (cos, sin) = self.rope_rows(positions)?;
        let mut x = x.to_dtype(self.dtype)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = self.layer_forward(layer, i, &x, &cos, &sin, mask, &mut *cache)?;
        }
        Ok(x)
    }

    /// Logits (f32) of the given rows of `hidden`: `[rows.len(), vocab]`.
    pub fn logits(&self, hidden: &Tensor, rows: &[usize]) -> Result<Tensor> {
        let h = if rows.len() == hidden.dim(0)? && rows.iter().enumerate().all(|(i, &r)| i == r) {
            hidden.clone()
        } else {
            let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            hidden.index_select(&Tensor::new(idx.as_slice(), &self.device)?, 0)?
        };
        Ok(self
            .lm_head
            .forward(&h, self.ops.row_invariant())?
            .to_dtype(DType::F32)?)
    }

    fn rope_rows(&self, positions: &[u32]) -> Result<(Tensor, Tensor)> {
        let first = positions[0];
        let contiguous = positions.iter().enumerate().all(|(i, &p)| p == first + i as u32);
        if contiguous {
            let n = positions.len();
            Ok((
                self.cos.narrow(0, first as usize, n)?,
                self.sin.narrow(0, first as usize, n)?,
            ))
        } else {
            let idx = Tensor::new(positions, &self.device)?;
            Ok((self.cos.index_select(&idx, 0)?, self.sin.index_select(&idx, 0)?))
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        l: &Layer,
        layer_idx: usize,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &BlockMask,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let c = &self.config;
        let rows = x.dim(0)?;
        let (kernels, exact) = (self.cpu_kernels(), self.ops.row_invariant());
        l.v_proj.prefetch_hint(HINT_BYTES);
        let h = l.attn_norm.forward(x, kernels)?;
        let [q, k, v] = Linear::forward_many([&l.q_proj, &l.k_proj, &l.v_proj], &h, exact)?;
        l.o_proj.prefetch_hint(HINT_BYTES);
        let q = q.reshape((1, rows, c.num_heads, c.head_dim))?;
        let k = k.reshape((1, rows, c.num_kv_heads, c.head_dim))?;
        let v = v.reshape((1, rows, c.num_kv_heads, c.head_dim))?;
        let q = match &l.q_norm {
            Some(n) => n.forward(&q, kernels)?,
            None => q,
        };
        let k = match &l.k_norm {
            Some(n) => n.forward(&k, kernels)?,
            None => k,
        };
        let (q, k) = if kernels {
            (
                crate::kernels::rope_f32(&q, cos, sin)?,
                crate::kernels::rope_f32(&k, cos, sin)?,
            )
        } else {
            (
                candle_nn::rotary_emb::rope_thd(&q.contiguous()?, cos, sin)?,
                candle_nn::rotary_emb::rope_thd(&k.contiguous()?, cos, sin)?,
            )
        };
        let v_all = cache.write(layer_idx, &k, &v.contiguous()?)?;
        let attn = self.attention(&q, cache.keys(layer_idx), &v_all, mask, cache.len())?;
        let x = self.residual(x, &l.o_proj.forward(&attn, exact)?)?;
        l.up_proj.prefetch_hint(HINT_BYTES);
        let h = l.mlp_norm.forward(&x, kernels)?;
        let [gate, up] = Linear::forward_many([&l.gate_proj, &l.up_proj], &h, exact)?;
        l.down_proj.prefetch_hint(HINT_BYTES);
        let gated = if kernels {
            crate::kernels::swiglu_f32(&gate, &up)?
        } else {
            (candle_nn::ops::silu(&gate)? * up)?
        };
        self.residual(&x, &l.down_proj.forward(&gated, exact)?)
    }

    /// `x + y`, a residual connection (on the CPU kernels without rayon: see [`crate::kernels::add_f32`]).
    fn residual(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        Ok(if self.cpu_kernels() {
            crate::kernels::add_f32(x, y)?
        } else {
            (x + y)?
        })
    }

    /// `q`: [1, rows, heads, hd]; `v`: [1, cached + rows, kv_heads, hd]; `keys` as the cache keeps them.
    /// Returns [rows, heads * hd].
    fn attention(
        &self,
        q: &Tensor,
        keys: crate::kernels::Keys,
        v: &Tensor,
        mask: &BlockMask,
        cached: usize,
    ) -> Result<Tensor> {
        let c = &self.config;
        let rows = q.dim(1)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        if self.ops == Ops::Exact && !self.device.is_cpu() {
            let crate::kernels::Keys::Rows(k) = keys else {
                bail!("the CUDA cache keeps its keys as rows");
            };
            let k = &k.narrow(1, 0, v.dim(1)?)?;
            let mask = match mask {
                BlockMask::Causal => None,
                BlockMask::Additive(m) => Some(m),
            };
            return Ok(crate::kernels::cuda::attention_exact(
                q, k, v, mask, cached, scale,
            )?);
        }
        if self.ops.row_invariant() {
            // The kernels' attention: each row's softmax and weighted sum over its visible keys only,
            // in key order. For f16 / bf16 the cache holds f32 (the dtype's values); the result is rounded
            // to the dtype.
            use crate::kernels::{attention_f32_keys, Visibility};
            let q32 = q.to_dtype(DType::F32)?;
            let mut written = None;
            let keys = written_keys(keys, v.dim(1)?, &mut written)?;
            let y = match mask {
                BlockMask::Causal => {
                    attention_f32_keys(&q32, keys, v, Visibility::Causal { offset: cached }, scale)?
                }
                BlockMask::Additive(m) => crate::kernels::with_f32(&m.to_dtype(DType::F32)?, |mask| {
                    attention_f32_keys(&q32, keys, v, Visibility::Additive(mask), scale)
                })??,
            };
            return Ok(y.to_dtype(self.dtype)?);
        }
        // Off the kernels the cache keeps its keys as rows: the written ones lead the buffer.
        let crate::kernels::Keys::Rows(k) = keys else {
            bail!("transposed keys are for the CPU kernels only");
        };
        let k = &k.narrow(1, 0, v.dim(1)?)?;
        // GPU path: matmul + additive mask + softmax, in f32 for the softmax.
        let groups = c.num_heads / c.num_kv_heads;
        let q = q.squeeze(0)?.transpose(0, 1)?.contiguous()?; // [heads, rows, hd]
        let expand = |t: &Tensor| -> Result<Tensor> {
            let t = t.squeeze(0)?.transpose(0, 1)?; // [kv_heads, len, hd]
            let (kvh, len, hd) = t.dims3()?;
            Ok(t.unsqueeze(1)?
                .expand((kvh, groups, len, hd))?
                .reshape((kvh * groups, len, hd))?
                .contiguous()?)
        };
        let (k, v) = (expand(k)?, expand(v)?);
        let att = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale as f64)?;
        let att = match mask {
            BlockMask::Causal if rows == 1 => att,
            BlockMask::Causal => {
                let m = causal_mask(rows, cached, &self.device)?;
                att.broadcast_add(&m)?
            }
            BlockMask::Additive(m) => att.broadcast_add(&m.to_dtype(DType::F32)?)?,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?.to_dtype(self.dtype)?;
        let y = att.matmul(&v)?; // [heads, rows, hd]
        Ok(y.transpose(0, 1)?.reshape((rows, c.num_heads * c.head_dim))?)
    }
}

/// The keys a block attends to, of `n` written: transposed ones as the cache keeps them; ones kept as
/// rows narrowed to the written ones, which lead the buffer (the narrowed view held in `written`).
fn written_keys<'a>(
    keys: crate::kernels::Keys<'a>,
    n: usize,
    written: &'a mut Option<Tensor>,
) -> Result<crate::kernels::Keys<'a>> {
    Ok(match keys {
        crate::kernels::Keys::Rows(k) => crate::kernels::Keys::Rows(written.insert(k.narrow(1, 0, n)?)),
        transposed => transposed,
    })
}

/// The CPU kernels' KV cache dtype unless asked otherwise: bf16, half the memory of f32 (an 8B model's
/// cache of 4096 tokens: 0.5 GiB instead of 1) and half the bytes a step reads for each cached token
/// (SmolLM2's steps after 1024-2048 tokens a quarter faster), in the precision Llama 3 and Qwen 3 were
/// trained in. Its rounding changes greedy answers about as often as the 8-bit activations do; f32
/// keeps the activations' numbers exactly.
pub const DEFAULT_KV_DTYPE: DType = DType::BF16;

/// Additive causal mask `[rows, cached + rows]`: row i sees every cached row and block rows 0..=i.
pub fn causal_mask(rows: usize, cached: usize, device: &Device) -> Result<Tensor> {
    let total = cached + rows;
    let data: Vec<f32> = (0..rows)
        .flat_map(|i| (0..total).map(move |j| if j <= cached + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(data, (rows, total), device)?)
}
