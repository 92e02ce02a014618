//! The layer stack under the CPU kernels on flat f32 buffers: the same kernels in the same order as
//! [`Transformer::forward`]'s tensor path, so the same bits, without a candle tensor for every step.
//!
//! # Why
//! A decoding step of SmolLM2 runs 30 layers of about a dozen small operations on 576 values each. As
//! candle tensors every one of them allocated its result, its shape and its storage, took locks to
//! borrow it and freed it again: 22% of the calling thread's samples at one row (`perf record
//! --call-graph dwarf -- probespec cost --rows 1 --cache 32`), while the pool's worker waited for the
//! next product. Here a layer reads and writes buffers kept from step to step; only attention's values
//! (the cache's tensor) and the block's input and output stay tensors.

use super::{BlockMask, Layer, Linear, SequenceBlock, Transformer};
use crate::kernels::elementwise::{add_in_place, rope_in_place, swiglu_slices_with};
use crate::kernels::q8::matmul_q8_many;
use crate::kernels::{attention::attention_rows, Visibility, Width};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use std::cell::RefCell;

/// Buffers a block's layers reuse. After a long prompt they are dropped ([`KEEP_VALUES`]).
#[derive(Default)]
struct Buffers {
    /// The residual stream `[rows, hidden]`.
    x: Vec<f32>,
    /// A normalised copy of it, a product's input.
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// A product's output before it is added to the stream; Qwen 3's per-head norms' output.
    y: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// The block's RoPE rows `[rows, head_dim / 2]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// The blocks' additive masks (`[rows, cached + rows]` each), one after another.
    mask: Vec<f32>,
    /// Attention's output `[rows, heads * head_dim]`.
    attn: Vec<f32>,
}

/// The most values a buffer keeps for the next block (one-row steps after a prompt of thousands).
const KEEP_VALUES: usize = 1 << 18;

thread_local! {
    static BUFFERS: RefCell<Buffers> = RefCell::default();
}

impl Transformer {
    /// Whether [`Transformer::forward`] runs the layers on flat buffers: the CPU kernels, with every
    /// product a packed matrix and every norm an f32 vector (a GGUF file read with 8-bit activations).
    pub fn flat_layers(&self) -> bool {
        let linear = |l: &Linear| l.packed().is_some();
        self.cpu_kernels()
            && self.layers.iter().all(|l| {
                [
                    &l.q_proj,
                    &l.k_proj,
                    &l.v_proj,
                    &l.o_proj,
                    &l.gate_proj,
                    &l.up_proj,
                    &l.down_proj,
                ]
                .into_iter()
                .all(linear)
                    && [
                        Some(&l.attn_norm),
                        Some(&l.mlp_norm),
                        l.q_norm.as_ref(),
                        l.k_norm.as_ref(),
                    ]
                    .into_iter()
                    .flatten()
                    .all(|n| n.values.is_some())
            })
    }

