//! Row-invariant products on CUDA (`PROBESPEC_OPS=exact` on a GPU): the projections and attention of
//! `cuda/exact.cu` (compiled to PTX by build.rs with the `cuda` feature) as candle custom ops. Each
//! output element is reduced in an order fixed by the reduction length alone, so a block's rows get the
//! bits their tokens get alone, as the CPU kernels do; see the .cu file for the orders. Not yet run on a
//! GPU: scripts/gpu-check.sh checks them on the first one lent.

use candle_core::{Result, Tensor};

/// `x · wᵀ` (`x`: [rows, in], `w`: [out, in], one dtype: f32, f16 or bf16) -> [rows, out].
pub fn matmul_exact(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    imp::matmul_exact(x, w)
}

/// Attention of `q` ([1, rows, heads, hd]) over the cache's written keys and values
/// ([1, len, kv_heads, hd]), row `i` seeing keys `0..=cached + i` or, with `mask` ([rows, len] f32,
/// 0 or -inf), the keys it leaves visible; -> [rows, heads * hd], in `q`'s dtype.
pub fn attention_exact(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    cached: usize,
    scale: f32,
) -> Result<Tensor> {
    imp::attention_exact(q, k, v, mask, cached, scale)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use candle_core::{bail, Result, Tensor};

    pub fn matmul_exact(_: &Tensor, _: &Tensor) -> Result<Tensor> {
        bail!("the row-invariant CUDA kernels need a build with the cuda feature")
    }

    pub fn attention_exact(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: Option<&Tensor>,
        _: usize,
        _: f32,
    ) -> Result<Tensor> {
        bail!("the row-invariant CUDA kernels need a build with the cuda feature")
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
    use candle_core::{
        bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, WithDType,
    };

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/exact.ptx"));
    const MODULE: &str = "probespec_exact";
    /// Warps per thread block: the kernels' WARPS_PER_BLOCK.
    const WARPS: usize = 8;
    /// The kernels' MAX_DIMS_PER_LANE x 32.
    const MAX_HEAD_DIM: usize = 256;

    pub fn matmul_exact(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &ExactMatmul)
    }

    pub fn attention_exact(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        cached: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let (_, rows, heads, hd) = q.dims4()?;
        let op = ExactAttention {
            mask: mask.map(|m| m.to_dtype(DType::F32)?.contiguous()).transpose()?,
            cached,
            scale,
        };
        let y = q
            .contiguous()?
            .apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &op)?;
        y.reshape((rows, heads * hd))
    }

    /// A contiguous tensor's elements as a view of its storage.
    fn view<'a, T: CudaDType + DeviceRepr>(s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
            None => bail!("exact CUDA kernels take contiguous tensors"),
        }
    }

    /// The kernel `root` for `dtype`, loaded once per device.
    macro_rules! kernel {
        ($dev:expr, $root:literal, $dtype:expr) => {
            $dev.get_or_load_custom_func(
                &format!(concat!($root, "_{}"), $dtype.as_str()),
                MODULE,
                PTX,
            )?
        };
    }

    fn blocks(items: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (items.div_ceil(WARPS) as u32, 1, 1),
            block_dim: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    struct ExactMatmul;

    impl ExactMatmul {
        fn run<T: CudaDType + DeviceRepr + WithDType>(
            &self,
            xs: &CudaStorage,
            xl: &Layout,
            ws: &CudaStorage,
            wl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let (rows, inner) = xl.shape().dims2()?;
            let (out, w_inner) = wl.shape().dims2()?;
            if inner != w_inner {
                bail!("exact matmul: x has {inner} columns, w {w_inner}");
            }
            let dev = xs.device().clone();
            let (x, w) = (view::<T>(xs, xl)?, view::<T>(ws, wl)?);
            // SAFETY: every element is written by the kernel.
            let y = unsafe { dev.alloc::<T>(rows * out)? };
            let func = kernel!(dev, "exact_matmul", T::DTYPE);
            let (r, i, o) = (rows as i32, inner as i32, out as i32);
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&w);
            b.arg(&y);
            b.arg(&r);
            b.arg(&i);
            b.arg(&o);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { b.launch(blocks(out)) }.w()?;
            Ok((CudaStorage::wrap_cuda_slice(y, dev), Shape::from((rows, out))))
        }
    }

    impl CustomOp2 for ExactMatmul {
        fn name(&self) -> &'static str {
            "exact-matmul"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            bail!("exact-matmul is a CUDA kernel (the CPU has probespec's own)")
        }

        fn cuda_fwd(
            &self,
            xs: &CudaStorage,
            xl: &Layout,
            ws: &CudaStorage,
            wl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            if xs.dtype() != ws.dtype() {
                bail!("exact matmul: x is {:?}, w {:?}", xs.dtype(), ws.dtype());
            }
            match xs.dtype() {
                DType::F32 => self.run::<f32>(xs, xl, ws, wl),
                DType::F16 => self.run::<half::f16>(xs, xl, ws, wl),
                DType::BF16 => self.run::<half::bf16>(xs, xl, ws, wl),
                other => bail!("exact matmul takes f32, f16 or bf16, not {other:?}"),
            }
        }
    }

    struct ExactAttention {
        mask: Option<Tensor>,
        cached: usize,
        scale: f32,
    }

    impl ExactAttention {
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + DeviceRepr + WithDType>(
            &self,
            qs: &CudaStorage,
            ql: &Layout,
            ks: &CudaStorage,
            kl: &Layout,
            vs: &CudaStorage,
            vl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let (_, rows, heads, hd) = ql.shape().dims4()?;
            let (_, len, kv_heads, k_hd) = kl.shape().dims4()?;
            if vl.shape().dims4()? != (1, len, kv_heads, hd) || k_hd != hd || heads % kv_heads != 0 {
                bail!(
                    "exact attention: q {:?}, k {:?}, v {:?}",
                    ql.shape(),
                    kl.shape(),
                    vl.shape()
                );
            }
            if hd > MAX_HEAD_DIM {
                bail!("exact attention: head_dim {hd} over {MAX_HEAD_DIM}");
            }
            let dev = qs.device().clone();
            let (q, k, v) = (view::<T>(qs, ql)?, view::<T>(ks, kl)?, view::<T>(vs, vl)?);
            let guard;
            let dummy;
            let (mask, has_mask) = match &self.mask {
                Some(m) => {
                    if m.dims2()? != (rows, len) {
                        bail!(
                            "exact attention: mask {:?} for {rows} rows and {len} keys",
                            m.shape()
                        );
                    }
                    guard = m.storage_and_layout();
                    let Storage::Cuda(s) = &*guard.0 else {
                        bail!("exact attention: the mask is not on the GPU");
                    };
                    (view::<f32>(s, guard.1)?, 1i32)
                }
                None => {
                    dummy = dev.alloc_zeros::<f32>(1)?;
                    (dummy.slice(0..1), 0i32)
                }
            };
            // SAFETY: every element is written by the kernel.
            let y = unsafe { dev.alloc::<T>(rows * heads * hd)? };
            let func = kernel!(dev, "exact_attention", T::DTYPE);
            let ints = [rows, heads, kv_heads, hd, len, self.cached].map(|n| n as i32);
            let mut b = func.builder();
            b.arg(&q);
            b.arg(&k);
            b.arg(&v);
            b.arg(&mask);
            b.arg(&has_mask);
            b.arg(&y);
            for n in &ints {
                b.arg(n);
            }
            b.arg(&self.scale);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { b.launch(blocks(rows * heads)) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev),
                Shape::from((1, rows, heads, hd)),
            ))
        }
    }

    impl CustomOp3 for ExactAttention {
        fn name(&self) -> &'static str {
            "exact-attention"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            bail!("exact-attention is a CUDA kernel (the CPU has probespec's own)")
        }

        fn cuda_fwd(
            &self,
            qs: &CudaStorage,
            ql: &Layout,
            ks: &CudaStorage,
            kl: &Layout,
            vs: &CudaStorage,
            vl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            if qs.dtype() != ks.dtype() || qs.dtype() != vs.dtype() {
                bail!(
                    "exact attention: q, k, v in {:?}, {:?}, {:?}",
                    qs.dtype(),
                    ks.dtype(),
                    vs.dtype()
                );
            }
            match qs.dtype() {
                DType::F32 => self.run::<f32>(qs, ql, ks, kl, vs, vl),
                DType::F16 => self.run::<half::f16>(qs, ql, ks, kl, vs, vl),
                DType::BF16 => self.run::<half::bf16>(qs, ql, ks, kl, vs, vl),
                other => bail!("exact attention takes f32, f16 or bf16, not {other:?}"),
            }
        }
    }
}
