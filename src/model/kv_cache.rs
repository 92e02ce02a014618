//! Preallocated key/value cache: one `[1, capacity, kv_heads, head_dim]` buffer per layer for keys and one
//! for values, written in place. Speculative steps append a whole block, then keep only the accepted rows.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    pub fn new(
        num_layers: usize,
        capacity: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let mut keys = Vec::with_capacity(num_layers);
        let mut values = Vec::with_capacity(num_layers);
        for _ in 0..num_layers {
            keys.push(Tensor::zeros((1, capacity, kv_heads, head_dim), dtype, device)?);
            values.push(Tensor::zeros((1, capacity, kv_heads, head_dim), dtype, device)?);
        }
        Ok(KvCache {
            keys,
            values,
            len: 0,
            capacity,
        })
    }

    /// Grows the buffers to hold at least `capacity` rows, keeping the committed ones.
    pub fn reserve(&mut self, capacity: usize) -> Result<()> {
        if capacity <= self.capacity {
            return Ok(());
        }
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let (b, _, h, d) = t.dims4()?;
            let grown = Tensor::zeros((b, capacity, h, d), t.dtype(), t.device())?;
            if self.len > 0 {
                grown.slice_set(&t.narrow(1, 0, self.len)?, 1, 0)?;
            }
            *t = grown;
        }
        self.capacity = capacity;
        Ok(())
    }

    /// Committed rows.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Fails before a forward pass of `rows` new rows that would not fit.
    pub fn ensure_room(&self, rows: usize) -> Result<()> {
        if self.len + rows > self.capacity {
            bail!(
                "context window exceeded: {} cached + {} new positions > {} available",
                self.len,
                rows,
                self.capacity
            );
        }
        Ok(())
    }

    /// Writes a block's keys and values (`[1, rows, kv_heads, head_dim]`) after the committed rows and returns
    /// views over everything the block attends to. `len` advances only in [`KvCache::advance`], once all
    /// layers have written.
    pub fn write(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let rows = k.dim(1)?;
        self.ensure_room(rows)?;
        self.keys[layer].slice_set(k, 1, self.len)?;
        self.values[layer].slice_set(v, 1, self.len)?;
        let total = self.len + rows;
        Ok((
            self.keys[layer].narrow(1, 0, total)?,
            self.values[layer].narrow(1, 0, total)?,
        ))
    }

    pub fn advance(&mut self, rows: usize) {
        self.len += rows;
    }

    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Keeps, of the rows from `start` on, only `rows` (offsets from `start`, ascending), packed from `start`.
    /// This is how a verified block leaves prefix + root + accepted path in the cache.
    pub fn keep(&mut self, start: usize, rows: &[usize]) -> Result<()> {
        let is_prefix = rows.iter().enumerate().all(|(i, &r)| i == r);
        if !is_prefix {
            let span = self.len - start;
            if rows.iter().any(|&r| r >= span) {
                bail!("kv cache keep: row out of range");
            }
            let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let idx = Tensor::new(idx.as_slice(), self.keys[0].device())?;
            for t in self.keys.iter().chain(self.values.iter()) {
                let kept = t.narrow(1, start, span)?.index_select(&idx, 1)?;
                t.slice_set(&kept, 1, start)?;
            }
        }
        self.len = start + rows.len();
        Ok(())
    }
}
