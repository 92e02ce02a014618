//! Row-invariant attention for f32 on the CPU, with an arbitrary additive mask.
//!
//! # The per-row recipe
//! A query row sees some keys (a causal prefix, or a tree's prefix + ancestors); call them, in cache
//! order, its *visible list*. For each head:
//! 1. every score is `dot(q, k_j) · scale + bias_j`, the dot product one chain of fused multiply-adds
//!    over the head dimension in order (`s = fma(q_d, k_jd, s)` from 0);
//! 2. `max` over the visible scores (exact in any order);
//! 3. `p_t = exp(s_t - max)` for the t-th visible key, by one fixed polynomial (`exp_nonpositive`);
//! 4. `sum = Σ p_t` in 16 lanes by visible position (lane `t mod 16`), then a fixed tree;
//! 5. `o = Σ p_t · v_t` as one fused multiply-add chain per output element, in visible order;
//!    then `o · (1 / sum)`.
//!
//! A visible list of `n` keys is cut into `round(n / SEGMENT)` segments (at least one; [`SEGMENT`]),
//! segment `k` from visible position `k · SEGMENT`, the last one taking the rest (so it holds at least
//! half a segment). Steps 2-5 run on each segment alone, giving its maximum `m_k`, its sum `sum_k` and
//! its unscaled `o_k`. Then, with `M` the largest `m_k` and `w_k = exp(m_k - M)` (the same
//! polynomial), in segment order:
//! 6. `sum = w_0 · sum_0`, then `sum = fma(w_k, sum_k, sum)`; `o = w_0 · o_0`, then `o = fma(w_k, o_k,
//!    o)` per element; the output `o · (1 / sum)`.
//!
//! A list of one segment gives steps 1-5's bits (`w_0 = 1` exactly). Segments let one row's long
//! list be shared by several threads: a decoding step has one unit of work per key/value head, and
//! SmolLM2's three heads left one of two threads idle a third of the time.
//!
//! Every step depends only on the visible list's contents and order, never on where the keys sit in
//! the cache or what the hidden keys hold: a tree node that sees prefix + ancestors computes exactly
//! what plain decoding computes for the same token over a cache holding just those rows, which is what
//! speculative decoding's losslessness rests on. The arithmetic is scalar-exact IEEE (fused
//! multiply-adds, adds, multiplies in a fixed order), so the AVX-512, AVX2 and portable builds
//! ([`Width`]) give the same bits.
//!
//! # Speed
//! Keys are transposed once per (key/value head, tile of query rows) into `[head_dim][keys]` (or kept
//! so by the KV cache, a chunk of keys at a time: [`TransposedKeys`]), so the
//! scores of 16 keys fill one vector with no horizontal sums, and that transposed block is shared by
//! every query head of the group and every row of the tile: the query rows of a block share each key
//! read. Units of (key/value head, row tile) run on the kernel pool; where the segments' results are
//! small (decoding steps, small blocks), each segment is a unit of its own and the last unit of a
//! (key/value head, row tile) to finish merges them (step 6), else a unit takes its segments in turn.

use candle_core::{DType, Error, Result, Tensor};

/// Which keys a query row may see.
#[derive(Clone, Copy)]
pub enum Visibility<'a> {
    /// Row i sees keys 0..=offset + i.
    Causal { offset: usize },
    /// Additive mask `[rows, keys]`: 0 visible, -inf hidden (finite values are added to the score).
    Additive(&'a [f32]),
}

/// Vector lanes of the fixed sum (step 4) and of the transposed key blocks.
const LANES: usize = 16;
/// Keys scored together: 8 independent 16-lane chains hide the fused multiply-add latency.
pub const KEY_CHUNK: usize = 64;
/// Visible keys a segment of a row's list holds (the recipe's step 6): a whole number of
/// [`KEY_CHUNK`]s. SmolLM2's decoding step after 1024 tokens has 4 segments of each of its 3 key/value
/// heads to share among the threads, and the merge's cost (one multiply-add per output element and
/// segment) stays small beside the segment's `2 · SEGMENT` per element.
pub const SEGMENT: usize = 4 * KEY_CHUNK;
/// Segments are units of their own where their results for step 6 take at most this many bytes (in
/// decoding steps and small blocks; a long prefill's would be tens of MB, written and read again).
const SPLIT_BYTES: usize = 1 << 20;

/// Keys laid out as the scores read them, kept by the caller across calls (the KV cache): per key/value
/// head, per [`KEY_CHUNK`] of keys, `[head_dim][KEY_CHUNK]` ([`transposed_key_index`]), `stride` a
/// whole number of chunks at least as many as the keys (a chunk is read whole; what lies past the last
/// key is never used). A chunk is one run of memory, which the hardware prefetcher follows; as
/// `[head_dim][stride]` rows, each chunk was 64 runs a few KiB apart. `E`: f32, or bf16 beside bf16
/// values ([`KvElement`]).
#[derive(Clone, Copy)]
pub struct TransposedKeys<'a, E = f32> {
    pub data: &'a [E],
    pub stride: usize,
}

/// Where [`TransposedKeys`] keep key `j`'s value `d` of key/value head `h` (head size `hd`).
#[inline(always)]
pub fn transposed_key_index(hd: usize, stride: usize, h: usize, d: usize, j: usize) -> usize {
    h * hd * stride + (j / KEY_CHUNK) * hd * KEY_CHUNK + d * KEY_CHUNK + j % KEY_CHUNK
}

/// Where a chunk of keys lies in the keys a unit scores: the caller's [`TransposedKeys`] (chunks of
/// `[hd][KEY_CHUNK]`), or a unit's own transposed rows (`[hd][ks]`).
#[derive(Clone, Copy)]
enum KeyLayout {
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
    fn chunk(self, j0: usize) -> (usize, usize) {
        match self {
            KeyLayout::Chunks { hd } => (j0 / KEY_CHUNK * hd * KEY_CHUNK, KEY_CHUNK),
            KeyLayout::Rows { ks, from } => (j0 - from, ks),
        }
    }
}

/// What a KV cache may hold: f32, or bf16 (half the bytes, which a decoding step reads for every cached
/// token: at 1024 tokens SmolLM2's are 45 MB in f32, half its weights). The kernel reads either as f32:
/// a bf16 is the top half of an f32's bits, so the conversion is exact and the recipe above is the
/// same on the converted values (rounding to bf16 happens once, when the cache is written).
pub trait KvElement: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
}

impl KvElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvElement for half::bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // A shift, which vectorises (half's own conversion branches on NaN; this keeps a NaN a NaN).
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// (Row, head) slots accumulated together in step 5 (64 head dimensions at a time): 4 x 64 f32
/// accumulators fill 16 of AVX-512's 32 vector registers. (AVX2: [`avx2`].)
const VALUE_SLOTS: usize = 4;

/// Rows of a tile at most. A tile scores every key that its last row sees for each of its rows, and
/// its rows' keys past the tile's first row are summed per row, not shared: a causal prefill of 769
/// rows cut in two tiles spent most of its attention there (a third of the prefill's samples).
const MAX_TILE_ROWS: usize = 32;

/// Keys ahead whose rows (one head's part) are asked for while keys are transposed and values summed:
/// a head's part of a cached row is a few cache lines at a stride of all heads, which the hardware
/// prefetcher followed too late.
const PREFETCH_KEYS: usize = 16;

/// `exp(x)` for `x <= 0` (a softmax's shifted scores), to about 2 ulp: `2^n · P(r)` with `n =
/// round(x / ln 2)`, `r = x - n ln 2` in two fused steps, and a degree-6 polynomial. Values below -87
/// are taken at -87 (about 1.6e-38, beside a maximum of 1). Only fused multiply-adds, multiplies, adds
/// and integer bit operations: the same bits in every build.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer (ties to even)
    let x = x.max(-87.0);
    let t = x.mul_add(LOG2E, MAGIC);
    let n = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let nf = t - MAGIC;
    let r = nf.mul_add(-LN2_LO, nf.mul_add(-LN2_HI, x));
    let mut p: f32 = 1.0 / 720.0;
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    p * f32::from_bits(((n + 127) as u32) << 23)
}

