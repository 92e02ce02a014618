//! A projection `y = x W^T (+ b)` over dense or GGUF-quantised weights.

use anyhow::Result;
use candle_core::quantized::QMatMul;
use candle_core::{DType, Module, Tensor};
use std::sync::Arc;

use crate::kernels::{BlockMatrix, PackedMatrix};
use std::sync::OnceLock;

pub enum Weight {
    Dense(Tensor),
    /// GGUF Q4_0 / Q4_1 / Q8_0 blocks on the CPU, multiplied with f32 activations by the row-invariant
    /// block kernel.
    Blocks(BlockMatrix),
    /// GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights on the CPU, repacked for the row-invariant
    /// kernel with 8-bit activations (shared with the embedding table where the output projection is
    /// tied to it).
    Packed(Arc<PackedMatrix>),
    /// Other quantised formats, or any on a GPU: candle's quantised matmul.
    Quantized(QMatMul),
}

pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    /// Output-column permutation applied after the product: GGUF stores LLaMA's q/k rows interleaved for
    /// llama.cpp's RoPE; quantised rows cannot be reordered cheaply at load, so the outputs are.
    out_perm: Option<Tensor>,
    /// f16 / bf16 dense weights as f32 (the same values), made on the first row-invariant product: what
    /// the f32 kernel reads.
    upcast: OnceLock<Tensor>,
}

impl Linear {
    pub fn new(weight: Weight, bias: Option<Tensor>) -> Self {
        Linear {
            weight,
            bias,
            out_perm: None,
            upcast: OnceLock::new(),
        }
    }

    /// Asks the kernel pool's idle worker to prefetch the end of this product's weights (packed ones
    /// only), the part the worker's share of the product reads, while the caller works alone.
    pub fn prefetch_hint(&self, bytes: usize) {
        if let Weight::Packed(m) = &self.weight {
            crate::kernels::pool::Pool::global().prefetch_hint(m.tail(bytes));
        }
    }

    /// The packed matrix of a product with nothing after it (no bias, no output permutation): what the
    /// layers on flat buffers multiply by directly.
    pub fn packed(&self) -> Option<&PackedMatrix> {
        match &self.weight {
            Weight::Packed(p) if self.bias.is_none() && self.out_perm.is_none() => Some(p),
            _ => None,
        }
    }

    pub fn with_out_perm(mut self, perm: Tensor) -> Self {
        self.out_perm = Some(perm);
        self
    }

    /// `x`: [rows, in] -> [rows, out], in `x`'s dtype. With `row_invariant`, dense weights go through
    /// the f32 kernel (f16 / bf16 ones and their activations as their f32 values, the result rounded to
    /// `x`'s dtype): a row's result does not depend on the other rows of the block, so speculative
    /// verification reproduces plain decoding bit for bit. Without, through candle's matmul in `x`'s
    /// dtype, as on a GPU.
    pub fn forward(&self, x: &Tensor, row_invariant: bool) -> Result<Tensor> {
        let y = match &self.weight {
            Weight::Dense(w) if row_invariant && w.device().is_cuda() => {
                crate::kernels::cuda::matmul_exact(x, w)?
            }
            Weight::Dense(w) if row_invariant => {
                let w = if w.dtype() == DType::F32 {
                    w
                } else {
                    self.upcast_of(w)?
                };
                let dt = x.dtype();
                crate::kernels::linear_f32(&x.to_dtype(DType::F32)?.contiguous()?, w)?.to_dtype(dt)?
            }
            Weight::Dense(w) => x.matmul(&w.t()?)?,
            Weight::Blocks(b) => {
                let dt = x.dtype();
                crate::kernels::linear_blocks(&x.to_dtype(DType::F32)?.contiguous()?, b)?.to_dtype(dt)?
            }
            Weight::Packed(p) => q8_products(x, &[p])?.pop().expect("one product"),
            Weight::Quantized(q) => {
                // Quantised kernels take f32 activations.
                let dt = x.dtype();
                let y = q.forward(&x.to_dtype(DType::F32)?)?;
                y.to_dtype(dt)?
            }
        };
        self.finish(y)
    }

    /// Several projections of the same input (a layer's q/k/v, or gate/up). With 8-bit activations on the
    /// CPU the input is quantised once and all the products go to the kernel pool as one job; the
    /// results are those of calling [`Linear::forward`] on each.
    pub fn forward_many<const N: usize>(
        linears: [&Linear; N],
        x: &Tensor,
        row_invariant: bool,
    ) -> Result<[Tensor; N]> {
        let packed: Option<Vec<&PackedMatrix>> = linears
            .iter()
            .map(|l| match &l.weight {
                Weight::Packed(p) => Some(&**p),
                _ => None,
            })
            .collect();
        let ys: Vec<Tensor> = match packed {
            Some(ws) => q8_products(x, &ws)?
                .into_iter()
                .zip(linears)
                .map(|(y, l)| l.finish(y))
                .collect::<Result<_>>()?,
            None => linears
                .iter()
                .map(|l| l.forward(x, row_invariant))
                .collect::<Result<_>>()?,
        };
        Ok(ys.try_into().expect("one result per projection"))
    }

    /// `w` as f32, made once.
    fn upcast_of(&self, w: &Tensor) -> Result<&Tensor> {
        if let Some(u) = self.upcast.get() {
            return Ok(u);
        }
        let u = w.to_dtype(DType::F32)?;
        Ok(self.upcast.get_or_init(|| u))
    }

    /// Bias, then the output permutation.
    fn finish(&self, y: Tensor) -> Result<Tensor> {
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        Ok(match &self.out_perm {
            Some(p) => y.index_select(p, 1)?,
            None => y,
        })
    }
}

/// `x · Wᵢᵀ` for packed matrices, with 8-bit activations (one quantisation of `x`), in `x`'s dtype.
fn q8_products(x: &Tensor, ws: &[&PackedMatrix]) -> Result<Vec<Tensor>> {
    let dt = x.dtype();
    crate::kernels::linear_q8_many(&x.to_dtype(DType::F32)?, ws)?
        .into_iter()
        .map(|y| Ok(y.to_dtype(dt)?))
        .collect()
}
