//! Where a problem's numbers lie: its sizes ([`Shape`]), the keys a unit reads ([`KeyLayout`],
//! [`KeyList`]) and the values ([`Values`]). Plain data the driver, the scoring, the merging and the ISA
//! variants all read.

use super::{KvElement, KEY_CHUNK};
use crate::kernels::prefetch_l1;

/// An attention problem's sizes ([`super::problem::Problem`]'s).
#[derive(Clone, Copy)]
pub(super) struct Shape {
    pub(super) rows: usize,
    pub(super) keys: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) hd: usize,
    pub(super) row_stride: usize,
}

/// Keys ahead whose rows (one head's part) are asked for while keys are transposed and values summed:
/// a head's part of a cached row is a few cache lines at a stride of all heads, which the hardware
/// prefetcher followed too late.
pub(super) const PREFETCH_KEYS: usize = 16;

/// Where a chunk of keys lies in the keys a unit scores: the caller's [`TransposedKeys`](super::TransposedKeys) (chunks of
/// `[hd][KEY_CHUNK]`), or a unit's own transposed rows (`[hd][ks]`).
#[derive(Clone, Copy)]
pub(super) enum KeyLayout {
    Chunks {
        hd: usize,
    },
    /// Keys `from ..` as rows of `ks`.
    Rows {
        ks: usize,
        from: usize,
    },
}

impl KeyLayout {
    /// The offset of key `j0`'s first value (`j0` a multiple of [`KEY_CHUNK`]) and the distance
    /// between its chunk's rows.
    #[inline(always)]
    pub(super) fn chunk(self, j0: usize) -> (usize, usize) {
        match self {
            KeyLayout::Chunks { hd } => (j0 / KEY_CHUNK * hd * KEY_CHUNK, KEY_CHUNK),
            KeyLayout::Rows { ks, from } => (j0 - from, ks),
        }
    }
}

/// Keys of a visible list in order: a run of consecutive keys, read without a list, or listed ones.
pub(super) trait KeyList: Clone {
    fn len(&self) -> usize;
    /// The `t`-th key (`t < len`).
    fn key(&self, t: usize) -> usize;
}

/// The keys `start .. end`.
#[derive(Clone)]
pub(super) struct KeyRun(pub(super) std::ops::Range<usize>);

impl KeyList for KeyRun {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn key(&self, t: usize) -> usize {
        self.0.start + t
    }
}

impl KeyList for &[u32] {
    fn len(&self) -> usize {
        <[u32]>::len(self)
    }
    fn key(&self, t: usize) -> usize {
        self[t] as usize
    }
}

/// The cached values of a problem: row `j`'s values of key/value head `kvh` start at
/// `j · row_stride + hd · kvh`.
#[derive(Clone, Copy)]
pub(super) struct Values<'a, E> {
    pub(super) vd: &'a [E],
    pub(super) row_stride: usize,
    pub(super) hd: usize,
}

impl<E: KvElement> Values<'_, E> {
    /// Where value `d0` of key `j`, key/value head `kvh`, lies in `vd`.
    #[inline(always)]
    pub(super) fn at(&self, j: usize, kvh: usize, d0: usize) -> usize {
        j * self.row_stride + self.hd * kvh + d0
    }

    /// Asks for the `n` values from `d0` of the key [`PREFETCH_KEYS`] after the `t`-th of `keys`, if any.
    #[inline(always)]
    pub(super) fn prefetch<K: KeyList>(&self, keys: &K, t: usize, kvh: usize, d0: usize, n: usize) {
        if t + PREFETCH_KEYS < keys.len() {
            let ahead = self.at(keys.key(t + PREFETCH_KEYS), kvh, d0);
            prefetch_l1(self.vd.as_ptr().wrapping_add(ahead).cast(), size_of::<E>() * n);
        }
    }
}
