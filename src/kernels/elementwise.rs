//! Element-wise steps of a layer on the CPU: the MLP's gated activation `silu(gate) · up`, the
//! rotary position embedding, RMSNorm and the residual additions; and a softmax's denominator over a
//! row of logits, for the drafters' candidate lists.
//!
//! candle runs `silu` and the product as two serial passes over two new tensors, each value through the
//! C library's `expf`: at 16 rows that was about 2 ms of a 20 ms step, on one core while the other
//! waited. Here one pass, split over the kernel pool ([`super::pool`]), evaluates the same fixed
//! polynomial for the exponential as attention's softmax. Every value is computed alone, so a row's
//! results cannot depend on the block around it, and every SIMD width gives the same bits (only
//! fused multiply-adds, multiplies, adds, a division and bit operations).

use super::attention::Width;
use candle_core::{Result, Tensor};

/// `e^x` for `x <= 0` (see attention's softmax, which shares it).
pub(crate) use super::attention::exp_nonpositive;
/// The largest of a row (`-inf` when empty; NaN never counts), in 16 lanes: for greedy argmax and the
/// drafters' candidate lists.
pub(crate) use super::attention::lane_max;

/// Values per pool task: small enough to split a 16-row step of SmolLM2 (24576 values) over two threads,
/// large enough that a hand-off (about a microsecond) is a small share of a task.
const CHUNK: usize = 4096;

/// `kernel: a [..], b [..] do not fit`: the error of tensors whose shapes a kernel cannot take.
fn shapes_error(kernel: &str, tensors: &[(&str, &Tensor)]) -> candle_core::Error {
    let shapes: Vec<String> = tensors
        .iter()
        .map(|(n, t)| format!("{n} {:?}", t.dims()))
        .collect();
    candle_core::Error::Msg(format!("{kernel}: {} do not fit", shapes.join(", ")))
}

/// `silu(g) · u = g · u / (1 + e^-g)`, with the exponential taken of `-|g|` so that it never overflows.
#[inline(always)]
fn silu_mul(g: f32, u: f32) -> f32 {
    let e = exp_nonpositive(-g.abs());
    let s = if g >= 0.0 { 1.0 } else { e };
    g * u * s / (1.0 + e)
}