/// The largest of `x` (NEG_INFINITY when empty), in 16 independent lanes: a maximum is exact in any
/// order, and one running maximum would be a chain of dependent compares.
#[inline(always)]
pub(crate) fn lane_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        acc[l] = if v > acc[l] { v } else { acc[l] };
    }
    acc.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// `Σ x` in 16 lanes by position, then a fixed tree (step 4).
#[inline(always)]
fn lane_sum(x: &[f32]) -> f32 {
    lane_sum_by(x, |v| v)
}

/// `Σ f(x)` in 16 lanes by position, then a fixed tree: vectorises, and the same bits at every width.
#[inline(always)]
pub(crate) fn lane_sum_by(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += f(c[l]);
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        acc[l] += f(v);
    }
    let v8: [f32; 8] = std::array::from_fn(|i| acc[i] + acc[i + 8]);
    let v4: [f32; 4] = std::array::from_fn(|i| v8[i] + v8[i + 4]);
    (v4[0] + v4[2]) + (v4[1] + v4[3])
}

/// The vector width the loops are compiled for, chosen at run time. Only the width differs (see the
/// module's recipe); every width gives the same result.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Width {
    /// AVX-512 with FMA.
    W512,
    /// AVX2 with FMA.
    W256,
    /// Whatever the compile target gives (NEON on aarch64; `mul_add` is a library call on an x86 CPU
    /// without FMA).
    Portable,
}

impl Width {
    pub const ALL: [Width; 3] = [Width::W512, Width::W256, Width::Portable];

    pub fn available(self) -> bool {
        match self {
            // The features the width's code is built with (`avx512f,avx512vl,avx2,fma` / `avx2,fma`),
            // as the matrix kernels detect them.
            #[cfg(target_arch = "x86_64")]
            Width::W512 => super::Isa::Avx512.available(),
            #[cfg(target_arch = "x86_64")]
            Width::W256 => super::Isa::Avx2.available(),
            Width::Portable => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The widest this CPU has.
    pub fn best() -> Width {
        static BEST: std::sync::OnceLock<Width> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Width::ALL.into_iter().find(|w| w.available()).unwrap())
    }
}

/// One attention problem, cut into units of (key/value head, tile of query rows, segment).
struct Problem<'a, E> {
    qv: &'a [f32],
    keys_in: KeyData<'a, E>,
    vd: &'a [E],
    vis: Visibility<'a>,
    lists: VisibleLists,
    scale: f32,
    shape: Shape,
    tile: usize,
    segments: usize,
    /// With more than one segment: whether each segment is a unit of its own ([`SPLIT_BYTES`]), and
    /// then where they leave their results for step 6; else a unit takes its segments in turn and keeps
    /// their results in its own scratch.
    split: Option<Partials<'a>>,
}

