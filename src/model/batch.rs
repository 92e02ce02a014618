//! Several sequences' blocks in one forward pass: what a server decoding many requests at once runs.
//!
//! Every block names its rows' input embeddings, positions and attention mask, and its sequence's own
//! KV cache. The products, norms, RoPE and activations run once over the rows of all blocks; attention
//! and the cache writes run block by block. Every product kernel of the flat layers is row-invariant (a
//! row's result does not depend on which rows share its call), so a sequence's hidden states, and hence
//! its tokens, are the bits it gets alone, whatever its neighbours in the batch. Off the flat layers
//! (candle's tensors, another device) the blocks run one after another, which gives the same bits by
//! construction.

use super::{BlockMask, KvCache, Transformer, HINT_BYTES};
use anyhow::{bail, Result};
use candle_core::Tensor;

/// One sequence's block in a [`Transformer::forward_batch`].
pub struct SequenceBlock<'a> {
    /// Input embeddings `[rows, hidden]`.
    pub x: &'a Tensor,
    /// Each row's position.
    pub positions: &'a [u32],
    /// The rows' attention pattern over the sequence's cache and the block.
    pub mask: &'a BlockMask,
    /// The sequence's cache: the block's keys and values are appended to it.
    pub cache: &'a mut KvCache,
}

