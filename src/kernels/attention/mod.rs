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
use layout::Shape;
use problem::{run, KeyData};

#[cfg(target_arch = "x86_64")]
mod avx2;
mod layout;
mod problem;
mod score;
mod segments;
#[cfg(test)]
mod tests;
mod transpose;

pub(crate) use score::{exp_nonpositive, lane_max, lane_sum_by};

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
