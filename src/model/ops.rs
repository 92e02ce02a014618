//! Which code computes a layer: probespec's CPU kernels, or candle's ops as a GPU device runs them, and
//! the developer switch (`PROBESPEC_OPS`) that makes the CPU take a GPU device's path.
//!
//! Speculative verification is lossless only when every row of a block gets the bits the same token gets
//! alone. The products (projections and attention's two matmuls) are where that can fail: their summation
//! order may depend on the number of rows. Norms, RoPE, SwiGLU, softmax and the residual additions are
//! computed row by row (or element by element) by every implementation here, so they cannot.

use anyhow::{bail, Result};
use candle_core::{DType, Device};

/// The environment variable that overrides [`Ops::default_for`]: `kernels`, `candle` or `exact`.
pub const OPS_ENV: &str = "PROBESPEC_OPS";

/// How a layer is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ops {
    /// probespec's CPU kernels in f32 (`src/kernels`): every step row-invariant, keys kept transposed.
    /// The default on the CPU in f32.
    Kernels,
    /// candle's ops, exactly as on a GPU device: matmuls, RMSNorm, RoPE, SwiGLU, attention as two
    /// products around an f32 softmax, keys kept as rows in the model's dtype; GGUF quantised weights
    /// through candle's quantised matmul. Its products' rounding depends on the rows of the block. The
    /// default on CUDA and Metal; on the CPU (`PROBESPEC_OPS=candle`) the test of what a GPU run meets.
    Candle,
    /// [`Ops::Candle`] with row-invariant products: every projection and attention (its scores, softmax
    /// and weighted sum over the visible keys in key order) is computed in f32 from the dtype's values, in
    /// a fixed order per output element whatever the block, and rounded to the dtype. Bit-exact
    /// verification in f16 / bf16. On the CPU through probespec's f32 kernels (the default there in f16 /
    /// bf16); on CUDA through `kernels::cuda` (GGUF quantised weights dequantised to the dtype at load;
    /// opt-in until a GPU has proven them: scripts/gpu-check.sh); not on Metal.
    Exact,
}

impl Ops {
    /// The ops a model on `device` in `dtype` runs: [`OPS_ENV`] when set (checked against the device and
    /// dtype), else kernels on the CPU in f32, [`Ops::Exact`] on the CPU in f16 / bf16, candle's ops on
    /// a GPU.
    pub fn for_model(device: &Device, dtype: DType) -> Result<Ops> {
        match std::env::var(OPS_ENV) {
            Ok(name) => {
                let ops = Ops::parse(&name)?;
                ops.check(device, dtype)?;
                Ok(ops)
            }
            Err(_) => Ok(Ops::default_for(device, dtype)),
        }
    }

    /// The ops when [`OPS_ENV`] is not set.
    pub fn default_for(device: &Device, dtype: DType) -> Ops {
        match (device.is_cpu(), dtype) {
            (true, DType::F32) => Ops::Kernels,
            (true, _) => Ops::Exact,
            (false, _) => Ops::Candle,
        }
    }

    pub fn parse(name: &str) -> Result<Ops> {
        Ok(match name {
            "kernels" => Ops::Kernels,
            "candle" => Ops::Candle,
            "exact" => Ops::Exact,
            other => bail!("{OPS_ENV}={other}: expected kernels, candle or exact"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Ops::Kernels => "kernels",
            Ops::Candle => "candle",
            Ops::Exact => "exact",
        }
    }

    /// Fails where these ops cannot run.
    pub fn check(self, device: &Device, dtype: DType) -> Result<()> {
        match self {
            Ops::Kernels if !device.is_cpu() || dtype != DType::F32 => {
                bail!("{OPS_ENV}=kernels: probespec's kernels run on the CPU in f32 only")
            }
            Ops::Exact if device.is_metal() => {
                bail!("{OPS_ENV}=exact: the row-invariant products run on the CPU and CUDA, not on Metal")
            }
            _ => Ok(()),
        }
    }

    /// Whether the projections and attention are row-invariant (probespec's f32 kernels).
    pub fn row_invariant(self) -> bool {
        self != Ops::Candle
    }

    /// Whether GGUF quantised weights go through candle's quantised matmul, as on a GPU, because
    /// [`OPS_ENV`] asks for candle's ops on the CPU.
    pub fn candle_forced() -> bool {
        std::env::var(OPS_ENV).is_ok_and(|v| v == "candle")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_names_and_checks() {
        let cpu = Device::Cpu;
        assert_eq!(Ops::default_for(&cpu, DType::F32), Ops::Kernels);
        assert_eq!(Ops::default_for(&cpu, DType::BF16), Ops::Exact);
        assert_eq!(Ops::default_for(&cpu, DType::F16), Ops::Exact);
        for ops in [Ops::Kernels, Ops::Candle, Ops::Exact] {
            assert_eq!(Ops::parse(ops.name()).unwrap(), ops);
        }
        let e = Ops::parse("gpu").unwrap_err().to_string();
        assert!(e.contains("PROBESPEC_OPS=gpu") && e.contains("candle"), "{e}");
        assert!(Ops::Kernels.check(&cpu, DType::BF16).is_err());
        assert!(Ops::Candle.check(&cpu, DType::BF16).is_ok());
        assert!(Ops::Exact.check(&cpu, DType::F32).is_ok());
        assert!(!Ops::Candle.row_invariant() && Ops::Exact.row_invariant());
    }
}