impl Transformer {
    /// Runs every block (`x`: `[rows, hidden]` input embeddings at `positions`), appending each block's
    /// keys and values to its sequence's cache. Returns each block's final-norm hidden states
    /// `[rows, hidden]`, in order. A bad block (positions, the cache's room, the mask's shape) fails the
    /// call before anything is written.
    pub fn forward_batch(&self, blocks: &mut [SequenceBlock<'_>]) -> Result<Vec<Tensor>> {
        for (i, block) in blocks.iter().enumerate() {
            self.check_block(block).map_err(|e| {
                if blocks.len() > 1 {
                    e.context(format!("sequence {i} of the batch"))
                } else {
                    e
                }
            })?;
        }
        let kernels = self.cpu_kernels();
        if !self.flat_layers() {
            let mut out = Vec::with_capacity(blocks.len());
            for b in blocks.iter_mut() {
                let x = self.forward_tensors(b.x, b.positions, b.mask, b.cache)?;
                b.cache.advance(b.positions.len());
                self.lm_head.prefetch_hint(HINT_BYTES);
                out.push(self.norm.forward(&x, kernels)?);
            }
            return Ok(out);
        }
        let x = self.forward_flat(blocks)?;
        for b in blocks.iter_mut() {
            b.cache.advance(b.positions.len());
        }
        self.lm_head.prefetch_hint(HINT_BYTES);
        let x = self.norm.forward(&x, kernels)?;
        if blocks.len() == 1 {
            return Ok(vec![x]);
        }
        let mut start = 0;
        let mut out = Vec::with_capacity(blocks.len());
        for b in blocks.iter() {
            let rows = b.positions.len();
            out.push(x.narrow(0, start, rows)?);
            start += rows;
        }
        Ok(out)
    }

    /// Whether a block can run: rows and positions agree and lie in the context window, the cache has
    /// room for them, and an additive mask covers the cache and the block.
    fn check_block(&self, b: &SequenceBlock<'_>) -> Result<()> {
        let rows = b.x.dim(0)?;
        if b.positions.len() != rows {
            bail!("{} positions for {} rows", b.positions.len(), rows);
        }
        if rows == 0 {
            bail!("a block of no rows");
        }
        if let Some(&p) = b.positions.iter().max() {
            if p as usize >= self.config.max_position_embeddings {
                bail!(
                    "position {p} is beyond the model's context window of {}",
                    self.config.max_position_embeddings
                );
            }
        }
        b.cache.ensure_room(rows)?;
        if let BlockMask::Additive(m) = b.mask {
            let want = (rows, b.cache.len() + rows);
            if m.dims2()? != want {
                bail!(
                    "a mask of {:?} for {} rows after {} cached",
                    m.dims(),
                    rows,
                    b.cache.len()
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::causal_mask;
    use crate::model::synthetic::packed_model;
    use candle_core::quantized::GgmlDType;
    use candle_core::Device;

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// A step: token ids, positions, and a tree mask's hidden pairs (row, block row) when the block is
    /// a tree.
    type StepRows = (Vec<u32>, Vec<u32>, Vec<(usize, usize)>);

    /// A sequence's steps.
    struct Seq {
        steps: Vec<StepRows>,
    }

    fn mask_of(rows: usize, cached: usize, hidden: &[(usize, usize)]) -> Result<BlockMask> {
        if hidden.is_empty() {
            return Ok(BlockMask::Causal);
        }
        let mut mask = causal_mask(rows, cached, &Device::Cpu)?.to_vec2::<f32>()?;
        for &(r, c) in hidden {
            mask[r][cached + c] = f32::NEG_INFINITY;
        }
        Ok(BlockMask::Additive(Tensor::new(mask, &Device::Cpu)?))
    }

    /// Sequences with prompts of different lengths, one-row steps and tree blocks, each run alone and
    /// all in one batch per step (the ones still going): the same hidden bits and the same caches'
    /// lengths, step by step.
    #[test]
    fn a_sequence_in_a_batch_gets_the_bits_it_gets_alone() -> Result<()> {
        for (shape, format) in [("qwen3-0.6b", GgmlDType::Q4K), ("llama3.2-1b", GgmlDType::Q8_0)] {
            let m = packed_model(shape, format)?;
            assert!(m.flat_layers(), "{shape}: the flat layers should run this model");
            let seqs = [
                Seq {
                    steps: vec![
                        (vec![5, 17, 3, 250, 9, 1, 77], (0..7).collect(), vec![]),
                        (vec![12], vec![7], vec![]),
                        (vec![8, 21, 22, 60], vec![8, 9, 9, 10], vec![(2, 1), (3, 2)]),
                        (vec![40], vec![10], vec![]),
                    ],
                },
                Seq {
                    steps: vec![
                        (vec![99, 4], vec![0, 1], vec![]),
                        (vec![299], vec![2], vec![]),
                        (vec![7, 8, 9], vec![3, 4, 4], vec![(2, 1)]),
                    ],
                },
                Seq {
                    steps: vec![
                        (
                            (0..20).map(|i| (i * 13) % 300).collect(),
                            (0..20).collect(),
                            vec![],
                        ),
                        (vec![1], vec![20], vec![]),
                        (vec![2], vec![21], vec![]),
                        (vec![3], vec![22], vec![]),
                        (vec![4, 5], vec![23, 24], vec![]),
                    ],
                },
            ];
            let mut alone: Vec<KvCache> = seqs.iter().map(|_| m.new_cache(64)).collect::<Result<_>>()?;
            let mut together: Vec<KvCache> = seqs.iter().map(|_| m.new_cache(64)).collect::<Result<_>>()?;
            let most = seqs.iter().map(|s| s.steps.len()).max().unwrap_or(0);
            for step in 0..most {
                let going: Vec<usize> = (0..seqs.len()).filter(|&i| step < seqs[i].steps.len()).collect();
                let inputs: Vec<(Tensor, &[u32], BlockMask)> = going
                    .iter()
                    .map(|&i| {
                        let (ids, positions, hidden) = &seqs[i].steps[step];
                        let mask = mask_of(ids.len(), alone[i].len(), hidden)?;
                        Ok((m.embed(ids)?, positions.as_slice(), mask))
                    })
                    .collect::<Result<_>>()?;
                let want: Vec<Tensor> = going
                    .iter()
                    .zip(&inputs)
                    .map(|(&i, (x, p, mask))| m.forward(x, p, mask, &mut alone[i]))
                    .collect::<Result<_>>()?;
                let mut caches: Vec<&mut KvCache> = together.iter_mut().collect();
                let mut picked: Vec<&mut KvCache> = Vec::new();
                for (i, c) in caches.drain(..).enumerate() {
                    if going.contains(&i) {
                        picked.push(c);
                    }
                }
                let mut blocks: Vec<SequenceBlock> = inputs
                    .iter()
                    .zip(picked)
                    .map(|((x, positions, mask), cache)| SequenceBlock {
                        x,
                        positions,
                        mask,
                        cache,
                    })
                    .collect();
                let got = m.forward_batch(&mut blocks)?;
                assert_eq!(got.len(), want.len());
                for ((g, w), &i) in got.iter().zip(&want).zip(&going) {
                    assert_eq!(bits(g), bits(w), "{shape}: sequence {i} at step {step}");
                    assert_eq!(together[i].len(), alone[i].len());
                }
            }
        }
        Ok(())
    }

    /// The same sequence beside different neighbours gives the same bits.
    #[test]
    fn neighbours_do_not_change_a_sequence() -> Result<()> {
        let m = packed_model("qwen3-0.6b", GgmlDType::Q4K)?;
        let run = |neighbours: &[Vec<u32>]| -> Result<Vec<u32>> {
            let ids = [3u32, 141, 59, 26, 5];
            let positions: Vec<u32> = (0..5).collect();
            let x = m.embed(&ids)?;
            let mut cache = m.new_cache(32)?;
            let others: Vec<(Tensor, Vec<u32>)> = neighbours
                .iter()
                .map(|n| Ok((m.embed(n)?, (0..n.len() as u32).collect())))
                .collect::<Result<_>>()?;
            let mut other_caches: Vec<KvCache> =
                others.iter().map(|_| m.new_cache(32)).collect::<Result<_>>()?;
            let mut blocks = vec![SequenceBlock {
                x: &x,
                positions: &positions,
                mask: &BlockMask::Causal,
                cache: &mut cache,
            }];
            for ((x, positions), cache) in others.iter().zip(other_caches.iter_mut()) {
                blocks.push(SequenceBlock {
                    x,
                    positions,
                    mask: &BlockMask::Causal,
                    cache,
                });
            }
            Ok(bits(&m.forward_batch(&mut blocks)?[0]))
        };
        let alone = run(&[])?;
        assert_eq!(run(&[vec![1, 2, 3]])?, alone);
        assert_eq!(run(&[vec![7; 9], vec![250], vec![4, 4]])?, alone);
        Ok(())
    }

    /// A bad block fails the whole call before any cache is written.
    #[test]
    fn a_bad_block_writes_nothing() -> Result<()> {
        let m = packed_model("llama3.2-1b", GgmlDType::Q8_0)?;
        let x = m.embed(&[1, 2])?;
        let (mut a, mut b) = (m.new_cache(8)?, m.new_cache(8)?);
        let good = [0u32, 1];
        let mask = causal_mask(2, 3, &Device::Cpu)?;
        let wrong_mask = BlockMask::Additive(mask);
        let mut blocks = [
            SequenceBlock {
                x: &x,
                positions: &good,
                mask: &BlockMask::Causal,
                cache: &mut a,
            },
            SequenceBlock {
                x: &x,
                positions: &good,
                mask: &wrong_mask,
                cache: &mut b,
            },
        ];
        let err = m.forward_batch(&mut blocks).unwrap_err();
        assert!(format!("{err:#}").contains("sequence 1"), "{err:#}");
        assert_eq!((a.len(), b.len()), (0, 0));
        Ok(())
    }
}