/// The keys as the kernel reads them.
#[derive(Clone, Copy)]
enum KeyData<'a, E> {
    /// Row-major like the values (`row_stride` apart), f32: each unit transposes its own.
    Rows(&'a [f32]),
    /// Already transposed by the caller.
    Transposed(TransposedKeys<'a, E>),
}

/// Every row's visible list: its leading run of keys `0 .. lead[r]` (all of a causal row's keys, the
/// whole cache for a tree's row), then the keys listed at `listed[starts[r] .. starts[r + 1]]`.
struct VisibleLists {
    lead: Vec<usize>,
    listed: Vec<u32>,
    starts: Vec<usize>,
}

impl VisibleLists {
    fn new(vis: Visibility, rows: usize, keys: usize) -> Self {
        let mut lists = VisibleLists {
            lead: Vec::with_capacity(rows),
            listed: Vec::new(),
            starts: Vec::with_capacity(rows + 1),
        };
        lists.starts.push(0);
        for r in 0..rows {
            let lead = match vis {
                Visibility::Causal { offset } => (offset + r + 1).min(keys),
                Visibility::Additive(m) => {
                    let m = &m[r * keys..(r + 1) * keys];
                    let lead = leading_visible(m);
                    // Branch-free: every key is written, and the count moves past the visible ones.
                    let v0 = lists.listed.len();
                    lists.listed.resize(v0 + keys - lead, 0);
                    let mut n = v0;
                    for (j, &bias) in m[lead..].iter().enumerate() {
                        lists.listed[n] = (lead + j) as u32;
                        n += usize::from(bias != f32::NEG_INFINITY);
                    }
                    lists.listed.truncate(n);
                    lead
                }
            };
            lists.lead.push(lead);
            lists.starts.push(lists.listed.len());
        }
        lists
    }

    /// How many keys row `r` sees.
    fn len(&self, r: usize) -> usize {
        self.lead[r] + self.starts[r + 1] - self.starts[r]
    }

    /// How many segments row `r`'s list is cut into (the recipe's step 6).
    fn segments(&self, r: usize) -> usize {
        segments(self.len(r))
    }
}

/// How many segments a visible list of `n` keys is cut into: `n / SEGMENT` rounded to the nearest (at
/// least one), the last segment taking the rest, so that none holds fewer than half a [`SEGMENT`].
fn segments(n: usize) -> usize {
    ((n + SEGMENT / 2) / SEGMENT).max(1)
}

/// Where a unit leaves a segment's results for (row `ri` of its tile, query head `g` of its group):
/// slot `base + ri · per_row + g` of `o` (`hd` values a slot) and, for step 6, of `stats` (`(m_k,
/// sum_k)`, `m_k` left -inf where the row sees no key of the segment). Without `stats`, `o` is the
/// output and the results are final.
#[derive(Clone, Copy)]
struct Slots<'s, 'a> {
    o: &'s super::pool::SharedMut<'a, f32>,
    stats: Option<&'s super::pool::SharedMut<'a, f32>>,
    base: usize,
    per_row: usize,
}

impl Slots<'_, '_> {
    fn slot(&self, ri: usize, g: usize) -> usize {
        self.base + ri * self.per_row + g
    }
}

/// Per (segment, row, head) of the problem: the segment's results, as [`Slots`] lay them out.
struct Partials<'a> {
    o: super::pool::SharedMut<'a, f32>,
    stats: super::pool::SharedMut<'a, f32>,
    /// Units finished per (key/value head, row tile): the one that makes it `segments` merges.
    done: Vec<std::sync::atomic::AtomicUsize>,
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
    unsafe fn unit_512(&self, u: usize, s: &mut Scratch, out: &super::pool::SharedMut<f32>) {
        self.unit(Width::W512, u, s, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn unit_256(&self, u: usize, s: &mut Scratch, out: &super::pool::SharedMut<f32>) {
        self.unit(Width::W256, u, s, out)
    }

    fn unit_with(&self, width: Width, u: usize, s: &mut Scratch, out: &super::pool::SharedMut<f32>) {
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
    fn unit(&self, width: Width, u: usize, s: &mut Scratch, out: &super::pool::SharedMut<f32>) {
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
                self.merge(kvh, rows, slots, out);
            }
            return;
        }
        let (mut o, mut stats) = (std::mem::take(&mut s.seg_o), std::mem::take(&mut s.seg_stats));
        let per_segment = rows.len() * group;
        o.resize(self.segments * per_segment * self.shape.hd, 0.0);
        stats.clear();
        stats.resize(2 * self.segments * per_segment, f32::NEG_INFINITY);
        {
            let (o, stats) = (
                super::pool::SharedMut::new(&mut o),
                super::pool::SharedMut::new(&mut stats),
            );
            let slots = |k: usize| Slots {
                o: &o,
                stats: Some(&stats),
                base: k * per_segment,
                per_row: group,
            };
            for k in 0..self.segments {
                self.segment(width, k, kvh, rows.clone(), s, slots(k));
            }
            self.merge(kvh, rows, slots, out);
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

    /// Step 6 for the given rows and the query heads of key/value head `kvh`, once every segment has
    /// left its results (segment `k`'s in `segment(k)`).
    #[inline(always)]
    fn merge<'s, 'a: 's>(
        &self,
        kvh: usize,
        rows: std::ops::Range<usize>,
        segment: impl Fn(usize) -> Slots<'s, 'a>,
        out: &super::pool::SharedMut<f32>,
    ) {
        let (hd, heads) = (self.shape.hd, self.shape.heads);
        let group = heads / self.shape.kv_heads;
        for (ri, r) in rows.enumerate() {
            for g in 0..group {
                // SAFETY: every unit writing these has finished, and this (row, head)'s output is this
                // unit's alone.
                let stats = |k: usize| {
                    let at = segment(k);
                    let st = unsafe { at.stats.unwrap().range(2 * at.slot(ri, g), 2) };
                    (st[0], st[1])
                };
                let top = (0..self.segments).fold(f32::NEG_INFINITY, |m, k| m.max(stats(k).0));
                let o = unsafe { out.range((r * heads + kvh * group + g) * hd, hd) };
                let mut sum = None;
                for k in 0..self.segments {
                    let (m, sum_k) = stats(k);
                    if m == f32::NEG_INFINITY {
                        continue;
                    }
                    let w = exp_nonpositive(m - top);
                    let at = segment(k);
                    let o_k = unsafe { at.o.range(at.slot(ri, g) * hd, hd) };
                    sum = Some(match sum {
                        None => {
                            for (x, &y) in o.iter_mut().zip(o_k.iter()) {
                                *x = w * y;
                            }
                            w * sum_k
                        }
                        Some(sum) => {
                            for (x, &y) in o.iter_mut().zip(o_k.iter()) {
                                *x = w.mul_add(y, *x);
                            }
                            w.mul_add(sum_k, sum)
                        }
                    });
                }
                match sum {
                    None => o.fill(0.0),
                    Some(sum) => {
                        let inv = 1.0 / sum;
                        o.iter_mut().for_each(|x| *x *= inv);
                    }
                }
            }
        }
    }

    /// `kt[d · kp + j - keys.start] = k_j[d]` for the `keys` of head `kvh` (columns past them keep
    /// whatever they held: their scores are never read). Pure data movement, so how it is done
    /// cannot change a result.
    #[inline(always)]
    fn transpose_keys(
        &self,
        width: Width,
        kd: &[f32],
        kvh: usize,
        keys: std::ops::Range<usize>,
        kp: usize,
        kt: &mut Vec<f32>,
    ) {
        let (hd, lo, hi) = (self.shape.hd, keys.start, keys.end);
        if kt.len() < hd * kp {
            kt.resize(hd * kp, 0.0);
        }
        let src = |j: usize, d: usize| j * self.shape.row_stride + kvh * hd + d;
        // The head's key rows PREFETCH_KEYS on, asked for as each block of keys is moved.
        let prefetch = |j0: usize, n: usize| {
            for j in j0 + PREFETCH_KEYS..(j0 + PREFETCH_KEYS + n).min(hi) {
                super::prefetch_l1(kd.as_ptr().wrapping_add(src(j, 0)).cast(), 4 * hd);
            }
        };
        let mut j0 = lo;
        #[cfg(target_arch = "x86_64")]
        if width == Width::W512 && hd.is_multiple_of(LANES) {
            while j0 + LANES <= hi {
                prefetch(j0, LANES);
                for d0 in (0..hd).step_by(LANES) {
                    let from = &kd[src(j0, d0)..src(j0 + LANES - 1, d0) + LANES];
                    let to = &mut kt[d0 * kp + j0 - lo..(d0 + LANES - 1) * kp + j0 - lo + LANES];
                    // SAFETY: W512 was checked by the caller; both slices span the 16 x 16 block.
                    unsafe { transpose16_avx512(from, self.shape.row_stride, to, kp) };
                }
                j0 += LANES;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if width == Width::W256 && hd.is_multiple_of(8) {
            while j0 + 8 <= hi {
                prefetch(j0, 8);
                for d0 in (0..hd).step_by(8) {
                    let from = &kd[src(j0, d0)..src(j0 + 7, d0) + 8];
                    let to = &mut kt[d0 * kp + j0 - lo..(d0 + 7) * kp + j0 - lo + 8];
                    // SAFETY: W256 (AVX2) was checked by the caller; both slices span the 8 x 8 block.
                    unsafe { transpose8_avx(from, self.shape.row_stride, to, kp) };
                }
                j0 += 8;
            }
        }
        let _ = width;
        for j in j0..hi {
            for d in 0..hd {
                kt[d * kp + j - lo] = kd[src(j, d)];
            }
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
    /// with `prefetch`, the values [`PREFETCH_KEYS`] keys ahead are asked for (the first pass of a tile
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
                            self,
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
                        avx2::accumulate::<1, 8, _, _>(self, kvh, keys, [p[0]], d0, prefetch, sums)
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

    /// Where key `j`'s values `d0 ..` of key/value head `kvh` start in `vd`.
    #[inline(always)]
    fn value_at(&self, j: usize, kvh: usize, d0: usize) -> usize {
        j * self.shape.row_stride + self.shape.hd * kvh + d0
    }

    /// Asks for the `n` values from `d0` of the key [`PREFETCH_KEYS`] after the `t`-th of `keys`, if any.
    #[inline(always)]
    fn prefetch_values<K: KeyList>(&self, keys: &K, t: usize, kvh: usize, d0: usize, n: usize) {
        if t + PREFETCH_KEYS < keys.len() {
            let ahead = self.value_at(keys.key(t + PREFETCH_KEYS), kvh, d0);
            super::prefetch_l1(self.vd.as_ptr().wrapping_add(ahead).cast(), size_of::<E>() * n);
        }
    }

    /// [`Problem::accumulate`] at width `n`: a method, not a closure inside it, since a closure does not
    /// inherit the caller's target features (its `mul_add`s became calls: 20 times slower, measured).
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

/// How many entries of a mask row lead before its first hidden key (`-inf`): 16 at a time, branch-free
/// inside a chunk so that it compiles to vector compares (a tree's row sees the whole cache first).
fn leading_visible(m: &[f32]) -> usize {
    let visible = |b: &f32| *b != f32::NEG_INFINITY;
    let whole = m
        .chunks_exact(LANES)
        .take_while(|c| c.iter().fold(true, |all, b| all & visible(b)))
        .count()
        * LANES;
    whole + m[whole..].iter().take_while(|b| visible(b)).count()
}

/// Keys of a visible list in order: a run of consecutive keys, read without a list, or listed ones.
trait KeyList: Clone {
    fn len(&self) -> usize;
    /// The `t`-th key (`t < len`).
    fn key(&self, t: usize) -> usize;
}

/// The keys `start .. end`.
#[derive(Clone)]
struct KeyRun(std::ops::Range<usize>);

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

/// Every slot's scores over `keys` (from a multiple of [`KEY_CHUNK`]), a chunk at a time, key `j`'s at
/// `j - keys.start` of the slot's scores (`slots`, `q`, `kt`, `scores` as in [`score_slots`]).
#[inline(always)]
fn score_all<'q, K: KvElement>(
    width: Width,
    slots: usize,
    q: impl Fn(usize) -> &'q [f32] + Copy,
    (kt, layout): (&[K], KeyLayout),
    keys: std::ops::Range<usize>,
    (scores, kp): (&mut [f32], usize),
) {
    #[cfg(target_arch = "x86_64")]
    if width == Width::W256 {
        // SAFETY: W256 runs only where the CPU has AVX2 and FMA (`attention_with` checks).
        return unsafe { avx2::score_all(slots, q, (kt, layout), keys, (scores, kp)) };
    }
    // Four slots at a time where 32 vector registers hold their 16 chains, else two.
    let quads = width == Width::W512;
    let (lo, hi) = (keys.start, keys.end);
    for j0 in (lo..hi).step_by(KEY_CHUNK) {
        // The last chunk only as wide as the keys it holds, in whole vectors (a cache of 257 keys
        // would otherwise score 320; a score is its own chain, so the width cannot change it).
        // The chunk's keys and scores from their start.
        let (at, ks) = layout.chunk(j0);
        let (keys, scores) = ((&kt[at..], ks), (&mut scores[j0 - lo..], kp));
        // The next chunk's keys are asked for while this one is scored (as rows, its 64 rows lie `ks`
        // apart, a pattern the hardware prefetcher does not follow).
        let ahead = (j0 + KEY_CHUNK < hi).then(|| layout.chunk(j0 + KEY_CHUNK).0 - at);
        match (hi - j0).min(KEY_CHUNK).div_ceil(LANES) {
            1 => score_slots::<16, K>(slots, q, keys, 0, scores, quads, ahead),
            2 => score_slots::<32, K>(slots, q, keys, 0, scores, quads, ahead),
            3 => score_slots::<48, K>(slots, q, keys, 0, scores, quads, ahead),
            _ => score_slots::<KEY_CHUNK, K>(slots, q, keys, 0, scores, quads, ahead),
        }
    }
}

/// `scores[i][l] = Σ_d q_i[d] · kt[d · ks + j0 + l]` for the W (at most [`KEY_CHUNK`]) keys from `j0`
/// and each of the N query vectors (step 1's dot products): each a fused multiply-add chain in `d`
/// order, N · W/16 independent 16-lane chains, each key chunk loaded once for all N.
#[inline(always)]
fn score_chunk<const N: usize, const W: usize, K: KvElement>(
    q: [&[f32]; N],
    kt: &[K],
    ks: usize,
    j0: usize,
    ahead: Option<usize>,
) -> [[f32; W]; N] {
    let mut acc = [[0.0f32; W]; N];
    for d in 0..q[0].len() {
        if let Some(a) = ahead {
            super::prefetch_l1(
                kt.as_ptr().wrapping_add(d * ks + a).cast(),
                size_of::<K>() * KEY_CHUNK,
            );
        }
        let k = &kt[d * ks + j0..][..W];
        for (a, qi) in acc.iter_mut().zip(&q) {
            let qd = qi[d];
            for l in 0..W {
                a[l] = qd.mul_add(k[l].to_f32(), a[l]);
            }
        }
    }
    acc
}

/// [`score_chunk`] of the W keys from `j0` (`keys`: the transposed keys and their stride) for every
/// slot (`q(slot)` its query, its scores at `scores.0[slot · scores.1 ..]`), each key chunk loaded once
/// for several slots: four with `quads` (16 chains; AVX-512's 32 registers hold them), else two (8
/// chains, what AVX2's 16 hold); the last one or two slots in smaller groups. The first group also asks
/// for the keys of the chunk at `ahead`, if any.
#[inline(always)]
fn score_slots<'q, const W: usize, K: KvElement>(
    slots: usize,
    q: impl Fn(usize) -> &'q [f32],
    (kt, ks): (&[K], usize),
    j0: usize,
    (scores, kp): (&mut [f32], usize),
    quads: bool,
    ahead: Option<usize>,
) {
    let mut slot = 0;
    while slot < slots {
        let ahead = ahead.filter(|_| slot == 0);
        let out = &mut scores[slot * kp + j0..];
        if quads && slot + 3 < slots {
            let qs = [q(slot), q(slot + 1), q(slot + 2), q(slot + 3)];
            for (i, chunk) in score_chunk::<4, W, K>(qs, kt, ks, j0, ahead).iter().enumerate() {
                out[i * kp..][..W].copy_from_slice(chunk);
            }
            slot += 4;
        } else if slot + 1 < slots {
            for (i, chunk) in score_chunk::<2, W, K>([q(slot), q(slot + 1)], kt, ks, j0, ahead)
                .iter()
                .enumerate()
            {
                out[i * kp..][..W].copy_from_slice(chunk);
            }
            slot += 2;
        } else {
            out[..W].copy_from_slice(&score_chunk::<1, W, K>([q(slot)], kt, ks, j0, ahead)[0]);
            slot += 1;
        }
    }
}

/// An 8 x 8 block transposed: `to[d · to_stride + j] = from[j · from_stride + d]`.
///
/// # Safety
/// The CPU must have AVX; `from` must hold 8 rows of 8 at `from_stride`, `to` 8 of 8 at `to_stride`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose8_avx(from: &[f32], from_stride: usize, to: &mut [f32], to_stride: usize) {
    use std::arch::x86_64::*;
    assert!(from.len() >= 7 * from_stride + 8 && to.len() >= 7 * to_stride + 8);
    let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(from.as_ptr().add(i * from_stride)));
    // Within 128-bit halves: rows interleaved by 32 bits, then 64; then the halves exchanged.
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4g + c]: column c (and c + 4 in the upper half) of rows 4g .. 4g + 4.
    let mut u = [_mm256_setzero_ps(); 8];
    for g in 0..2 {
        let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
        u[4 * g] = _mm256_shuffle_ps::<0x44>(a, c);
        u[4 * g + 1] = _mm256_shuffle_ps::<0xee>(a, c);
        u[4 * g + 2] = _mm256_shuffle_ps::<0x44>(b, d);
        u[4 * g + 3] = _mm256_shuffle_ps::<0xee>(b, d);
    }
    let out = to.as_mut_ptr();
    for c in 0..4 {
        _mm256_storeu_ps(
            out.add(c * to_stride),
            _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c]),
        );
        _mm256_storeu_ps(
            out.add((c + 4) * to_stride),
            _mm256_permute2f128_ps::<0x31>(u[c], u[4 + c]),
        );
    }
}

