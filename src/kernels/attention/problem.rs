//! The problem driver: one attention problem ([`Problem`]) cut into units of (key/value head, tile of
//! query rows, segment) run on the kernel pool, and a unit's steps 1-5 (scores, softmax weights and
//! the weighted sums of the values) over its segment.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::layout::{KeyLayout, KeyList, KeyRun, Shape, Values};
use super::score::{exp_nonpositive, lane_max, lane_sum, score_all};
use super::segments::{merge, Partials, Slots, VisibleLists, SPLIT_BYTES};
use super::{KvElement, TransposedKeys, Visibility, Width, KEY_CHUNK, SEGMENT};
use crate::kernels::pool::{Pool, SharedMut};

/// (Row, head) slots accumulated together in step 5 (64 head dimensions at a time): 4 x 64 f32
/// accumulators fill 16 of AVX-512's 32 vector registers. (AVX2: [`avx2`].)
const VALUE_SLOTS: usize = 4;

/// Rows of a tile at most. A tile scores every key that its last row sees for each of its rows, and
/// its rows' keys past the tile's first row are summed per row, not shared: a long causal prefill cut
/// in few tiles spent most of its attention there.
pub(super) const MAX_TILE_ROWS: usize = 32;

/// One attention problem, cut into units of (key/value head, tile of query rows, segment).
pub(super) struct Problem<'a, E> {
    qv: &'a [f32],
    keys_in: KeyData<'a, E>,
    pub(super) vd: &'a [E],
    vis: Visibility<'a>,
    lists: VisibleLists,
    scale: f32,
    pub(super) shape: Shape,
    tile: usize,
    pub(super) segments: usize,
    /// With more than one segment: whether each segment is a unit of its own ([`SPLIT_BYTES`]), and
    /// then where they leave their results for step 6; else a unit takes its segments in turn and keeps
    /// their results in its own scratch.
    split: Option<Partials<'a>>,
}

