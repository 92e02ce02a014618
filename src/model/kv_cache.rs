//! Preallocated key/value cache: one `[1, capacity, kv_heads, head_dim]` buffer per layer for keys and one
//! for values, written in place. Speculative steps append a whole block, then keep only the accepted rows.
//!
//! For the CPU kernels the keys are kept transposed instead ([`TransposedKeys`]), as the attention
//! kernel scores them: laid out once when written rather than on every step.

use crate::kernels::{Keys, TransposedKeys};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

pub struct KvCache {
    keys: KeyStore,
    values: Vec<Tensor>,
    len: usize,
    capacity: usize,
}

/// Where the keys are kept.
enum KeyStore {
    /// Per layer `[1, capacity, kv_heads, head_dim]`, as the values.
    Rows(Vec<Tensor>),
    /// Per layer `[width][transposed_stride(capacity)]` ([`TransposedKeys`]), `width` = kv_heads ·
    /// head_dim: for the CPU kernels.
    Transposed { layers: Vec<Vec<f32>>, width: usize },
}

/// Columns of a transposed key row for `capacity` keys: whole chunks of the kernel's scores, which read
/// a chunk past the last key, and 16 more, so that rows do not lie a multiple of 4 KiB apart (the
/// scores read one chunk of every row: at such a stride all of them fall into the same L1 sets).
fn transposed_stride(capacity: usize) -> usize {
    capacity.next_multiple_of(crate::kernels::KEY_CHUNK) + 16
}

impl KvCache {
    /// With `transposed`, the keys are kept only as the CPU kernels read them (f32 only).
    pub fn new(
        num_layers: usize,
        capacity: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
        transposed: bool,
    ) -> Result<Self> {
        if transposed && dtype != DType::F32 {
            bail!("transposed keys are f32");
        }
        let buffer = || Tensor::zeros((1, capacity, kv_heads, head_dim), dtype, device);
        let values = (0..num_layers)
            .map(|_| buffer())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let keys = if transposed {
            let width = kv_heads * head_dim;
            KeyStore::Transposed {
                layers: vec![vec![0.0f32; width * transposed_stride(capacity)]; num_layers],
                width,
            }
        } else {
            KeyStore::Rows(
                (0..num_layers)
                    .map(|_| buffer())
                    .collect::<candle_core::Result<_>>()?,
            )
        };
        Ok(KvCache {
            keys,
            values,
            len: 0,
            capacity,
        })
    }

    /// The row-major buffers: the values, and the keys when kept so.
    fn row_buffers(&mut self) -> impl Iterator<Item = &mut Tensor> {
        let keys = match &mut self.keys {
            KeyStore::Rows(k) => k.as_mut_slice(),
            KeyStore::Transposed { .. } => &mut [],
        };
        keys.iter_mut().chain(self.values.iter_mut())
    }

