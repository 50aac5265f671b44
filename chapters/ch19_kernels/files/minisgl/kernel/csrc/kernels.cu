// The engine's own CUDA kernels (chapter 19): the KV store (one warp per token), the embedding of
// a vocabulary range (tensor parallelism, chapter 16), RMSNorm with the residual add fused in,
// rotary embedding and SiLU-and-mul. The same source runs on the CPU emulator (emu.h); the tests
// check it against plain-torch references, the H200 against torch's own ops.
//
// Elementwise arithmetic is in float, rounded to the storage type where torch rounds (after each
// op of the reference), so bfloat16 results match torch's up to the reductions' order.
#include "launch.h"

namespace {

constexpr unsigned kWarp = 32;

// bfloat16 as its bits: the same code on the GPU and on the host emulator
struct bf16 {
  uint16_t bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

template <typename T>
__device__ __forceinline__ T from_float(float f);
template <>
__device__ __forceinline__ float from_float<float>(float f) { return f; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float f) {  // round to nearest even
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

template <typename T>
__device__ __forceinline__ float round_to(float f) { return to_float(from_float<T>(f)); }

// Every lane ends with the warp's total (butterfly over 5 shuffles).
__device__ __forceinline__ float warp_sum(float v) {
  for (int m = kWarp / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Every thread ends with the block's total. blockDim.x: a multiple of 32, at most 1024.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kWarp];
  const unsigned lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();  // all partials written before any warp reads them
  return warp_sum(lane < blockDim.x / kWarp ? partial[lane] : 0.0f);
}

// Token i's K and V rows (row_words 32-bit words each; k and v rows k_stride / v_stride words
// apart) go to slot indices[i] of the caches. Warp w of a block copies token
// blockIdx.x * warps + w; its lanes stride over the words.
template <typename Index>
__global__ void store_kv_kernel(uint32_t* __restrict__ k_cache, uint32_t* __restrict__ v_cache,
                                const uint32_t* __restrict__ k, const uint32_t* __restrict__ v,
                                const Index* __restrict__ indices, int64_t num_tokens,
                                int64_t row_words, int64_t k_stride, int64_t v_stride) {
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (token >= num_tokens) return;
  const int64_t slot = int64_t(indices[token]);
  for (int64_t w = threadIdx.x % kWarp; w < row_words; w += kWarp) {
    k_cache[slot * row_words + w] = k[token * k_stride + w];
    v_cache[slot * row_words + w] = v[token * v_stride + w];
  }
}

// Row t of out is weight[ids[t] - start] when start <= ids[t] < start + rows, else zeros
// (another rank holds that id, chapter 16). One block per token; threads stride over the row.
__global__ void embedding_kernel(uint16_t* __restrict__ out, const uint16_t* __restrict__ weight,
                                 const int32_t* __restrict__ ids, int64_t start, int64_t rows,
                                 int64_t row_units) {
  const int64_t t = blockIdx.x;
  const int64_t local = int64_t(ids[t]) - start;
  const bool mine = 0 <= local && local < rows;
  for (int64_t e = threadIdx.x; e < row_units; e += blockDim.x)
    out[t * row_units + e] = mine ? weight[local * row_units + e] : uint16_t(0);
}

// One block per row. Row r of x starts at (r / inner) * outer_stride + (r % inner) * inner_stride
// (a [T, H, D] view inside the merged qkv for Qwen3's q/k norms); out is contiguous. With a
// residual: s = x + residual goes to residual_out and is what gets normalised.
template <typename T>
__global__ void rms_norm_kernel(T* __restrict__ out, T* __restrict__ residual_out,
                                const T* __restrict__ x, const T* __restrict__ residual,
                                const T* __restrict__ weight, int64_t inner, int64_t outer_stride,
                                int64_t inner_stride, int64_t cols, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row / inner * outer_stride + row % inner * inner_stride;
  const bool add = residual != nullptr;
  float squares = 0.0f;
  for (int64_t e = threadIdx.x; e < cols; e += blockDim.x) {
    float s = to_float(xr[e]);
    if (add) {
      s = round_to<T>(s + to_float(residual[row * cols + e]));
      residual_out[row * cols + e] = from_float<T>(s);
    }
    squares += s * s;
  }
  const float inv = rsqrtf(block_sum(squares) / float(cols) + eps);
  for (int64_t e = threadIdx.x; e < cols; e += blockDim.x) {  // this thread's own elements
    const float s = add ? to_float(residual_out[row * cols + e]) : to_float(xr[e]);
    out[row * cols + e] = from_float<T>(to_float(weight[e]) * round_to<T>(s * inv));
  }
}

// One block per token: every (head, j < D/2) pair of q and k rotated by the token's angle
// (NeoX layout: j pairs with j + D/2). Inputs are rows q_stride / k_stride apart; outputs are
// contiguous [T, H, D]. table: [max_position, D] float32, cos then sin.
template <typename T, typename Position>
__global__ void rope_kernel(T* __restrict__ q_out, T* __restrict__ k_out, const T* __restrict__ q,
                            const T* __restrict__ k, const float* __restrict__ table,
                            const Position* __restrict__ positions, int64_t q_stride,
                            int64_t k_stride, int q_heads, int k_heads, int head_dim) {
  const int64_t t = blockIdx.x;
  const int half = head_dim / 2;
  const float* angle = table + int64_t(positions[t]) * head_dim;
  for (int p = threadIdx.x; p < (q_heads + k_heads) * half; p += blockDim.x) {
    const int head = p / half, j = p % half;
    const bool is_q = head < q_heads;
    const int h = is_q ? head : head - q_heads;
    const T* in = is_q ? q + t * q_stride + h * head_dim : k + t * k_stride + h * head_dim;
    T* out = (is_q ? q_out + (t * q_heads + h) * head_dim : k_out + (t * k_heads + h) * head_dim);
    const float c = round_to<T>(angle[j]), s = round_to<T>(angle[half + j]);
    const float x1 = to_float(in[j]), x2 = to_float(in[j + half]);
    out[j] = from_float<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
    out[j + half] = from_float<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
}

// out[r, j] = silu(x[r, j]) * x[r, d + j] for x [rows, 2d]; a grid-stride loop over out.
template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows,
                                    int64_t d) {
  const int64_t n = rows * d, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = i / d, j = i % d;
    const float gate = to_float(x[r * 2 * d + j]), up = to_float(x[r * 2 * d + d + j]);
    out[i] = from_float<T>(round_to<T>(gate / (1.0f + expf(-gate))) * up);
  }
}

// dtype codes shared with cuda.py: 0 float32, 1 bfloat16
template <typename F>
int by_dtype(int dtype, F&& f) {
  return dtype == 0 ? f(float{}) : f(bf16{});
}

unsigned threads_for(int64_t elems) {  // a multiple of 32, about 4 elements per thread
  const int64_t t = (elems / 4 + kWarp - 1) / kWarp * kWarp;
  return unsigned(t < 32 ? 32 : t > 1024 ? 1024 : t);
}

}  // namespace

extern "C" {

const char* error_string(int code) { return launch_error(code); }

// index_bytes: 4 (int32 indices) or 8 (int64); rows and strides in bytes, multiples of 4
int store_kv(void* k_cache, void* v_cache, const void* k, const void* v, const void* indices,
             int index_bytes, int64_t num_tokens, int64_t row_bytes, int64_t k_stride_bytes,
             int64_t v_stride_bytes, void* stream) {
  if (num_tokens == 0) return 0;
  const unsigned warps = 4;
  const dim3 grid(unsigned((num_tokens + warps - 1) / warps)), block(warps * kWarp);
  auto* kc = static_cast<uint32_t*>(k_cache);
  auto* vc = static_cast<uint32_t*>(v_cache);
  auto* kk = static_cast<const uint32_t*>(k);
  auto* vv = static_cast<const uint32_t*>(v);
  if (index_bytes == 4)
    return LAUNCH(store_kv_kernel<int32_t>, grid, block, stream)(
        kc, vc, kk, vv, static_cast<const int32_t*>(indices), num_tokens, row_bytes / 4,
        k_stride_bytes / 4, v_stride_bytes / 4);
  return LAUNCH(store_kv_kernel<int64_t>, grid, block, stream)(
      kc, vc, kk, vv, static_cast<const int64_t*>(indices), num_tokens, row_bytes / 4,
      k_stride_bytes / 4, v_stride_bytes / 4);
}

// rows copied as 16-bit units (row_bytes / 2), whatever the element type
int embedding(void* out, const void* weight, const void* ids, int64_t num_tokens, int64_t start,
              int64_t rows, int64_t row_bytes, void* stream) {
  if (num_tokens == 0) return 0;
  return LAUNCH(embedding_kernel, dim3(unsigned(num_tokens)), dim3(threads_for(row_bytes / 2)),
                stream)(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(weight),
                        static_cast<const int32_t*>(ids), start, rows, row_bytes / 2);
}

// residual and residual_out: both null (plain RMSNorm) or both set; strides in elements
int rms_norm(void* out, void* residual_out, const void* x, const void* residual,
             const void* weight, int dtype, int64_t rows, int64_t inner, int64_t outer_stride,
             int64_t inner_stride, int64_t cols, float eps, void* stream) {
  if (rows == 0) return 0;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return LAUNCH(rms_norm_kernel<T>, dim3(unsigned(rows)), dim3(threads_for(cols)), stream)(
        static_cast<T*>(out), static_cast<T*>(residual_out), static_cast<const T*>(x),
        static_cast<const T*>(residual), static_cast<const T*>(weight), inner, outer_stride,
        inner_stride, cols, eps);
  });
}

// position_bytes: 4 (int32) or 8 (int64); strides in elements
int rope(void* q_out, void* k_out, const void* q, const void* k, const void* table,
         const void* positions, int dtype, int position_bytes, int64_t tokens, int64_t q_stride,
         int64_t k_stride, int q_heads, int k_heads, int head_dim, void* stream) {
  if (tokens == 0) return 0;
  const dim3 grid{unsigned(tokens)}, block{threads_for(4 * (q_heads + k_heads) * head_dim / 2)};
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* qo = static_cast<T*>(q_out);
    auto* ko = static_cast<T*>(k_out);
    auto* qi = static_cast<const T*>(q);
    auto* ki = static_cast<const T*>(k);
    auto* tb = static_cast<const float*>(table);
    if (position_bytes == 4)
      return LAUNCH((rope_kernel<T, int32_t>), grid, block, stream)(
          qo, ko, qi, ki, tb, static_cast<const int32_t*>(positions), q_stride, k_stride,
          q_heads, k_heads, head_dim);
    return LAUNCH((rope_kernel<T, int64_t>), grid, block, stream)(
        qo, ko, qi, ki, tb, static_cast<const int64_t*>(positions), q_stride, k_stride, q_heads,
        k_heads, head_dim);
  });
}

int silu_and_mul(void* out, const void* x, int dtype, int64_t rows, int64_t d, void* stream) {
  if (rows * d == 0) return 0;
  const int64_t blocks = (rows * d + 255) / 256;
  const dim3 grid(unsigned(blocks < 4096 ? blocks : 4096)), block(256);
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return LAUNCH(silu_and_mul_kernel<T>, grid, block, stream)(
        static_cast<T*>(out), static_cast<const T*>(x), rows, d);
  });
}

}  // extern "C"