/// The keys as the kernel reads them.
#[derive(Clone, Copy)]
pub(super) enum KeyData<'a, E> {
    /// Row-major like the values (`row_stride` apart), f32: each unit transposes its own.
    Rows(&'a [f32]),
    /// Already transposed by the caller.
    Transposed(TransposedKeys<'a, E>),
}

/// Per-unit buffers.
#[derive(Default)]
struct Scratch {
    /// `[hd][kp]`: the unit's keys transposed, `kp` = keys rounded up to a whole chunk.
    kt: Vec<f32>,
    /// Scores of one (row, head) over the unit's keys.
    scores: Vec<f32>,
    /// Per row `ri` of the tile, its part of the unit's segment: the keys `lo .. run_end[ri]` of its
    /// leading run, then `lists.listed[listed[ri]]`; per (row, head) slot its `p_t` (from
    /// `p_start[slot]`, one per key of the part) and the factor of its sums (`1 / Σ p_t`, or 1 where
    /// step 6 scales them).
    run_end: Vec<usize>,
    listed: Vec<std::ops::Range<usize>>,
    p: Vec<f32>,
    p_start: Vec<usize>,
    inv: Vec<f32>,
    /// A unit's own segments' results ([`Slots`]), when it takes them in turn.
    seg_o: Vec<f32>,
    seg_stats: Vec<f32>,
}

impl<E: KvElement> Problem<'_, E> {
    fn tiles(&self) -> usize {
        self.shape.rows.div_ceil(self.tile)
    }

    fn units(&self) -> usize {
        let segments = if self.split.is_some() { self.segments } else { 1 };
        self.shape.kv_heads * self.tiles() * segments
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn unit_512(&self, u: usize, s: &mut Scratch, out: &SharedMut<f32>) {
        self.unit(Width::W512, u, s, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn unit_256(&self, u: usize, s: &mut Scratch, out: &SharedMut<f32>) {
        self.unit(Width::W256, u, s, out)
    }

    fn unit_with(&self, width: Width, u: usize, s: &mut Scratch, out: &SharedMut<f32>) {
        match width {
            // SAFETY: `attention_f32_with` checked that the CPU has the width.
            #[cfg(target_arch = "x86_64")]
            Width::W512 => unsafe { self.unit_512(u, s, out) },
            #[cfg(target_arch = "x86_64")]
            Width::W256 => unsafe { self.unit_256(u, s, out) },
            _ => self.unit(Width::Portable, u, s, out),
        }
    }

    /// Unit `u`: key/value head `u % kv_heads`, the query rows of tile `u / kv_heads % tiles`, every
    /// query head of the group, and segment `u / (kv_heads · tiles)` when segments are split, else
    /// every segment in turn. Writes those rows' outputs of those heads, or a segment's part of them,
    /// merged by the last unit of the (key/value head, tile) to finish.
    #[inline(always)]
    fn unit(&self, width: Width, u: usize, s: &mut Scratch, out: &SharedMut<f32>) {
        let (kv_heads, per_segment) = (self.shape.kv_heads, self.shape.kv_heads * self.tiles());
        let (seg, tile_id) = (u / per_segment, u % per_segment);
        let (kvh, t) = (tile_id % kv_heads, tile_id / kv_heads);
        let rows = t * self.tile..((t + 1) * self.tile).min(self.shape.rows);
        let (heads, group) = (self.shape.heads, self.shape.heads / kv_heads);
        if self.segments == 1 {
            let direct = Slots {
                o: out,
                stats: None,
                base: rows.start * heads + kvh * group,
                per_row: heads,
            };
            return self.segment(width, 0, kvh, rows, s, direct);
        }
        if let Some(part) = &self.split {
            let row0 = rows.start;
            let slots = move |k: usize| Slots {
                o: &part.o,
                stats: Some(&part.stats),
                base: (k * self.shape.rows + row0) * heads + kvh * group,
                per_row: heads,
            };
            self.segment(width, seg, kvh, rows.clone(), s, slots(seg));
            // AcqRel: this unit's results are published, and the last one sees every other's.
            use std::sync::atomic::Ordering::AcqRel;
            if part.done[tile_id].fetch_add(1, AcqRel) + 1 == self.segments {
                merge(&self.shape, self.segments, kvh, rows, slots, out);
            }
            return;
        }
        let (mut o, mut stats) = (std::mem::take(&mut s.seg_o), std::mem::take(&mut s.seg_stats));
        let per_segment = rows.len() * group;
        o.resize(self.segments * per_segment * self.shape.hd, 0.0);
        stats.clear();
        stats.resize(2 * self.segments * per_segment, f32::NEG_INFINITY);
        {
            let (o, stats) = (SharedMut::new(&mut o), SharedMut::new(&mut stats));
            let slots = |k: usize| Slots {
                o: &o,
                stats: Some(&stats),
                base: k * per_segment,
                per_row: group,
            };
            for k in 0..self.segments {
                self.segment(width, k, kvh, rows.clone(), s, slots(k));
            }
            merge(&self.shape, self.segments, kvh, rows, slots, out);
        }
        (s.seg_o, s.seg_stats) = (o, stats);
    }

    /// Steps 1-5 for segment `seg` of the given rows' lists, for the query heads of key/value head
    /// `kvh`, the results left in `dst`.
    #[inline(always)]
    fn segment(
        &self,
        width: Width,
        seg: usize,
        kvh: usize,
        rows: std::ops::Range<usize>,
        s: &mut Scratch,
        dst: Slots,
    ) {
        let (hd, keys, heads) = (self.shape.hd, self.shape.keys, self.shape.heads);
        let group = heads / self.shape.kv_heads;
        let lists = &self.lists;
        // Each row's part of the segment (visible positions lo .. lo + SEGMENT): the keys lo .. run_end
        // of its leading run, then listed keys; every key a part takes lies in lo .. hi.
        let lo = seg * SEGMENT;
        let mut hi = lo;
        s.run_end.clear();
        s.listed.clear();
        for r in rows.clone() {
            let (lead, at, count) = (lists.lead[r], lists.starts[r], lists.segments(r));
            // The row's visible positions lo .. end.
            let end = match seg + 1 {
                k if k < count => lo + SEGMENT,
                k if k == count => lists.len(r),
                _ => lo,
            };
            let (run_end, listed) = if end > lo {
                (
                    end.min(lead).max(lo),
                    at + lo.max(lead) - lead..at + end.max(lead) - lead,
                )
            } else {
                (lo, at..at)
            };
            hi = hi.max(match lists.listed[listed.clone()].last() {
                Some(&j) => j as usize + 1,
                None => run_end,
            });
            s.run_end.push(run_end);
            s.listed.push(listed);
        }
        if hi == lo {
            return; // no row of the tile sees this far
        }
        let kp = (hi - lo).next_multiple_of(KEY_CHUNK);
        // Every (row, head) of the unit is scored chunk by chunk, while the chunk's keys sit in L1.
        let slots = rows.len() * group;
        if s.scores.len() < slots * kp {
            s.scores.resize(slots * kp, 0.0);
        }
        let q = |slot: usize| {
            let (r, g) = (rows.start + slot / group, slot % group);
            &self.qv[(r * heads + kvh * group + g) * hd..][..hd]
        };
        // This head's keys, laid out as the cache keeps them, or as this unit transposes them.
        let scores = (&mut s.scores[..], kp);
        match self.keys_in {
            KeyData::Transposed(t) => {
                let kt = &t.data[kvh * hd * t.stride..][..hd * t.stride];
                score_all(width, slots, q, (kt, KeyLayout::Chunks { hd }), lo..hi, scores)
            }
            KeyData::Rows(kd) => {
                self.transpose_keys(width, kd, kvh, lo..hi, kp, &mut s.kt);
                let keys = (&s.kt[..hd * kp], KeyLayout::Rows { ks: kp, from: lo });
                score_all(width, slots, q, keys, lo..hi, scores)
            }
        }
        // Steps 2-4 for every (row, head): the weights and the factor of the sums.
        s.p.clear();
        s.p_start.clear();
        s.inv.clear();
        for (ri, r) in rows.clone().enumerate() {
            let (run, listed) = (lo..s.run_end[ri], &lists.listed[s.listed[ri].clone()]);
            for g in 0..group {
                let scores = &s.scores[(ri * group + g) * kp..][..kp];
                let p0 = s.p.len();
                s.p_start.push(p0);
                match self.vis {
                    Visibility::Causal { .. } => {
                        s.p.extend(scores[..run.len()].iter().map(|&x| x * self.scale))
                    }
                    Visibility::Additive(m) => {
                        let m = &m[r * keys..];
                        let run = scores[..run.len()].iter().zip(&m[run.clone()]);
                        s.p.extend(run.map(|(&x, &b)| x * self.scale + b));
                        s.p.extend(
                            listed
                                .iter()
                                .map(|&j| scores[j as usize - lo] * self.scale + m[j as usize]),
                        )
                    }
                }
                let p = &mut s.p[p0..];
                let max = lane_max(p);
                for x in p.iter_mut() {
                    *x = exp_nonpositive(*x - max);
                }
                let sum = if p.is_empty() { 0.0 } else { lane_sum(p) };
                s.inv.push(match dst.stats {
                    None if p.is_empty() => 0.0,
                    None => 1.0 / sum,
                    Some(stats) => {
                        if !p.is_empty() {
                            // SAFETY: this (segment, row, head) is this unit's alone.
                            let at = 2 * dst.slot(ri, g);
                            unsafe { stats.range(at, 2) }.copy_from_slice(&[max, sum]);
                        }
                        1.0
                    }
                });
            }
        }
        // Step 5 for the tile's (row, head) slots, a few at a time. The keys lo .. shared lead every
        // row's part (in a block over a cache, the cached keys): one pass over their values serves
        // every slot.
        let shared = lo..s.run_end.iter().copied().min().unwrap_or(lo);
        // AVX2's 16 registers hold 8 sums beside the loaded values: two slots of 32 dimensions, or one
        // of 64 ([`avx2`]).
        let avx2 = width == Width::W256;
        let mut slot0 = 0;
        while slot0 < slots {
            let n = (slots - slot0).min(if avx2 { 2 } else { VALUE_SLOTS });
            let (w, sh) = (width, shared.clone());
            match (n, avx2) {
                (1, _) => self.weighted_values::<1, 64>(w, kvh, slot0, sh, s, dst),
                (2, true) => self.weighted_values::<2, 32>(w, kvh, slot0, sh, s, dst),
                (2, _) => self.weighted_values::<2, 64>(w, kvh, slot0, sh, s, dst),
                (3, _) => self.weighted_values::<3, 64>(w, kvh, slot0, sh, s, dst),
                _ => self.weighted_values::<4, 64>(w, kvh, slot0, sh, s, dst),
            }
            slot0 += n;
        }
    }

    /// Step 5 for the N (row, head) slots from `slot0` of the unit's tile (slot `ri · group + g`):
    /// `o = (Σ_t p_t · v_{key(t)}) · inv`, one fused multiply-add chain per output element in visible
    /// order, then one multiply, written to its slot of `dst`. The `shared` keys lead every slot's part,
    /// so their values are read once for all N; each slot then continues its own chain over the rest
    /// of its run and then its listed keys.
    #[inline(always)]
    fn weighted_values<const N: usize, const D: usize>(
        &self,
        width: Width,
        kvh: usize,
        slot0: usize,
        shared: std::ops::Range<usize>,
        s: &Scratch,
        dst: Slots,
    ) {
        let (hd, group) = (self.shape.hd, self.shape.heads / self.shape.kv_heads);
        let ri = |i: usize| (slot0 + i) / group;
        let run_end = |i: usize| s.run_end[ri(i)];
        let listed = |i: usize| &self.lists.listed[s.listed[ri(i)].clone()];
        let p: [&[f32]; N] = std::array::from_fn(|i| {
            let start = s.p_start[slot0 + i];
            &s.p[start..start + run_end(i) - shared.start + listed(i).len()]
        });
        for d0 in (0..hd).step_by(D) {
            let n = D.min(hd - d0);
            let mut acc = [[0.0f32; D]; N];
            let first = slot0 == 0;
            let run = KeyRun(shared.clone());
            self.accumulate::<N, D, _>(width, kvh, run, p, d0, n, first, &mut acc);
            for (i, a) in acc.iter_mut().enumerate() {
                let one: &mut [[f32; D]; 1] = std::slice::from_mut(a).try_into().unwrap();
                let (run, pi) = (KeyRun(shared.end..run_end(i)), &p[i][shared.len()..]);
                self.accumulate::<1, D, _>(width, kvh, run.clone(), [pi], d0, n, false, one);
                let rest = [&pi[run.len()..]];
                self.accumulate::<1, D, _>(width, kvh, listed(i), rest, d0, n, false, one);
                // SAFETY: the slot is written by this unit only.
                let o = unsafe { dst.o.range(dst.slot(ri(i), (slot0 + i) % group) * hd + d0, n) };
                let inv = s.inv[slot0 + i];
                for (x, &y) in o.iter_mut().zip(&a[..n]) {
                    *x = y * inv;
                }
            }
        }
    }

    /// `acc_i += Σ_t p_i[t] · v_{keys[t]}[d0 .. d0 + n]` for each slot i, key by key (`n <= D`);
    /// with `prefetch`, the values [`PREFETCH_KEYS`](super::layout::PREFETCH_KEYS) keys ahead are asked for (the first pass of a tile
    /// over its keys: the later ones find them in the caches). A whole chunk is compiled at its constant
    /// width, so that its accumulators stay in registers.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // the accumulators' inputs, kept apart so that widths stay constant
    fn accumulate<const N: usize, const D: usize, K: KeyList>(
        &self,
        width: Width,
        kvh: usize,
        keys: K,
        p: [&[f32]; N],
        d0: usize,
        n: usize,
        prefetch: bool,
        acc: &mut [[f32; D]; N],
    ) {
        #[cfg(target_arch = "x86_64")]
        if width == Width::W256 && n == D {
            let sums = acc.as_mut_ptr().cast::<f32>();
            // SAFETY: W256 runs only where the CPU has AVX2 and FMA (`attention_with` checks); `sums`
            // holds N · D values, 8 V a slot.
            match (N, D) {
                (2, 32) => {
                    return unsafe {
                        avx2::accumulate::<2, 4, _, _>(
                            self.values(),
                            kvh,
                            keys,
                            p[..2].try_into().unwrap(),
                            d0,
                            prefetch,
                            sums,
                        )
                    }
                }
                (1, 64) => {
                    return unsafe {
                        avx2::accumulate::<1, 8, _, _>(self.values(), kvh, keys, [p[0]], d0, prefetch, sums)
                    }
                }
                _ => {}
            }
        }
        let _ = width;
        if n == D {
            self.accumulate_n::<N, D, K>(kvh, keys, p, d0, D, prefetch, acc)
        } else {
            self.accumulate_n::<N, D, K>(kvh, keys, p, d0, n, prefetch, acc)
        }
    }

    /// The cached values as the accumulation reads them.
    #[inline(always)]
    pub(super) fn values(&self) -> Values<'_, E> {
        Values {
            vd: self.vd,
            row_stride: self.shape.row_stride,
            hd: self.shape.hd,
        }
    }

    /// Where value `d0` of key `j`, key/value head `kvh`, lies in `vd`.
    #[inline(always)]
    pub(super) fn value_at(&self, j: usize, kvh: usize, d0: usize) -> usize {
        self.values().at(j, kvh, d0)
    }

    /// Asks for the `n` values from `d0` of the key [`PREFETCH_KEYS`](super::layout::PREFETCH_KEYS) after the `t`-th of `keys`, if any.
    #[inline(always)]
    pub(super) fn prefetch_values<K: KeyList>(&self, keys: &K, t: usize, kvh: usize, d0: usize, n: usize) {
        self.values().prefetch(keys, t, kvh, d0, n)
    }

    /// [`Problem::accumulate`] at width `n`: a method, not a closure inside it, since a closure does not
    /// inherit the caller's target features (its `mul_add`s became calls, many times slower).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn accumulate_n<const N: usize, const D: usize, K: KeyList>(
        &self,
        kvh: usize,
        keys: K,
        p: [&[f32]; N],
        d0: usize,
        n: usize,
        prefetch: bool,
        acc: &mut [[f32; D]; N],
    ) {
        // A local copy, so that the accumulators stay in registers (a store through `acc` would be
        // observable if a bounds check panicked); `p` cut to the keys so that its checks go.
        let mut local = *acc;
        let len = keys.len();
        let p: [&[f32]; N] = p.map(|pi| &pi[..len]);
        for t in 0..len {
            if prefetch {
                self.prefetch_values(&keys, t, kvh, d0, n);
            }
            let v = &self.vd[self.value_at(keys.key(t), kvh, d0)..][..n];
            for (a, pi) in local.iter_mut().zip(&p) {
                let pt = pi[t];
                for l in 0..n {
                    a[l] = pt.mul_add(v[l].to_f32(), a[l]);
                }
            }
        }
        *acc = local;
    }
}

/// The problem's units on the kernel pool: `[rows, heads · hd]` outputs.
pub(super) fn run<E: KvElement>(
    width: Width,
    qv: &[f32],
    keys_in: KeyData<'_, E>,
    vd: &[E],
    vis: Visibility,
    scale: f32,
    shape: Shape,
) -> Vec<f32> {
    let Shape {
        rows,
        heads,
        kv_heads,
        hd,
        ..
    } = shape;
    let mut out = vec![0.0f32; rows * heads * hd];
    let pool = Pool::global();
    // Row tiles of at least 4 rows (each tile transposes its keys again), as many as give a few units
    // per thread to balance, and of at most MAX_TILE_ROWS.
    let tiles = (2 * pool.threads())
        .div_ceil(kv_heads)
        .clamp(1, (rows / 4).max(1))
        .max(rows.div_ceil(MAX_TILE_ROWS));
    let tile = rows.div_ceil(tiles).max(1);
    let lists = VisibleLists::new(vis, rows, shape.keys);
    let segments = (0..rows).map(|r| lists.segments(r)).max().unwrap_or(1);
    // Segments are units of their own, sharing the threads, where their results are few: then step
    // 6's inputs have a buffer of their own per segment.
    let slots = segments * rows * heads;
    let split = segments > 1 && slots * (hd + 2) * size_of::<f32>() <= SPLIT_BYTES;
    let (mut partial_o, mut stats) = if split {
        (vec![0.0f32; slots * hd], vec![f32::NEG_INFINITY; 2 * slots])
    } else {
        (Vec::new(), Vec::new())
    };
    let split = split.then(|| Partials {
        o: SharedMut::new(&mut partial_o),
        stats: SharedMut::new(&mut stats),
        done: (0..kv_heads * rows.div_ceil(tile))
            .map(|_| Default::default())
            .collect(),
    });
    let problem = Problem {
        qv,
        keys_in,
        vd,
        vis,
        lists,
        scale,
        shape,
        tile,
        segments,
        split,
    };
    let shared = SharedMut::new(&mut out);
    pool.run(problem.units(), &|u| {
        thread_local! {
            static SCRATCH: std::cell::RefCell<Scratch> = Default::default();
        }
        SCRATCH.with(|s| problem.unit_with(width, u, &mut s.borrow_mut(), &shared));
    });
    out
}