    /// The layers of [`Transformer::forward_batch`] on flat buffers ([`Transformer::flat_layers`]): the
    /// blocks' rows one after another, positions and room already checked; returns the last layer's
    /// output for all of them, `[rows, hidden]`.
    pub(super) fn forward_flat(&self, blocks: &mut [SequenceBlock<'_>]) -> Result<Tensor> {
        let rows: usize = blocks.iter().map(|s| s.positions.len()).sum();
        let hidden = self.config.hidden_size;
        BUFFERS.with_borrow_mut(|b| {
            b.x.clear();
            b.mask.clear();
            b.cos.clear();
            b.sin.clear();
            for s in blocks.iter() {
                crate::kernels::with_f32(&s.x.to_dtype(DType::F32)?, |xs| b.x.extend_from_slice(xs))?;
                self.rope_rows_into(s.positions, &mut b.cos, &mut b.sin)?;
                if let BlockMask::Additive(m) = s.mask {
                    crate::kernels::with_f32(&m.to_dtype(DType::F32)?, |m| b.mask.extend_from_slice(m))?;
                }
            }
            if b.x.len() != rows * hidden {
                bail!("a block of {} values for {rows} rows of {hidden}", b.x.len());
            }
            for (i, layer) in self.layers.iter().enumerate() {
                self.layer_flat(layer, i, b, blocks)?;
            }
            let out = Tensor::from_slice(&b.x, (rows, hidden), &Device::Cpu)?;
            if b.x.capacity() > KEEP_VALUES {
                *b = Buffers::default();
            }
            Ok(out)
        })
    }

    /// The rows of the RoPE tables at `positions`, appended to `cos` and `sin`.
    fn rope_rows_into(&self, positions: &[u32], cos: &mut Vec<f32>, sin: &mut Vec<f32>) -> Result<()> {
        let half = self.config.head_dim / 2;
        for (table, out) in [(&self.cos, cos), (&self.sin, sin)] {
            crate::kernels::with_f32(table, |t| {
                for &p in positions {
                    out.extend_from_slice(&t[p as usize * half..][..half]);
                }
            })?;
        }
        Ok(())
    }

    /// One layer on the buffers, as `layer_forward` with the kernels.
    fn layer_flat(
        &self,
        l: &Layer,
        layer_idx: usize,
        b: &mut Buffers,
        blocks: &mut [SequenceBlock<'_>],
    ) -> Result<()> {
        let c = &self.config;
        let hd = c.head_dim;
        l.v_proj.prefetch_hint(super::HINT_BYTES);
        norm(&l.attn_norm, &b.x, &mut b.h);
        products(
            &b.h,
            [&l.q_proj, &l.k_proj, &l.v_proj],
            [&mut b.q, &mut b.k, &mut b.v],
        );
        l.o_proj.prefetch_hint(super::HINT_BYTES);
        if let Some(n) = &l.q_norm {
            norm(n, &b.q, &mut b.y);
            std::mem::swap(&mut b.q, &mut b.y);
        }
        if let Some(n) = &l.k_norm {
            norm(n, &b.k, &mut b.y);
            std::mem::swap(&mut b.k, &mut b.y);
        }
        rope_in_place(&mut b.q, c.num_heads * hd, hd, &b.cos, &b.sin);
        rope_in_place(&mut b.k, c.num_kv_heads * hd, hd, &b.cos, &b.sin);
        // The products ran over every sequence's rows; each block writes its own cache and attends to
        // it under its own mask.
        let (q_width, kv_width) = (c.num_heads * hd, c.num_kv_heads * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        b.attn.clear();
        let single = blocks.len() == 1;
        let (mut row, mut mask_at) = (0, 0);
        for s in blocks.iter_mut() {
            let n = s.positions.len();
            let kv = row * kv_width..(row + n) * kv_width;
            let values = s.cache.write_rows(layer_idx, &b.k[kv.clone()], &b.v[kv])?;
            let mut written = None;
            let keys = super::written_keys(s.cache.keys(layer_idx), values.dim(1)?, &mut written)?;
            let vis = match s.mask {
                BlockMask::Causal => Visibility::Causal {
                    offset: s.cache.len(),
                },
                BlockMask::Additive(_) => {
                    let len = n * (s.cache.len() + n);
                    mask_at += len;
                    Visibility::Additive(&b.mask[mask_at - len..mask_at])
                }
            };
            let q = &b.q[row * q_width..(row + n) * q_width];
            let attn = attention_rows(Width::best(), q, c.num_heads, keys, &values, vis, scale)?;
            if single {
                b.attn = attn;
            } else {
                b.attn.extend_from_slice(&attn);
            }
            row += n;
        }
        products(&b.attn, [&l.o_proj], [&mut b.y]);
        add_in_place(&mut b.x, &b.y);
        l.up_proj.prefetch_hint(super::HINT_BYTES);
        norm(&l.mlp_norm, &b.x, &mut b.h);
        products(&b.h, [&l.gate_proj, &l.up_proj], [&mut b.gate, &mut b.up]);
        l.down_proj.prefetch_hint(super::HINT_BYTES);
        b.h.resize(b.gate.len(), 0.0);
        swiglu_slices_with(Width::best(), &b.gate, &b.up, &mut b.h);
        products(&b.h, [&l.down_proj], [&mut b.y]);
        add_in_place(&mut b.x, &b.y);
        Ok(())
    }
}

/// `n` over the rows of `xs` into `out` (a norm of [`Transformer::flat_layers`]'s model has its values).
fn norm(n: &super::RmsNorm, xs: &[f32], out: &mut Vec<f32>) {
    n.rows_into(xs, out)
        .expect("the flat layers' norms are f32 vectors");
}

/// The products of `x`'s rows with the packed matrices of `linears` into `ys` (resized), as
/// [`Linear::forward_many`]: `x` quantised once, one job on the kernel pool.
fn products<const N: usize>(x: &[f32], linears: [&Linear; N], mut ys: [&mut Vec<f32>; N]) {
    let ws: [&crate::kernels::PackedMatrix; N] =
        linears.map(|l| l.packed().expect("the flat layers' products are packed"));
    let rows = x.len() / ws[0].dims().1;
    for (y, w) in ys.iter_mut().zip(&ws) {
        y.resize(rows * w.dims().0, 0.0);
    }
    let mut outs: [&mut [f32]; N] = ys.map(|y| y.as_mut_slice());
    matmul_q8_many(x, rows, &ws, &mut outs);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::causal_mask;
    use crate::model::synthetic::packed_model;
    use candle_core::quantized::GgmlDType;

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// A prompt, one-row steps, and a tree block under an additive mask (rows at repeated positions, a
    /// branch hidden from its sibling) through the flat layers and through the tensor path, each with
    /// its own cache: the same bits at every step.
    #[test]
    fn flat_layers_give_the_tensor_paths_bits() -> Result<()> {
        for (shape, format) in [("qwen3-0.6b", GgmlDType::Q4K), ("llama3.2-1b", GgmlDType::Q8_0)] {
            let m = packed_model(shape, format)?;
            assert!(m.flat_layers(), "{shape}: the flat layers should run this model");
            let (mut flat, mut tensors) = (m.new_cache(64)?, m.new_cache(64)?);
            let mut step = |ids: &[u32], positions: &[u32], mask: &BlockMask| -> Result<()> {
                let x = m.embed(ids)?;
                let a = m.forward(&x, positions, mask, &mut flat)?;
                tensors.ensure_room(ids.len())?;
                let b = m.forward_tensors(&x, positions, mask, &mut tensors)?;
                tensors.advance(ids.len());
                let b = m.norm.forward(&b, true)?;
                assert_eq!(bits(&a), bits(&b), "{shape}: block at {positions:?}");
                Ok(())
            };
            step(
                &[5, 17, 3, 250, 9, 1, 77],
                &[0, 1, 2, 3, 4, 5, 6],
                &BlockMask::Causal,
            )?;
            for (i, id) in [12u32, 40, 299].into_iter().enumerate() {
                step(&[id], &[7 + i as u32], &BlockMask::Causal)?;
            }
            // A tree of four rows after 10 cached: root, two children of it, a child of the first.
            let cached = 10;
            let mut mask = causal_mask(4, cached, &Device::Cpu)?.to_vec2::<f32>()?;
            mask[2][cached + 1] = f32::NEG_INFINITY;
            mask[3][cached + 2] = f32::NEG_INFINITY;
            let mask = Tensor::new(mask, &Device::Cpu)?;
            step(&[8, 21, 22, 60], &[10, 11, 11, 12], &BlockMask::Additive(mask))?;
        }
        Ok(())
    }
}