    /// Grows the buffers to hold at least `capacity` rows, keeping the committed ones.
    pub fn reserve(&mut self, capacity: usize) -> Result<()> {
        if capacity <= self.capacity {
            return Ok(());
        }
        let len = self.len;
        for t in self.row_buffers() {
            let (b, _, h, d) = t.dims4()?;
            let grown = Tensor::zeros((b, capacity, h, d), t.dtype(), t.device())?;
            if len > 0 {
                grown.slice_set(&t.narrow(1, 0, len)?, 1, 0)?;
            }
            *t = grown;
        }
        if let KeyStore::Transposed { layers, width } = &mut self.keys {
            let (old, new) = (transposed_stride(self.capacity), transposed_stride(capacity));
            for kt in layers.iter_mut() {
                let mut grown = vec![0.0f32; *width * new];
                for (to, from) in grown.chunks_exact_mut(new).zip(kt.chunks_exact(old)) {
                    to[..len].copy_from_slice(&from[..len]);
                }
                *kt = grown;
            }
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
    /// a view over the values the block attends to (its keys: [`KvCache::keys`]). `len` advances only in
    /// [`KvCache::advance`], once all layers have written.
    /// Keys and values of another dtype are converted to the cache's.
    pub fn write(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let rows = k.dim(1)?;
        self.ensure_room(rows)?;
        let len = self.len;
        let dtype = self.values[layer].dtype();
        let (k, v) = (&k.to_dtype(dtype)?, &v.to_dtype(dtype)?);
        match &mut self.keys {
            KeyStore::Rows(keys) => keys[layer].slice_set(k, 1, len)?,
            KeyStore::Transposed { layers, width } => {
                let (kt, width, stride) = (&mut layers[layer], *width, transposed_stride(self.capacity));
                crate::kernels::with_f32(k, |kv| {
                    for (r, row) in kv.chunks_exact(width).enumerate() {
                        for (c, &x) in row.iter().enumerate() {
                            kt[c * stride + len + r] = x;
                        }
                    }
                })?;
            }
        }
        self.values[layer].slice_set(v, 1, len)?;
        Ok(self.values[layer].narrow(1, 0, len + rows)?)
    }

    /// Layer `layer`'s keys up to the last [`KvCache::write`]: as rows, the whole buffer (the first
    /// rows are the written ones), or transposed.
    pub fn keys(&self, layer: usize) -> Keys<'_> {
        match &self.keys {
            KeyStore::Rows(keys) => Keys::Rows(&keys[layer]),
            KeyStore::Transposed { layers, .. } => Keys::Transposed(TransposedKeys {
                data: &layers[layer],
                stride: transposed_stride(self.capacity),
            }),
        }
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
            let idx = Tensor::new(idx.as_slice(), self.values[0].device())?;
            for t in self.row_buffers() {
                let kept = t.narrow(1, start, span)?.index_select(&idx, 1)?;
                t.slice_set(&kept, 1, start)?;
            }
            if let KeyStore::Transposed { layers, .. } = &mut self.keys {
                let stride = transposed_stride(self.capacity);
                for kt in layers.iter_mut() {
                    for col in kt.chunks_exact_mut(stride) {
                        let col = &mut col[start..];
                        // Ascending offsets, each at or after its destination: in place.
                        for (i, &r) in rows.iter().enumerate() {
                            col[i] = col[r];
                        }
                    }
                }
            }
        }
        self.len = start + rows.len();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transposed keys against the rows written (`rows[j]`: key j's `kv_heads · head_dim` values).
    fn assert_transposed_match(cache: &KvCache, layer: usize, rows: &[Vec<f32>]) {
        assert_eq!(cache.len(), rows.len());
        let Keys::Transposed(t) = cache.keys(layer) else {
            panic!("keys kept as rows");
        };
        assert!(t.stride >= cache.capacity().next_multiple_of(crate::kernels::KEY_CHUNK));
        for (j, row) in rows.iter().enumerate() {
            for (c, &x) in row.iter().enumerate() {
                assert_eq!(t.data[c * t.stride + j], x, "key {j}, column {c}");
            }
        }
    }

    /// Blocks written, a tree's rows kept out of order of their slots, the buffers grown: the transposed
    /// keys follow the row-major ones through each.
    #[test]
    fn transposed_keys_follow_writes_keeps_and_growth() {
        let (layers, kvh, hd) = (2, 3, 4);
        let mut cache = KvCache::new(layers, 10, kvh, hd, DType::F32, &Device::Cpu, true).unwrap();
        // Per layer, the rows the cache should hold.
        let mut shadow: Vec<Vec<Vec<f32>>> = vec![Vec::new(); layers];
        let mut next = 0.0f32;
        let mut write = |cache: &mut KvCache, shadow: &mut Vec<Vec<Vec<f32>>>, rows: usize| {
            for (l, held) in shadow.iter_mut().enumerate() {
                let v: Vec<f32> = (0..rows * kvh * hd)
                    .map(|_| {
                        next += 1.0;
                        next
                    })
                    .collect();
                held.extend(v.chunks(kvh * hd).map(<[f32]>::to_vec));
                let k = Tensor::from_vec(v, (1, rows, kvh, hd), &Device::Cpu).unwrap();
                let values = cache.write(l, &k, &k).unwrap();
                assert_eq!(values.dim(1).unwrap(), held.len());
            }
            cache.advance(rows);
        };
        write(&mut cache, &mut shadow, 4);
        write(&mut cache, &mut shadow, 3);
        (0..layers).for_each(|l| assert_transposed_match(&cache, l, &shadow[l]));
        // Of the 3 rows from 4, keep offsets 0 and 2 (a tree's root and accepted node).
        cache.keep(4, &[0, 2]).unwrap();
        for held in shadow.iter_mut() {
            held.remove(5);
        }
        (0..layers).for_each(|l| assert_transposed_match(&cache, l, &shadow[l]));
        cache.reserve(100).unwrap();
        (0..layers).for_each(|l| assert_transposed_match(&cache, l, &shadow[l]));
        write(&mut cache, &mut shadow, 5);
        (0..layers).for_each(|l| assert_transposed_match(&cache, l, &shadow[l]));
        let rows = KvCache::new(1, 4, 1, 4, DType::F32, &Device::Cpu, false).unwrap();
        assert!(matches!(rows.keys(0), Keys::Rows(_)));
    }
}