/// A 16 x 16 block transposed: `to[d · to_stride + j] = from[j · from_stride + d]`.
///
/// # Safety
/// The CPU must have AVX-512F; `from` must hold 16 rows of 16 at `from_stride`, `to` 16 of 16 at
/// `to_stride`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16_avx512(from: &[f32], from_stride: usize, to: &mut [f32], to_stride: usize) {
    use std::arch::x86_64::*;
    assert!(from.len() >= 15 * from_stride + 16 && to.len() >= 15 * to_stride + 16);
    let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(from.as_ptr().add(i * from_stride)));
    // Pairs of rows interleaved by 32 bits, then by 64: u[4i + c] holds, in 128-bit lane L, column
    // c + 4L of rows 4i .. 4i + 4.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let pd = _mm512_castps_pd;
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a), pd(c)));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a), pd(c)));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b), pd(d)));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b), pd(d)));
    }
    // Then 128-bit lanes gathered across row groups: whole columns.
    let out = to.as_mut_ptr();
    for c in 0..4 {
        let w88 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
        let wdd = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
        let x88 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
        let xdd = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
        _mm512_storeu_ps(out.add(c * to_stride), _mm512_shuffle_f32x4::<0x88>(w88, x88));
        _mm512_storeu_ps(
            out.add((c + 8) * to_stride),
            _mm512_shuffle_f32x4::<0xdd>(w88, x88),
        );
        _mm512_storeu_ps(
            out.add((c + 4) * to_stride),
            _mm512_shuffle_f32x4::<0x88>(wdd, xdd),
        );
        _mm512_storeu_ps(
            out.add((c + 12) * to_stride),
            _mm512_shuffle_f32x4::<0xdd>(wdd, xdd),
        );
    }
}

/// `q`: [1, rows, heads, hd]; `k`, `v`: [1, keys, kv_heads, hd] (a prefix view of the KV cache);
/// returns [rows, heads * hd].
pub fn attention_f32(q: &Tensor, k: &Tensor, v: &Tensor, vis: Visibility, scale: f32) -> Result<Tensor> {
    attention_f32_with(Width::best(), q, k, v, vis, scale)
}

