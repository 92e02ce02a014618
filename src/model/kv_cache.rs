//! Preallocated key/value cache: one `[1, capacity, kv_heads, head_dim]` buffer per layer for keys and one
//! for values, written in place. Speculative steps append a whole block, then keep only the accepted rows.
//!
//! For the CPU kernels the keys are kept transposed instead ([`TransposedKeys`]), as the attention
//! kernel scores them: laid out once when written rather than on every step; and keys and values may be
//! kept in bf16 ([`crate::kernels::attention::KvElement`]), rounded once when written.

use crate::kernels::{transposed_key_index, Keys, TransposedKeys, KEY_CHUNK};
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
    /// Transposed, for the CPU kernels: f32, or bf16 beside bf16 values.
    Transposed(Transposed<f32>),
    TransposedBf16(Transposed<half::bf16>),
}

/// Per layer the keys as [`TransposedKeys`] lay them out, for `stride = transposed_stride(capacity)`.
struct Transposed<T> {
    layers: Vec<Vec<T>>,
    kv_heads: usize,
    head_dim: usize,
}

impl<T: Copy + Default> Transposed<T> {
    fn new(num_layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        let len = kv_heads * head_dim * transposed_stride(capacity);
        Transposed {
            layers: vec![vec![T::default(); len]; num_layers],
            kv_heads,
            head_dim,
        }
    }

    /// Where each of a key's `kv_heads · head_dim` values starts, less the key's own offset
    /// ([`Transposed::key_offset`]): value `c` of key `j` lies at `starts[c] + key_offset(j)`.
    fn value_starts(&self, stride: usize) -> impl Iterator<Item = usize> + use<T> {
        let (heads, hd) = (self.kv_heads, self.head_dim);
        (0..heads).flat_map(move |h| (0..hd).map(move |d| transposed_key_index(hd, stride, h, d, 0)))
    }

    /// Key `j`'s offset from its value 0's place in [`Transposed::value_starts`].
    fn key_offset(&self, j: usize) -> usize {
        transposed_key_index(self.head_dim, 0, 0, 0, j)
    }

    /// Re-laid out for `capacity` keys, keeping what was there: each head's chunks keep their places.
    fn grow(&mut self, old: usize, capacity: usize) {
        let (old, new) = (transposed_stride(old), transposed_stride(capacity));
        let head = |stride: usize| self.head_dim * stride;
        for kt in self.layers.iter_mut() {
            let mut grown = vec![T::default(); self.kv_heads * head(new)];
            // (A cache made empty has nothing to keep.)
            if old > 0 {
                for (to, from) in grown.chunks_exact_mut(head(new)).zip(kt.chunks_exact(head(old))) {
                    to[..from.len()].copy_from_slice(from);
                }
            }
            *kt = grown;
        }
    }

    /// Keys `k` (rows of `kv_heads · head_dim` values) written from key `at` of `layer`, each converted
    /// by `to`.
    fn write(&mut self, layer: usize, capacity: usize, at: usize, k: &[f32], to: impl Fn(f32) -> T) {
        let stride = transposed_stride(capacity);
        let (heads, hd) = (self.kv_heads, self.head_dim);
        let data = &mut self.layers[layer];
        for (r, row) in k.chunks_exact(heads * hd).enumerate() {
            for (h, head) in row.chunks_exact(hd).enumerate() {
                // Value d of the head lies KEY_CHUNK after value d - 1.
                let first = transposed_key_index(hd, stride, h, 0, at + r);
                for (d, &x) in head.iter().enumerate() {
                    data[first + d * KEY_CHUNK] = to(x);
                }
            }
        }
    }

    /// [`KvCache::keep`] on the transposed keys.
    fn keep(&mut self, capacity: usize, start: usize, rows: &[usize]) {
        let stride = transposed_stride(capacity);
        let moves: Vec<(usize, usize)> = (rows.iter().enumerate())
            .map(|(i, &r)| (self.key_offset(start + r), self.key_offset(start + i)))
            .collect();
        for l in 0..self.layers.len() {
            for c in self.value_starts(stride) {
                let kt = &mut self.layers[l];
                // Ascending offsets, each at or after its destination: in place.
                for &(from, to) in &moves {
                    kt[c + to] = kt[c + from];
                }
            }
        }
    }

