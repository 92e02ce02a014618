// Row-invariant ("batch-invariant") products on CUDA: what `PROBESPEC_OPS=exact` runs on a GPU.
//
// Speculative verification is lossless only when every row of a block gets the bits that the same token
// gets alone. cuBLAS picks its tiling, split-K and reduction order from the problem's shape, so a row's
// dot products round differently in a block of 8 rows than alone. Here every output element is reduced
// in an order fixed by the reduction length alone:
//   - exact_matmul: y[r][n] = sum_k x[r][k] w[n][k]. One warp per output column n; lane l sums the terms
//     k = l, l + 32, l + 64, ... in increasing k with fused multiply-adds in f32, then the 32 partial sums
//     meet in a fixed butterfly. Rows are taken 8 at a time so that each weight element read from memory
//     serves 8 rows (a weight-streaming kernel for the few rows of decoding); the chunking changes which
//     rows share a read, never the order of a row's sum.
//   - exact_attention: one warp per (row, head). Keys are visited one by one in key order; invisible ones
//     (beyond the causal frontier or masked with -inf) are skipped, so a row sees the same sequence of
//     keys whether its tree ancestors sit at positions cached + a or were committed at cached + depth.
//     Scores are dot products in the same fixed lane order; softmax is online (running maximum, rescaled
//     sum and accumulator), its order the order of the visible keys.
// Inputs and outputs in the model's dtype (f32, f16, bf16); all arithmetic in f32; the result rounded once.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// The same sum on every lane: at each level lane l adds lane l ^ offset's value, and a + b == b + a.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

constexpr int ROWS_PER_PASS = 8;
constexpr int WARPS_PER_BLOCK = 8;

// x: [rows, in], w: [out, in], y: [rows, out], all contiguous.
template <typename T>
__device__ void exact_matmul(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int rows,
                             int in, int out) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    if (n >= out) return;
    const T* wn = w + (size_t)n * in;
    for (int r0 = 0; r0 < rows; r0 += ROWS_PER_PASS) {
        const int nr = min(ROWS_PER_PASS, rows - r0);
        float acc[ROWS_PER_PASS];
#pragma unroll
        for (int r = 0; r < ROWS_PER_PASS; r++) acc[r] = 0.0f;
        for (int k = lane; k < in; k += 32) {
            const float wk = to_f32(wn[k]);
#pragma unroll
            for (int r = 0; r < ROWS_PER_PASS; r++) {
                if (r < nr) acc[r] = fmaf(wk, to_f32(x[(size_t)(r0 + r) * in + k]), acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_PASS; r++) {
            const float s = warp_sum(acc[r]);
            if (r < nr && lane == 0) y[(size_t)(r0 + r) * out + n] = from_f32<T>(s);
        }
    }
}

constexpr int MAX_DIMS_PER_LANE = 8; // head_dim <= 256

// q: [rows, heads, hd]; k, v: [len, kv_heads, hd] (the cache's written rows); mask: [rows, len] additive
// (0 or -inf) or null for causal (row i sees keys 0..=cached + i); out: [rows, heads * hd].
template <typename T>
__device__ void exact_attention(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                const float* __restrict__ mask, T* __restrict__ out, int rows, int heads,
                                int kv_heads, int hd, int len, int cached, float scale) {
    const int lane = threadIdx.x & 31;
    const int item = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    if (item >= rows * heads) return;
    const int row = item / heads, head = item % heads;
    const int kv_head = head / (heads / kv_heads);
    float qd[MAX_DIMS_PER_LANE], acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
        const int d = lane + 32 * t;
        qd[t] = d < hd ? to_f32(q[((size_t)row * heads + head) * hd + d]) : 0.0f;
        acc[t] = 0.0f;
    }
    float m = -CUDART_INF_F, l = 0.0f;
    const int last = mask ? len - 1 : min(len - 1, cached + row);
    for (int j = 0; j <= last; j++) {
        float bias = 0.0f;
        if (mask) {
            bias = mask[(size_t)row * len + j];
            if (bias == -CUDART_INF_F) continue;
        }
        const T* kj = k + ((size_t)j * kv_heads + kv_head) * hd;
        const T* vj = v + ((size_t)j * kv_heads + kv_head) * hd;
        float part = 0.0f;
#pragma unroll
        for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
            const int d = lane + 32 * t;
            if (d < hd) part = fmaf(qd[t], to_f32(kj[d]), part);
        }
        const float s = warp_sum(part) * scale + bias;
        const float m_new = fmaxf(m, s);
        const float correction = __expf(m - m_new);
        const float p = __expf(s - m_new);
        l = fmaf(l, correction, p);
#pragma unroll
        for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
            const int d = lane + 32 * t;
            if (d < hd) acc[t] = fmaf(acc[t], correction, p * to_f32(vj[d]));
        }
        m = m_new;
    }
#pragma unroll
    for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
        const int d = lane + 32 * t;
        if (d < hd) out[((size_t)row * heads + head) * hd + d] = from_f32<T>(acc[t] / l);
    }
}

#define EXACT_KERNELS(NAME, T)                                                                          \
    extern "C" __global__ void exact_matmul_##NAME(const T* x, const T* w, T* y, int rows, int in,      \
                                                   int out) {                                           \
        exact_matmul<T>(x, w, y, rows, in, out);                                                        \
    }                                                                                                   \
    extern "C" __global__ void exact_attention_##NAME(const T* q, const T* k, const T* v,              \
                                                      const float* mask, int has_mask, T* out, int rows, \
                                                      int heads, int kv_heads, int hd, int len,         \
                                                      int cached, float scale) {                        \
        exact_attention<T>(q, k, v, has_mask ? mask : nullptr, out, rows, heads, kv_heads, hd, len,     \
                           cached, scale);                                                              \
    }

EXACT_KERNELS(f32, float)
EXACT_KERNELS(f16, __half)
EXACT_KERNELS(bf16, __nv_bfloat16)