/// The keys attention reads.
#[derive(Clone, Copy)]
pub enum Keys<'a> {
    /// `[1, keys, kv_heads, hd]` as the values (f32): each call transposes them.
    Rows(&'a Tensor),
    /// Kept transposed by the caller (the values give their number and heads): read as they are.
    Transposed(TransposedKeys<'a>),
    /// As `Transposed`, in bf16, beside bf16 values.
    TransposedBf16(TransposedKeys<'a, half::bf16>),
}

/// [`attention_f32`] with the keys in either form (the same bits), and the values f32, or bf16 with
/// [`Keys::TransposedBf16`] (the bits of f32 keys and values holding the same numbers).
pub fn attention_f32_keys(q: &Tensor, k: Keys, v: &Tensor, vis: Visibility, scale: f32) -> Result<Tensor> {
    attention_with(Width::best(), q, k, v, vis, scale)
}

/// [`attention_f32`] compiled for an explicit vector width (all give the same bits).
///
/// # Panics
/// If this CPU lacks `width`.
pub fn attention_f32_with(
    width: Width,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    vis: Visibility,
    scale: f32,
) -> Result<Tensor> {
    attention_with(width, q, Keys::Rows(k), v, vis, scale)
}

/// [`attention_f32_keys`] on an explicit width.
pub(crate) fn attention_with(
    width: Width,
    q: &Tensor,
    k: Keys,
    v: &Tensor,
    vis: Visibility,
    scale: f32,
) -> Result<Tensor> {
    if q.dtype() != DType::F32 {
        return Err(Error::Msg(format!(
            "attention_f32 takes f32 queries and f32 keys and values, or transposed bf16 keys with bf16 values (q {:?}, v {:?})",
            q.dtype(),
            v.dtype()
        )));
    }
    let (_, rows, heads, hd) = q.dims4()?;
    let (_, _, kv_heads, vhd) = v.dims4()?;
    if vhd != hd {
        return Err(Error::Msg(format!(
            "attention_f32: {heads} query heads of {hd} over {kv_heads} key/value heads of {vhd}"
        )));
    }
    let out = super::with_f32(q, |qv| {
        attention_rows(width, &qv[..rows * heads * hd], heads, k, v, vis, scale)
    })??;
    Tensor::from_vec(out, (rows, heads * hd), q.device())
}

/// [`attention_f32_keys`] on an explicit width for queries `qv` given as `[rows, heads, hd]` values (`hd`
/// the values' head size): the outputs `[rows, heads · hd]`. What the model's layers on flat buffers
/// call, without a tensor around the queries or the result.
///
/// # Panics
/// If this CPU lacks `width`.
pub(crate) fn attention_rows(
    width: Width,
    qv: &[f32],
    heads: usize,
    k: Keys,
    v: &Tensor,
    vis: Visibility,
    scale: f32,
) -> Result<Vec<f32>> {
    assert!(width.available(), "{width:?} attention on a CPU without it");
    let types_error = || {
        Error::Msg(format!(
            "attention_f32 takes f32 queries and f32 keys and values, or transposed bf16 keys with bf16 values (v {:?})",
            v.dtype()
        ))
    };
    let (_, keys, kv_heads, hd) = v.dims4()?;
    if heads == 0 || hd == 0 || !qv.len().is_multiple_of(heads * hd) {
        return Err(Error::Msg(format!(
            "attention_f32: {} query values for {heads} heads of {hd}",
            qv.len()
        )));
    }
    let rows = qv.len() / (heads * hd);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(Error::Msg(format!(
            "attention_f32: {heads} query heads over {kv_heads} key/value heads"
        )));
    }
    if let Visibility::Additive(m) = vis {
        if m.len() != rows * keys {
            return Err(Error::Msg(format!(
                "mask has {} entries for {rows} x {keys}",
                m.len()
            )));
        }
    }
    let (vg, vl) = v.storage_and_layout();
    // Keys and values are read row by row: each [kv_heads, hd] row must be contiguous.
    let row_stride = vl.stride()[1];
    let contiguous = |l: &candle_core::Layout| l.stride()[2..] == [hd, 1] && l.stride()[1] == row_stride;
    let rows_error = || Error::Msg("attention_f32: keys/values rows must be contiguous".into());
    if !contiguous(vl) {
        return Err(rows_error());
    }
    fn transposed<E>(
        t: TransposedKeys<'_, E>,
        keys: usize,
        kv_heads: usize,
        hd: usize,
    ) -> Result<KeyData<'_, E>> {
        let short = t.stride < keys || !t.stride.is_multiple_of(KEY_CHUNK);
        if short || t.data.len() < kv_heads * hd * t.stride {
            return Err(Error::Msg(format!(
                "attention_f32: transposed keys of stride {} ({} values) for {keys} keys of {kv_heads} x {hd}",
                t.stride,
                t.data.len()
            )));
        }
        Ok(KeyData::Transposed(t))
    }
    let shape = Shape {
        rows,
        keys,
        heads,
        kv_heads,
        hd,
        row_stride,
    };
    let out = match (k, v.dtype()) {
        (Keys::TransposedBf16(t), DType::BF16) => {
            let candle_core::Storage::Cpu(candle_core::CpuStorage::BF16(vd)) = &*vg else {
                return Err(types_error());
            };
            let keys_in = transposed(t, keys, kv_heads, hd)?;
            run(width, qv, keys_in, &vd[vl.start_offset()..], vis, scale, shape)
        }
        (Keys::Rows(k), DType::F32) => {
            let (kdims, vdims) = (k.dims(), v.dims());
            if k.dtype() != DType::F32 {
                return Err(types_error());
            }
            if kdims != vdims {
                return Err(Error::Msg(format!(
                    "attention_f32: keys {kdims:?} and values {vdims:?}"
                )));
            }
            let (kg, kl) = k.storage_and_layout();
            if !contiguous(kl) {
                return Err(rows_error());
            }
            let keys_in = KeyData::<f32>::Rows(super::cpu_f32(&kg, kl.start_offset())?);
            let vd = super::cpu_f32(&vg, vl.start_offset())?;
            run(width, qv, keys_in, vd, vis, scale, shape)
        }
        (Keys::Transposed(t), DType::F32) => {
            let keys_in = transposed(t, keys, kv_heads, hd)?;
            let vd = super::cpu_f32(&vg, vl.start_offset())?;
            run(width, qv, keys_in, vd, vis, scale, shape)
        }
        _ => return Err(types_error()),
    };
    Ok(out)
}

/// An attention problem's sizes ([`Problem`]'s).
#[derive(Clone, Copy)]
struct Shape {
    rows: usize,
    keys: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    row_stride: usize,
}

/// The problem's units on the kernel pool: `[rows, heads · hd]` outputs.
fn run<E: KvElement>(
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
    let pool = super::pool::Pool::global();
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
        o: super::pool::SharedMut::new(&mut partial_o),
        stats: super::pool::SharedMut::new(&mut stats),
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
    let shared = super::pool::SharedMut::new(&mut out);
    pool.run(problem.units(), &|u| {
        thread_local! {
            static SCRATCH: std::cell::RefCell<Scratch> = Default::default();
        }
        SCRATCH.with(|s| problem.unit_with(width, u, &mut s.borrow_mut(), &shared));
    });
    out
}