    fn keys(&self, layer: usize, capacity: usize) -> TransposedKeys<'_, T> {
        TransposedKeys {
            data: &self.layers[layer],
            stride: transposed_stride(capacity),
        }
    }
}

/// Keys a head's transposed keys have room for, for `capacity`: whole chunks of the kernel's scores,
/// which read a chunk past the last key.
fn transposed_stride(capacity: usize) -> usize {
    capacity.next_multiple_of(KEY_CHUNK)
}

impl KvCache {
    /// With `transposed`, the keys are kept only as the CPU kernels read them (`dtype` f32 or bf16).
    pub fn new(
        num_layers: usize,
        capacity: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
        transposed: bool,
    ) -> Result<Self> {
        if transposed && !matches!(dtype, DType::F32 | DType::BF16) {
            bail!("transposed keys are f32 or bf16, not {dtype:?}");
        }
        let buffer = || Tensor::zeros((1, capacity, kv_heads, head_dim), dtype, device);
        let values = (0..num_layers)
            .map(|_| buffer())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let keys = if transposed && dtype == DType::BF16 {
            KeyStore::TransposedBf16(Transposed::new(num_layers, kv_heads, head_dim, capacity))
        } else if transposed {
            KeyStore::Transposed(Transposed::new(num_layers, kv_heads, head_dim, capacity))
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
            KeyStore::Transposed(_) | KeyStore::TransposedBf16(_) => &mut [],
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
        match &mut self.keys {
            KeyStore::Rows(_) => {}
            KeyStore::Transposed(t) => t.grow(self.capacity, capacity),
            KeyStore::TransposedBf16(t) => t.grow(self.capacity, capacity),
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
        if !matches!(self.keys, KeyStore::Rows(_)) {
            // Transposed keys (the CPU kernels' cache) are written from f32 rows.
            let (k, v) = (k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
            let written = crate::kernels::with_f32(&k, |k| {
                crate::kernels::with_f32(&v, |v| self.write_rows(layer, k, v))
            })???;
            return Ok(written);
        }
        let rows = k.dim(1)?;
        self.ensure_room(rows)?;
        let (len, dtype) = (self.len, self.values[layer].dtype());
        if let KeyStore::Rows(keys) = &mut self.keys {
            keys[layer].slice_set(&k.to_dtype(dtype)?, 1, len)?;
        }
        self.values[layer].slice_set(&v.to_dtype(dtype)?, 1, len)?;
        Ok(self.values[layer].narrow(1, 0, len + rows)?)
    }

    /// [`KvCache::write`] of keys and values given as f32 rows of `kv_heads · head_dim` values: the
    /// model's layers on flat buffers. The same values written.
    pub fn write_rows(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<Tensor> {
        let (_, _, heads, hd) = self.values[layer].dims4()?;
        if k.len() != v.len() || !k.len().is_multiple_of(heads * hd) {
            bail!(
                "kv cache write: {} key and {} value numbers for rows of {heads} x {hd}",
                k.len(),
                v.len()
            );
        }
        let shape = (1, k.len() / (heads * hd), heads, hd);
        let rows = |x: &[f32]| Tensor::from_slice(x, shape, &Device::Cpu);
        self.ensure_room(shape.1)?;
        let (len, capacity, dtype) = (self.len, self.capacity, self.values[layer].dtype());
        match &mut self.keys {
            KeyStore::Rows(_) => return self.write(layer, &rows(k)?, &rows(v)?),
            KeyStore::Transposed(t) => t.write(layer, capacity, len, k, |x| x),
            // Rounded to nearest, ties to even, as candle converts the values.
            KeyStore::TransposedBf16(t) => t.write(layer, capacity, len, k, half::bf16::from_f32),
        }
        let v = if dtype == DType::BF16 {
            // Rounded as the keys are (candle's conversion), without an f32 tensor first.
            let v: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
            Tensor::from_vec(v, shape, &Device::Cpu)?
        } else {
            rows(v)?.to_dtype(dtype)?
        };
        self.values[layer].slice_set(&v, 1, len)?;
        Ok(self.values[layer].narrow(1, 0, len + shape.1)?)
    }

    /// Layer `layer`'s keys up to the last [`KvCache::write`]: as rows, the whole buffer (the first
    /// rows are the written ones), or transposed.
    pub fn keys(&self, layer: usize) -> Keys<'_> {
        match &self.keys {
            KeyStore::Rows(keys) => Keys::Rows(&keys[layer]),
            KeyStore::Transposed(t) => Keys::Transposed(t.keys(layer, self.capacity)),
            KeyStore::TransposedBf16(t) => Keys::TransposedBf16(t.keys(layer, self.capacity)),
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
            match &mut self.keys {
                KeyStore::Rows(_) => {}
                KeyStore::Transposed(t) => t.keep(self.capacity, start, rows),
                KeyStore::TransposedBf16(t) => t.keep(self.capacity, start, rows),
            }
        }
        self.len = start + rows.len();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transposed keys against the rows written (`rows[j]`: key j's `kv_heads · head_dim` values),
    /// in f32 or rounded to bf16 as the cache holds them.
    fn assert_transposed_match(cache: &KvCache, layer: usize, rows: &[Vec<f32>]) {
        assert_eq!(cache.len(), rows.len());
        let (stride, key): (usize, Box<dyn Fn(usize) -> f32>) = match cache.keys(layer) {
            Keys::Transposed(t) => (t.stride, Box::new(move |i| t.data[i])),
            Keys::TransposedBf16(t) => (t.stride, Box::new(move |i| t.data[i].to_f32())),
            Keys::Rows(_) => panic!("keys kept as rows"),
        };
        assert!(stride >= cache.capacity() && stride.is_multiple_of(KEY_CHUNK));
        // 3 key/value heads (`transposed_keys_follow`).
        let hd = rows[0].len() / 3;
        for (j, row) in rows.iter().enumerate() {
            for (c, &x) in row.iter().enumerate() {
                let want = match cache.keys(layer) {
                    Keys::TransposedBf16(_) => half::bf16::from_f32(x).to_f32(),
                    _ => x,
                };
                assert_eq!(
                    key(transposed_key_index(hd, stride, c / hd, c % hd, j)).to_bits(),
                    want.to_bits(),
                    "key {j}, column {c}"
                );
            }
        }
    }

    /// Blocks written, a tree's rows kept out of order of their slots, the buffers grown: the transposed
    /// keys follow the row-major ones through each.
    #[test]
    fn transposed_keys_follow_writes_keeps_and_growth() {
        for dtype in [DType::F32, DType::BF16] {
            transposed_keys_follow(dtype);
        }
        // Made empty, then grown (as a generation reserves its room).
        let mut empty = KvCache::new(1, 0, 2, 4, DType::F32, &Device::Cpu, true).unwrap();
        empty.reserve(70).unwrap();
        assert_eq!(empty.capacity(), 70);
        let rows = KvCache::new(1, 4, 1, 4, DType::F32, &Device::Cpu, false).unwrap();
        assert!(matches!(rows.keys(0), Keys::Rows(_)));
        assert!(KvCache::new(1, 4, 1, 4, DType::F16, &Device::Cpu, true).is_err());
    }

    /// Blocks written, a tree's rows kept out of order of their slots, the buffers grown, in a `dtype`
    /// cache: the transposed keys follow the rows written, and the values are those rows in `dtype`.
    fn transposed_keys_follow(dtype: DType) {
        let (layers, kvh, hd) = (2, 3, 4);
        let mut cache = KvCache::new(layers, 10, kvh, hd, dtype, &Device::Cpu, true).unwrap();
        // Per layer, the rows the cache should hold.
        let mut shadow: Vec<Vec<Vec<f32>>> = vec![Vec::new(); layers];
        // Values with more bits than bf16 keeps (257 and up), so that rounding shows.
        let mut next = 256.0f32;
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
                assert_eq!(values.dtype(), dtype);
                let want = Tensor::from_vec(held.concat(), (1, held.len(), kvh, hd), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let bits = |t: &Tensor| {
                    t.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                };
                assert_eq!(bits(&values), bits(&want), "layer {l}'s values");
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
    }
}