#[inline(always)]
fn run(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu_mul(g, u);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn run_512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    run(gate, up, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_256(gate: &[f32], up: &[f32], out: &mut [f32]) {
    run(gate, up, out)
}

/// `silu(gate) · up` element by element into `out`, at a given SIMD width.
///
/// # Panics
/// If the lengths differ or the CPU lacks `width`.
pub fn swiglu_slices_with(width: Width, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "swiglu: lengths differ"
    );
    assert!(
        width.available(),
        "swiglu: {width:?} requested on a CPU without it"
    );
    let n = out.len();
    let shared = super::pool::SharedMut::new(out);
    super::pool::Pool::global().run(n.div_ceil(CHUNK), &|t| {
        let (a, b) = (t * CHUNK, ((t + 1) * CHUNK).min(n));
        // SAFETY: task t writes values a..b only.
        let o = unsafe { shared.range(a, b - a) };
        let (g, u) = (&gate[a..b], &up[a..b]);
        match width {
            // SAFETY: checked above that the CPU has the width.
            #[cfg(target_arch = "x86_64")]
            Width::W512 => unsafe { run_512(g, u, o) },
            #[cfg(target_arch = "x86_64")]
            Width::W256 => unsafe { run_256(g, u, o) },
            _ => run(g, u, o),
        }
    });
}

/// `Σ e^(x_i - shift)` (every `x_i <= shift`, as in a softmax shifted by its maximum), in attention's
/// fixed 16-lane order.
#[inline(always)]
fn exp_sum(x: &[f32], shift: f32) -> f32 {
    super::attention::lane_sum_by(x, |v| exp_nonpositive(v - shift))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn exp_sum_512(x: &[f32], shift: f32) -> f32 {
    exp_sum(x, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_256(x: &[f32], shift: f32) -> f32 {
    exp_sum(x, shift)
}

/// A softmax's denominator `Σ e^(x_i - shift)` (`shift` at least every `x_i`, usually their maximum),
/// at a given SIMD width; every width gives the same bits. A vocabulary row (49152 logits) takes a few
/// microseconds, against about 200 through the C library's `expf`.
///
/// # Panics
/// If the CPU lacks `width`.
pub fn softmax_denominator_with(width: Width, x: &[f32], shift: f32) -> f32 {
    assert!(
        width.available(),
        "softmax_denominator: {width:?} requested on a CPU without it"
    );
    match width {
        // SAFETY: checked above that the CPU has the width.
        #[cfg(target_arch = "x86_64")]
        Width::W512 => unsafe { exp_sum_512(x, shift) },
        #[cfg(target_arch = "x86_64")]
        Width::W256 => unsafe { exp_sum_256(x, shift) },
        _ => exp_sum(x, shift),
    }
}

/// [`softmax_denominator_with`] at the CPU's widest width.
pub fn softmax_denominator(x: &[f32], shift: f32) -> f32 {
    softmax_denominator_with(Width::best(), x, shift)
}

/// `silu(gate) · up` for two f32 CPU tensors of one shape: a new contiguous tensor.
///
/// # Errors
/// If either is not f32 on the CPU, or the shapes differ.
pub fn swiglu_f32(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    super::check_f32_cpu(gate, "swiglu")?;
    super::check_f32_cpu(up, "swiglu")?;
    if gate.shape() != up.shape() {
        return Err(shapes_error("swiglu", &[("gate", gate), ("up", up)]));
    }
    let mut out = vec![0.0f32; gate.elem_count()];
    super::with_f32(gate, |g| {
        super::with_f32(up, |u| swiglu_slices_with(Width::best(), g, u, &mut out))
    })??;
    Tensor::from_vec(out, gate.shape(), gate.device())
}

/// Rotary position embedding in the "rotate half" layout, as candle's `rope_thd` computes it (the same
/// formula, so the same numbers): for each row `t`, head and `i < d/2`,
/// `y_i = x_i cos_ti - x_{i+d/2} sin_ti` and `y_{i+d/2} = x_i sin_ti + x_{i+d/2} cos_ti`.
/// `x`: `[1, rows, heads, d]` f32 on the CPU; `cos`, `sin`: `[rows, d/2]`. One serial pass: a block's few
/// thousand values cost less than handing them to threads (candle's version forks rayon for them).
///
/// # Errors
/// If a tensor is not f32 on the CPU or the shapes do not fit.
pub fn rope_f32(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    for t in [x, cos, sin] {
        super::check_f32_cpu(t, "rope")?;
    }
    let (b, rows, heads, d) = x.dims4()?;
    if b != 1 || d % 2 != 0 || cos.dims() != [rows, d / 2] || sin.dims() != [rows, d / 2] {
        return Err(shapes_error("rope", &[("x", x), ("cos", cos), ("sin", sin)]));
    }
    let mut out = vec![0.0f32; x.elem_count()];
    super::with_f32(x, |xs| out.copy_from_slice(xs))?;
    super::with_f32(cos, |c| {
        super::with_f32(sin, |s| rope_in_place(&mut out, heads * d, d, c, s))
    })??;
    Tensor::from_vec(out, x.shape(), x.device())
}

/// [`rope_f32`] in place on rows of `width` values (heads of `d`) in `x`, row `t` rotated by `cos` and `sin`
/// rows `t` (`d / 2` values each).
///
/// # Panics
/// If `x` is not whole rows, `d` not even or not a divisor of `width`, or the tables are short.
pub fn rope_in_place(x: &mut [f32], width: usize, d: usize, cos: &[f32], sin: &[f32]) {
    let half = d / 2;
    assert!(
        d.is_multiple_of(2) && width.is_multiple_of(d) && x.len().is_multiple_of(width),
        "rope: shapes"
    );
    let rows = x.len() / width;
    assert!(
        cos.len() >= rows * half && sin.len() >= rows * half,
        "rope: tables"
    );
    for ((xr, cr), sr) in x
        .chunks_exact_mut(width)
        .zip(cos.chunks_exact(half))
        .zip(sin.chunks_exact(half))
    {
        for xh in xr.chunks_exact_mut(d) {
            let (x1, x2) = xh.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * cr[i] - b * sr[i];
                x2[i] = a * sr[i] + b * cr[i];
            }
        }
    }
}

/// `a += b`, element by element: a residual connection on flat buffers (the bits of [`add_f32`]).
///
/// # Panics
/// If the lengths differ.
pub fn add_in_place(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "add: lengths differ");
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

/// Each row `x` of `xs` (rows of `w.len()`) as `x / sqrt(mean(x²) + eps) · w` into `out`.
#[inline(always)]
fn rms_rows(xs: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (x, y) in xs.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let m = (super::attention::lane_sum_by(x, |v| v * v) / d as f32 + eps).sqrt();
        for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
            *y = x / m * w;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn rms_rows_512(xs: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rms_rows(xs, w, eps, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rms_rows_256(xs: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rms_rows(xs, w, eps, out)
}

/// RMSNorm of every row of `xs` over `w.len()` values, at a given SIMD width (all give the same bits).
///
/// # Panics
/// If `xs` is not whole rows, `out` differs in length, or the CPU lacks `width`.
pub fn rms_norm_slices_with(width: Width, xs: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        !w.is_empty() && xs.len().is_multiple_of(w.len()) && out.len() == xs.len(),
        "rms_norm: shapes"
    );
    assert!(
        width.available(),
        "rms_norm: {width:?} requested on a CPU without it"
    );
    match width {
        // SAFETY: checked above that the CPU has the width.
        #[cfg(target_arch = "x86_64")]
        Width::W512 => unsafe { rms_rows_512(xs, w, eps, out) },
        #[cfg(target_arch = "x86_64")]
        Width::W256 => unsafe { rms_rows_256(xs, w, eps, out) },
        _ => rms_rows(xs, w, eps, out),
    }
}

/// RMSNorm over the last dimension of an f32 CPU tensor with weight `w` (`[d]`): candle's formula with
/// the sum of squares taken in 16 lanes (candle adds one value after the other, a serial chain).
///
/// # Errors
/// If a tensor is not f32 on the CPU or the last dimension is not `w`'s length.
pub fn rms_norm_f32(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    super::check_f32_cpu(x, "rms_norm")?;
    super::check_f32_cpu(w, "rms_norm")?;
    let d = w.elem_count();
    if x.dims().last() != Some(&d) || w.rank() != 1 {
        return Err(shapes_error("rms_norm", &[("x", x), ("weight", w)]));
    }
    let mut out = vec![0.0f32; x.elem_count()];
    super::with_f32(x, |xs| {
        super::with_f32(w, |ws| rms_norm_slices_with(Width::best(), xs, ws, eps, &mut out))
    })??;
    Tensor::from_vec(out, x.shape(), x.device())
}

/// `a + b` for two f32 CPU tensors of one shape (the residual connections): a new contiguous tensor,
/// in one serial pass. candle's addition hands tensors of 64 Ki values or more (a prefill of 114
/// SmolLM2 rows) to rayon, whose workers then spin for a while on the cores the kernel pool needs: 9%
/// of a 128-row forward's samples. An addition is one pass over memory, cheaper than a hand-off.
///
/// # Errors
/// If either is not f32 on the CPU, or the shapes differ.
pub fn add_f32(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    super::check_f32_cpu(a, "add")?;
    super::check_f32_cpu(b, "add")?;
    if a.shape() != b.shape() {
        return Err(shapes_error("add", &[("a", a), ("b", b)]));
    }
    let sum = super::with_f32(a, |x| {
        super::with_f32(b, |y| x.iter().zip(y).map(|(x, y)| x + y).collect::<Vec<f32>>())
    })??;
    Tensor::from_vec(sum, a.shape(), a.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn values(rng: &mut StdRng, n: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n).map(|_| rng.random_range(-12.0f32..12.0)).collect();
        // Edges: zeros of both signs, the exponential's clamp, infinities' neighbours.
        v[..8].copy_from_slice(&[0.0, -0.0, -87.5, 87.5, -200.0, 200.0, 1e-30, -1e-30]);
        v
    }

    /// Gate and up values of one seed.
    fn gate_up(seed: u64, n: usize) -> (Vec<f32>, Vec<f32>) {
        let mut rng = StdRng::seed_from_u64(seed);
        (values(&mut rng, n), values(&mut rng, n))
    }

    #[test]
    fn matches_silu_in_f64() {
        let (n, (g, u)) = (3 * CHUNK + 17, gate_up(7, 3 * CHUNK + 17));
        let mut out = vec![0.0; n];
        swiglu_slices_with(Width::best(), &g, &u, &mut out);
        for i in 0..n {
            let (g64, u64) = (g[i] as f64, u[i] as f64);
            let want = g64 / (1.0 + (-g64).exp()) * u64;
            let err = (out[i] as f64 - want).abs();
            assert!(
                err <= 4e-7 * want.abs() + 1e-30,
                "silu({}) * {} = {} want {want}",
                g[i],
                u[i],
                out[i]
            );
        }
    }

    #[test]
    fn every_width_gives_the_same_bits() {
        let (n, (g, u)) = (2 * CHUNK + 5, gate_up(8, 2 * CHUNK + 5));
        let mut want = vec![0.0; n];
        swiglu_slices_with(Width::Portable, &g, &u, &mut want);
        for width in Width::ALL.into_iter().filter(|w| w.available()) {
            let mut out = vec![0.0; n];
            swiglu_slices_with(width, &g, &u, &mut out);
            let same = out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{width:?} differs from the portable build");
        }
    }

    #[test]
    fn rope_is_candles() {
        let dev = candle_core::Device::Cpu;
        let mut rng = StdRng::seed_from_u64(9);
        let (rows, heads, d) = (5, 3, 8);
        let t = |rng: &mut StdRng, shape: &[usize]| {
            let n: usize = shape.iter().product();
            Tensor::from_vec(values(rng, n.max(8))[..n].to_vec(), shape, &dev).unwrap()
        };
        let x = t(&mut rng, &[1, rows, heads, d]);
        let (cos, sin) = (t(&mut rng, &[rows, d / 2]), t(&mut rng, &[rows, d / 2]));
        let want = candle_nn::rotary_emb::rope_thd(&x, &cos, &sin).unwrap();
        let got = rope_f32(&x, &cos, &sin).unwrap();
        let (w, g) = (
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert!(w.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(rope_f32(&x, &cos.narrow(0, 0, 4).unwrap(), &sin).is_err());
    }

    #[test]
    fn rms_norm_matches_f64_and_every_width() {
        let mut rng = StdRng::seed_from_u64(10);
        let (rows, d) = (7, 576 + 5);
        let xs = values(&mut rng, rows * d);
        let w = values(&mut rng, d);
        let mut want = vec![0.0; rows * d];
        rms_norm_slices_with(Width::Portable, &xs, &w, 1e-5, &mut want);
        for (r, x) in xs.chunks_exact(d).enumerate() {
            let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            let m = (ms + 1e-5).sqrt();
            for i in 0..d {
                let exact = x[i] as f64 / m * w[i] as f64;
                let got = want[r * d + i] as f64;
                assert!((got - exact).abs() <= 1e-6 * exact.abs() + 1e-30, "{got} {exact}");
            }
        }
        for width in Width::ALL.into_iter().filter(|w| w.available()) {
            let mut out = vec![0.0; rows * d];
            rms_norm_slices_with(width, &xs, &w, 1e-5, &mut out);
            assert!(
                out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{width:?}"
            );
        }
    }

    #[test]
    fn tensor_shapes_are_checked() {
        let dev = candle_core::Device::Cpu;
        let g = Tensor::ones((2, 3), candle_core::DType::F32, &dev).unwrap();
        let u = Tensor::ones((3, 2), candle_core::DType::F32, &dev).unwrap();
        assert!(swiglu_f32(&g, &u).is_err());
        assert!(add_f32(&g, &u).is_err());
        let a = Tensor::arange(0f32, 6.0, &dev).unwrap().reshape((2, 3)).unwrap();
        let sum = add_f32(&a, &a.t().unwrap().contiguous().unwrap().t().unwrap()).unwrap();
        assert_eq!(sum.to_vec2::<f32>().unwrap(), [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]);
        let y = swiglu_f32(&g, &g.clone()).unwrap();
        assert_eq!(y.dims(), &[2, 3]);
        let want = 1.0 / (1.0 + (-1.0f64).exp());
        let got = y.to_vec2::<f32>().unwrap()[1][2] as f64;
        assert!((got - want).abs() < 1e-6, "{got} {want}");
    }
}