/// The scores and weighted sums written out in AVX2. Left to the compiler, code shared with AVX-512's
/// 32 registers (16 sums of 16 lanes) spilled sums to the stack on AVX2's 16 and split rows of 32 sums
/// 1 + 8 + 8 + 8 + 4 + 2 + 1 with the loaded keys shuffled to match: three quarters of SmolLM2's attention
/// time after 1024 keys went to those reloads and shuffles. Here every pass keeps 8 sums (of 8 lanes) in
/// registers beside the vectors they share: two slots x 32 keys or dimensions, or one slot x 64. Each sum
/// is the same fused multiply-add chain, in the same order, as the portable code's.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// 16 values from `p` as f32, in two vectors. A bf16 is the top half of its f32, so one unpack
    /// with zeros widens 8 of them exactly (a widening and a shift took two operations per 8, which
    /// competed with the fused multiply-adds for the vector pipes); the unpacks work within 128-bit
    /// halves, so the lanes hold values 0-3, 8-11 and 4-7, 12-15. f32 values come in order. Each lane
    /// is its own chain, so the order changes no result; [`reorder`] maps sums between it and the
    /// natural one.
    #[inline(always)]
    unsafe fn load16<E: KvElement>(p: *const E) -> [__m256; 2] {
        if size_of::<E>() == 2 {
            let (x, zero) = (_mm256_loadu_si256(p.cast()), _mm256_setzero_si256());
            [
                _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)),
                _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)),
            ]
        } else {
            let p = p.cast::<f32>();
            [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
        }
    }

    /// Two vectors of 16 sums between [`load16`]'s lane order for `E` and the natural one (the same
    /// exchange of 128-bit halves either way).
    #[inline(always)]
    unsafe fn reorder<E: KvElement>([a, b]: [__m256; 2]) -> [__m256; 2] {
        if size_of::<E>() == 2 {
            [
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            ]
        } else {
            [a, b]
        }
    }

    /// [`super::score_all`]: a [`KEY_CHUNK`] of keys at a time, two slots over 32 of its keys per pass
    /// (a last slot alone over all of them), the chunk only as wide as its keys in whole 16s.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn score_all<'q, K: KvElement>(
        slots: usize,
        q: impl Fn(usize) -> &'q [f32],
        (kt, layout): (&[K], KeyLayout),
        keys: std::ops::Range<usize>,
        (scores, kp): (&mut [f32], usize),
    ) {
        let (hd, lo, hi) = (q(0).len(), keys.start, keys.end);
        for j0 in (lo..hi).step_by(KEY_CHUNK) {
            let w = (hi - j0).min(KEY_CHUNK).next_multiple_of(LANES);
            // The chunk's keys and scores from their start.
            let (at, ks) = layout.chunk(j0);
            let kt = &kt[at..];
            assert!((hd - 1) * ks + w <= kt.len() && (slots - 1) * kp + j0 - lo + w <= scores.len());
            // The next chunk's keys are asked for while this one is scored.
            let mut ahead = (j0 + KEY_CHUNK < hi).then(|| layout.chunk(j0 + KEY_CHUNK).0 - at);
            let mut slot = 0;
            while slot < slots {
                let out = scores.as_mut_ptr().add(slot * kp + j0 - lo);
                if slot + 1 < slots {
                    let qs = [q(slot), q(slot + 1)];
                    for j in (0..w).step_by(32) {
                        match (w - j).min(32) {
                            32 => block::<2, 4, K>(qs, kt, ks, j, out, kp, ahead),
                            _ => block::<2, 2, K>(qs, kt, ks, j, out, kp, ahead),
                        }
                        ahead = None;
                    }
                    slot += 2;
                } else {
                    let qs = [q(slot)];
                    match w {
                        64 => block::<1, 8, K>(qs, kt, ks, 0, out, kp, ahead),
                        48 => block::<1, 6, K>(qs, kt, ks, 0, out, kp, ahead),
                        32 => block::<1, 4, K>(qs, kt, ks, 0, out, kp, ahead),
                        _ => block::<1, 2, K>(qs, kt, ks, 0, out, kp, ahead),
                    }
                    ahead = None;
                    slot += 1;
                }
            }
        }
    }

    /// Scores of N slots over the `8 V` keys from `j`, written at `out + i · kp + j`.
    ///
    /// # Safety
    /// AVX2 and FMA; the keys `j .. j + 8 V` of every one of the `qs[0].len()` rows of `kt` lie within
    /// it, and `out` has room for row N - 1's.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block<const N: usize, const V: usize, K: KvElement>(
        qs: [&[f32]; N],
        kt: &[K],
        ks: usize,
        j: usize,
        out: *mut f32,
        kp: usize,
        ahead: Option<usize>,
    ) {
        let mut acc = [[_mm256_setzero_ps(); V]; N];
        for d in 0..qs[0].len() {
            if let Some(a) = ahead {
                super::super::prefetch_l1(
                    kt.as_ptr().wrapping_add(d * ks + a).cast(),
                    size_of::<K>() * KEY_CHUNK,
                );
            }
            let k = kt.as_ptr().add(d * ks + j);
            let mut x = [_mm256_setzero_ps(); V];
            for g in (0..V).step_by(2) {
                [x[g], x[g + 1]] = load16(k.add(8 * g));
            }
            for (ai, qi) in acc.iter_mut().zip(&qs) {
                let qd = _mm256_set1_ps(*qi.get_unchecked(d));
                for (ag, &xg) in ai.iter_mut().zip(&x) {
                    *ag = _mm256_fmadd_ps(qd, xg, *ag);
                }
            }
        }
        for (i, ai) in acc.iter().enumerate() {
            for g in (0..V).step_by(2) {
                let [a, b] = reorder::<K>([ai[g], ai[g + 1]]);
                _mm256_storeu_ps(out.add(i * kp + j + 8 * g), a);
                _mm256_storeu_ps(out.add(i * kp + j + 8 * g + 8), b);
            }
        }
    }

    /// [`Problem::accumulate_n`] of `8 V` dimensions for N slots, `sums` their `[N][8 V]` running sums.
    ///
    /// # Safety
    /// AVX2 and FMA; `sums` valid for N · 8 V values; every key's values `d0 .. d0 + 8 V` inside `vd`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn accumulate<const N: usize, const V: usize, E: KvElement, L: KeyList>(
        pb: &Problem<'_, E>,
        kvh: usize,
        keys: L,
        p: [&[f32]; N],
        d0: usize,
        prefetch: bool,
        sums: *mut f32,
    ) {
        let mut acc = [[_mm256_setzero_ps(); V]; N];
        for (i, ai) in acc.iter_mut().enumerate() {
            for g in (0..V).step_by(2) {
                let at = sums.add(i * 8 * V + 8 * g);
                [ai[g], ai[g + 1]] = reorder::<E>([_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))]);
            }
        }
        let len = keys.len();
        let p: [&[f32]; N] = p.map(|pi| &pi[..len]);
        for t in 0..len {
            if prefetch {
                pb.prefetch_values(&keys, t, kvh, d0, 8 * V);
            }
            let v = pb.vd[pb.value_at(keys.key(t), kvh, d0)..][..8 * V].as_ptr();
            let mut x = [_mm256_setzero_ps(); V];
            for g in (0..V).step_by(2) {
                [x[g], x[g + 1]] = load16(v.add(8 * g));
            }
            for (ai, pi) in acc.iter_mut().zip(&p) {
                let pt = _mm256_set1_ps(pi[t]);
                for (ag, &xg) in ai.iter_mut().zip(&x) {
                    *ag = _mm256_fmadd_ps(pt, xg, *ag);
                }
            }
        }
        for (i, ai) in acc.iter().enumerate() {
            for g in (0..V).step_by(2) {
                let [a, b] = reorder::<E>([ai[g], ai[g + 1]]);
                let at = sums.add(i * 8 * V + 8 * g);
                _mm256_storeu_ps(at, a);
                _mm256_storeu_ps(at.add(8), b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn rand_tensor(shape: &[usize], seed: u32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed * 97)) % 1000) as f32 / 500.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// Queries `[1, rows, heads, hd]`, keys and values `[1, keys, kvh, hd]`, from seeds `seed ..= seed + 2`.
    fn qkv(
        rows: usize,
        heads: usize,
        kvh: usize,
        hd: usize,
        keys: usize,
        seed: u32,
    ) -> (Tensor, Tensor, Tensor) {
        (
            rand_tensor(&[1, rows, heads, hd], seed),
            rand_tensor(&[1, keys, kvh, hd], seed + 1),
            rand_tensor(&[1, keys, kvh, hd], seed + 2),
        )
    }

    /// Straightforward f64 attention over the visible keys.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, visible: &dyn Fn(usize, usize) -> bool) -> Vec<f32> {
        let (_, rows, heads, hd) = q.dims4().unwrap();
        let (_, keys, kvh, _) = k.dims4().unwrap();
        let (q, k, v) = (
            q.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        let mut out = vec![0.0; rows * heads * hd];
        for r in 0..rows {
            for h in 0..heads {
                let g = h / (heads / kvh);
                let s: Vec<Option<f64>> = (0..keys)
                    .map(|j| {
                        visible(r, j).then(|| {
                            (0..hd)
                                .map(|d| {
                                    q[(r * heads + h) * hd + d] as f64 * k[(j * kvh + g) * hd + d] as f64
                                })
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                    })
                    .collect();
                let m = s.iter().flatten().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().flatten().map(|x| (x - m).exp()).sum();
                for d in 0..hd {
                    let y: f64 = (0..keys)
                        .filter_map(|j| s[j].map(|x| (x - m).exp() / z * v[(j * kvh + g) * hd + d] as f64))
                        .sum();
                    out[(r * heads + h) * hd + d] = y as f32;
                }
            }
        }
        out
    }

    #[test]
    fn every_width_gives_the_same_bits() {
        // Head size 72: four full chunks of 16 lanes and a remainder of 8.
        for (rows, heads, kvh, hd, cached) in [
            (3, 6, 2, 72, 19),
            (2, 4, 4, 64, 40),
            (1, 2, 1, 16, 3),
            (5, 9, 3, 64, 150),
            // Lists of several segments: 4 of them (the last 333 keys), and rows of 3 and 4.
            (1, 9, 3, 64, 1100),
            (4, 8, 2, 72, 885),
        ] {
            let keys = cached + rows;
            let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 4);
            let vis = Visibility::Causal { offset: cached };
            let run = |w| {
                attention_f32_with(w, &q, &k, &v, vis, 0.3)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            let portable = run(Width::Portable);
            for w in Width::ALL.into_iter().filter(|w| w.available()) {
                let got = run(w);
                assert!(
                    got.iter().zip(&portable).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{w:?} differs from the portable path"
                );
            }
        }
    }

    #[test]
    fn matches_reference_and_is_row_invariant() {
        let (rows, heads, kvh, hd, cached) = (5, 4, 2, 16, 7);
        let keys = cached + rows;
        let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 1);
        let scale = 1.0 / (hd as f32).sqrt();
        // A tree: rows 0 <- 1 <- 2, and 0 <- 3 <- 4.
        let parent = [usize::MAX, 0, 1, 0, 3];
        let sees = |r: usize, j: usize| -> bool {
            if j < cached {
                return true;
            }
            let mut n = r;
            loop {
                if n == j - cached {
                    return true;
                }
                if parent[n] == usize::MAX {
                    return false;
                }
                n = parent[n];
            }
        };
        let mask: Vec<f32> = (0..rows)
            .flat_map(|r| (0..keys).map(move |j| (r, j)))
            .map(|(r, j)| if sees(r, j) { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        let got = attention_f32(&q, &k, &v, Visibility::Additive(&mask), scale).unwrap();
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = reference(&q, &k, &v, &sees);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // Row 4 alone, with its visible keys laid out contiguously (prefix, root, node 3, node 4) as plain
        // decoding's cache would hold them, gives the same bits.
        let idx = Tensor::new(&[0u32, 1, 2, 3, 4, 5, 6, 7, 10, 11], &Device::Cpu).unwrap();
        let (k1, v1) = (k.index_select(&idx, 1).unwrap(), v.index_select(&idx, 1).unwrap());
        let q1 = q.narrow(1, 4, 1).unwrap();
        let alone = attention_f32(&q1, &k1, &v1, Visibility::Causal { offset: 9 }, scale).unwrap();
        let alone = alone.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(alone, got[4 * heads * hd..].to_vec());
    }

    /// Rows whose visible lists are cut into segments at different places (a run of the cache, then
    /// keys listed across a segment's start; lists of 1 to 3 segments, around where the count rounds
    /// up) give, at every width, the bits of the same row alone over a cache holding just its visible
    /// keys (as plain decoding's would), and match straightforward attention.
    #[test]
    fn long_lists_are_cut_into_segments_that_do_not_change_a_row() {
        let (heads, kvh, hd, keys) = (6, 2, 64, 900);
        // (leading run, listed keys after it): the lists' lengths and their segments.
        let rows: [(usize, Vec<usize>); 6] = [
            (200, (201..600).step_by(2).collect()), // 400 keys, 2 segments, the list across 256
            (383, vec![]),                          // 383 keys, 1 segment of all of them
            (380, vec![500, 700, 899]),             // 383 keys: still one segment
            (383, vec![899]),                       // 384 keys, 2 segments
            (639, vec![]),                          // 639: 2 segments, the second of 383
            (600, (640..900).step_by(3).collect()), // 687 keys, 3 segments
        ];
        let lens: Vec<usize> = rows.iter().map(|(l, rest)| l + rest.len()).collect();
        let segs: Vec<usize> = lens.iter().map(|&n| segments(n)).collect();
        assert_eq!(segs, [2, 1, 1, 2, 2, 3], "lengths {lens:?}");
        let sees = |r: usize, j: usize| j < rows[r].0 || rows[r].1.contains(&j);
        let mask: Vec<f32> = (0..rows.len())
            .flat_map(|r| (0..keys).map(move |j| (r, j)))
            .map(|(r, j)| if sees(r, j) { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        let (q, k, v) = qkv(rows.len(), heads, kvh, hd, keys, 31);
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = reference(&q, &k, &v, &sees);
        let row = heads * hd;
        for w in Width::ALL.into_iter().filter(|w| w.available()) {
            let got = flat(attention_f32_with(w, &q, &k, &v, Visibility::Additive(&mask), 0.125).unwrap());
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "{w:?}: {a} vs {b}");
            }
            for (r, (lead, rest)) in rows.iter().enumerate() {
                let visible: Vec<u32> = (0..*lead).chain(rest.iter().copied()).map(|j| j as u32).collect();
                let idx = Tensor::new(visible.as_slice(), &Device::Cpu).unwrap();
                let (k1, v1) = (k.index_select(&idx, 1).unwrap(), v.index_select(&idx, 1).unwrap());
                let n = visible.len();
                let vis = Visibility::Causal { offset: n - 1 };
                let alone =
                    flat(attention_f32_with(w, &q.narrow(1, r, 1).unwrap(), &k1, &v1, vis, 0.125).unwrap());
                assert_eq!(alone, got[r * row..(r + 1) * row], "{w:?}: row {r}");
            }
        }
    }

    #[test]
    fn leading_visible_counts_up_to_the_first_hidden_key() {
        for len in [0, 1, 15, 16, 17, 40, 64, 100] {
            for first_hidden in (0..=len).step_by(3).chain([len]) {
                let m: Vec<f32> = (0..len)
                    .map(|j| match j {
                        j if j == first_hidden => f32::NEG_INFINITY,
                        // Later keys hidden or not, and finite biases, change nothing.
                        j if j > first_hidden && j % 2 == 0 => f32::NEG_INFINITY,
                        j => -(j as f32) * 0.5,
                    })
                    .collect();
                assert_eq!(
                    leading_visible(&m),
                    first_hidden.min(len),
                    "len {len}, first {first_hidden}"
                );
            }
        }
    }

    /// A causal prefill long enough to be cut into several row tiles ([`MAX_TILE_ROWS`]) gives every row
    /// the bits it gets alone over the cache before it (as decoding one token at a time computes it),
    /// and the bits of the same block under an additive causal mask, at every width; with its rows'
    /// lists cut into segments, whether the block's segments are units of their own or each unit
    /// takes its segments in turn ([`SPLIT_BYTES`]; a row alone splits them).
    #[test]
    fn long_causal_blocks_are_row_invariant() {
        let (rows, heads, hd) = (3 * MAX_TILE_ROWS + 5, 9, 64);
        let results = |cached: usize| segments(cached + rows) * rows * heads * (hd + 2) * 4;
        // Rows see 335 .. 435 keys: one segment up to 383, two from 384 (rows 48 and 49); split.
        let cached = 334;
        assert_eq!((segments(cached + 49), segments(cached + 50)), (1, 2));
        assert!(results(cached) <= SPLIT_BYTES);
        causal_block_rows_match_rows_alone(rows, cached, &[48, 49]);
        // Rows see 1101 .. 1201 keys: 4 segments up to 1151, 5 from 1152 (row 51); in turn.
        let cached = 1100;
        assert_eq!((segments(cached + 51), segments(cached + 52)), (4, 5));
        assert!(results(cached) > SPLIT_BYTES);
        causal_block_rows_match_rows_alone(rows, cached, &[50, 51]);
    }

    fn causal_block_rows_match_rows_alone(rows: usize, cached: usize, also: &[usize]) {
        let (heads, kvh, hd) = (9, 3, 64);
        let keys = cached + rows;
        let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 7);
        let mask: Vec<f32> = (0..rows)
            .flat_map(|r| (0..keys).map(move |j| if j <= cached + r { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let row = heads * hd;
        for w in Width::ALL.into_iter().filter(|w| w.available()) {
            let causal = flat(
                attention_f32_with(w, &q, &k, &v, Visibility::Causal { offset: cached }, 0.125).unwrap(),
            );
            let additive =
                flat(attention_f32_with(w, &q, &k, &v, Visibility::Additive(&mask), 0.125).unwrap());
            assert_eq!(causal, additive, "{w:?}: causal and additive masks differ");
            let tiles = [
                0,
                1,
                MAX_TILE_ROWS - 1,
                MAX_TILE_ROWS,
                MAX_TILE_ROWS + 1,
                2 * MAX_TILE_ROWS + 3,
            ];
            for &r in tiles.iter().chain(also).chain(&[rows - 1]) {
                let n = cached + r + 1;
                let alone = attention_f32_with(
                    w,
                    &q.narrow(1, r, 1).unwrap(),
                    &k.narrow(1, 0, n).unwrap(),
                    &v.narrow(1, 0, n).unwrap(),
                    Visibility::Causal { offset: n - 1 },
                    0.125,
                )
                .unwrap();
                assert_eq!(
                    flat(alone),
                    causal[r * row..(r + 1) * row],
                    "{w:?}: row {r} after {cached}"
                );
            }
        }
    }

    /// Keys handed over already transposed (as the KV cache keeps them, with a stride past the keys and
    /// stale values beyond them) give the bits of transposing them, causal or masked.
    #[test]
    fn transposed_keys_give_the_same_bits() {
        for cached in [70, 700] {
            transposed_keys_give_the_same_bits_after(cached);
        }
    }

    fn transposed_keys_give_the_same_bits_after(cached: usize) {
        let (rows, heads, kvh, hd) = (6, 9, 3, 64);
        let keys = cached + rows;
        let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 11);
        let stride = keys.next_multiple_of(KEY_CHUNK) + KEY_CHUNK;
        let kv = k.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut data = vec![f32::NAN; kvh * hd * stride];
        for j in 0..keys {
            for c in 0..kvh * hd {
                data[transposed_key_index(hd, stride, c / hd, c % hd, j)] = kv[j * kvh * hd + c];
            }
        }
        let kt = TransposedKeys { data: &data, stride };
        let mask: Vec<f32> = (0..rows * keys)
            .map(|i| {
                if i % keys <= cached || (i % keys).is_multiple_of(3) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        for vis in [Visibility::Causal { offset: cached }, Visibility::Additive(&mask)] {
            let want = attention_f32(&q, &k, &v, vis, 0.125).unwrap();
            let got = attention_f32_keys(&q, Keys::Transposed(kt), &v, vis, 0.125).unwrap();
            let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (want, got) = (flat(want), flat(got));
            assert!(want.iter().all(|x| x.is_finite()));
            assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        let short = TransposedKeys {
            data: &data,
            stride: keys.next_multiple_of(KEY_CHUNK) - KEY_CHUNK,
        };
        assert!(attention_f32_keys(
            &q,
            Keys::Transposed(short),
            &v,
            Visibility::Causal { offset: cached },
            0.1
        )
        .is_err());
    }

    /// bf16 keys (transposed) and values: on every width, the bits of f32 attention over the same
    /// numbers (the keys and values rounded to bf16 first), which must differ from the unrounded ones'.
    #[test]
    fn bf16_keys_and_values_are_read_as_their_f32_values() {
        use half::bf16;
        let (rows, heads, kvh, hd, cached) = (5, 8, 2, 72, 83);
        let keys = cached + rows;
        let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 23);
        // Values of a few magnitudes, so that rounding moves most of them.
        let spread = |t: &Tensor| {
            let x: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            let x: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, &x)| x * [0.37, 3.1, 17.3][i % 3])
                .collect();
            Tensor::from_vec(x, t.shape(), &Device::Cpu).unwrap()
        };
        let (k, v) = (spread(&k), spread(&v));
        let rounded = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        let (k16, v16) = (rounded(&k), rounded(&v));
        let kv: Vec<f32> = k.flatten_all().unwrap().to_vec1().unwrap();
        let stride = 2 * KEY_CHUNK;
        let mut data = vec![bf16::NAN; kvh * hd * stride];
        for j in 0..keys {
            for c in 0..kvh * hd {
                data[transposed_key_index(hd, stride, c / hd, c % hd, j)] =
                    bf16::from_f32(kv[j * kvh * hd + c]);
            }
        }
        let kt = TransposedKeys { data: &data, stride };
        let v_bf16 = v.to_dtype(DType::BF16).unwrap();
        let mask: Vec<f32> = (0..rows * keys)
            .map(|i| {
                if i % keys < cached || i % 4 == 0 {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        for width in Width::ALL.into_iter().filter(|w| w.available()) {
            for vis in [Visibility::Causal { offset: cached }, Visibility::Additive(&mask)] {
                let want = flat(attention_f32_with(width, &q, &k16, &v16, vis, 0.125).unwrap());
                let got =
                    flat(attention_with(width, &q, Keys::TransposedBf16(kt), &v_bf16, vis, 0.125).unwrap());
                assert!(want.iter().all(|x| x.is_finite()));
                assert!(same(&want, &got), "{width:?}: bf16 cache against its f32 values");
                let unrounded = flat(attention_f32_with(width, &q, &k, &v, vis, 0.125).unwrap());
                assert!(!same(&unrounded, &got), "{width:?}: the rounding changed nothing");
            }
        }
        // bf16 keys with f32 values (or the reverse) are refused.
        let vis = Visibility::Causal { offset: cached };
        assert!(attention_f32_keys(&q, Keys::TransposedBf16(kt), &v, vis, 0.125).is_err());
        assert!(attention_f32_keys(&q, Keys::Rows(&k), &v_bf16, vis, 0.125).is_err());
    }

    /// `cargo test --release --lib attention::tests::decoding_timing -- --ignored --nocapture`: µs per
    /// layer of SmolLM2's attention in a decoding step (1 or 4 rows; 9 heads, 3 key/value heads, head
    /// size 64) over a bf16 cache of 256-2048 tokens, one pass over 30 layers' caches a call, as a step
    /// reads them (not from a cache level that one layer's would fit).
    #[test]
    #[ignore]
    fn decoding_timing() {
        use half::bf16;
        let (heads, kvh, hd, layers) = (9, 3, 64, 30);
        for cached in [256usize, 1024, 2048] {
            for rows in [1, 4] {
                let keys = cached + rows;
                let stride = keys.next_multiple_of(KEY_CHUNK);
                let data: Vec<Vec<bf16>> = (0..layers)
                    .map(|l| {
                        let k = rand_tensor(&[kvh * hd * stride], 100 + l as u32);
                        let k: Vec<f32> = k.to_vec1().unwrap();
                        k.iter().map(|&x| bf16::from_f32(x)).collect()
                    })
                    .collect();
                let values: Vec<Tensor> = (0..layers)
                    .map(|l| {
                        let v = rand_tensor(&[1, keys, kvh, hd], 200 + l as u32);
                        v.to_dtype(DType::BF16).unwrap()
                    })
                    .collect();
                let q = rand_tensor(&[1, rows, heads, hd], 7);
                let vis = Visibility::Causal { offset: cached };
                let t = crate::kernels::median_ms(0.2, || {
                    for (d, v) in data.iter().zip(&values) {
                        let kt = TransposedKeys { data: d, stride };
                        attention_f32_keys(&q, Keys::TransposedBf16(kt), v, vis, 0.125).unwrap();
                    }
                });
                println!(
                    "{cached:5} cached, {rows} rows: {:7.1} us a layer",
                    t * 1e3 / layers as f64
                );
            }
        }
    }

    /// `cargo test --release --lib attention::tests::timing -- --ignored --nocapture`: µs per call of
    /// SmolLM2's attention (9 heads, 3 key/value heads, head size 64) after 256 cached rows, for blocks of
    /// 1..32 rows under a tree mask (every row sees the cache and itself). Run with `RAYON_NUM_THREADS=1`
    /// for the single-thread cost.
    #[test]
    #[ignore]
    fn timing() {
        let (heads, kvh, hd, cached) = (9, 3, 64, 256);
        for rows in [1, 2, 4, 8, 16, 32] {
            let keys = cached + rows;
            let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 1);
            let mask: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    (0..keys).map(move |j| {
                        if j < cached || j == cached + r {
                            0.0
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                })
                .collect();
            let t = crate::kernels::median_ms(0.05, || {
                attention_f32(&q, &k, &v, Visibility::Additive(&mask), 0.125).unwrap();
            });
            // With RAYON_NUM_THREADS=1 the CPU time of this thread is the whole work.
            let cpu = crate::kernels::median_cpu_ms(|| {
                attention_f32(&q, &k, &v, Visibility::Additive(&mask), 0.125).unwrap();
            });
            println!(
                "{rows:3} rows: {:8.1} us wall, {:8.1} us CPU of this thread",
                t * 1e3,
                cpu * 1e3
            );
        }
    }
}
