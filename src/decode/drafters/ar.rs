//! Plain autoregressive decoding: the root alone, one token per model call. The reference every other
//! strategy must reproduce token for token.

use crate::decode::generate::{Draft, Drafter, Step};
use crate::decode::kind::MethodKind;
use crate::decode::layout::Probe;
use crate::model::Transformer;
use anyhow::{bail, Result};
use candle_core::Tensor;

#[derive(Default)]
pub struct Autoregressive;

impl Drafter for Autoregressive {
    fn name(&self) -> MethodKind {
        MethodKind::Ar
    }
    fn begin(&mut self, _: &Transformer, _: &[u32]) -> Result<usize> {
        Ok(0)
    }
    fn draft(&mut self, root: u32, _: &[u32], _: usize) -> Draft {
        Draft::root_only(root)
    }
    fn probe_inputs(&self, _: &Transformer, _: &[Probe]) -> Result<Tensor> {
        bail!("plain decoding has no probe rows")
    }
    fn observe(&mut self, _: &Transformer, _: &Step) -> Result<()> {
        Ok(())
    }
}
