// The engine's own CUDA kernels (chapter 19): the KV store (one warp per token), the embedding of
// a vocabulary range (tensor parallelism), RMSNorm with the residual add fused in,
// rotary embedding and SiLU-and-mul. It moves 16 bytes per load where the data allows,
// gives short rows (Qwen3's q/k norms) a warp each, fuses those norms with the rotary embedding
// (one launch for three: a launch costs the host more than these kernels cost the GPU), and adds
// the draw of a token from logits.
// The same source runs on the CPU emulator (emu.h); the tests check it against plain-torch
// references, the H200 against torch's own ops.
//
// Elementwise arithmetic is in float, rounded to the storage type where torch rounds (after each
// op of the reference), so bfloat16 results match torch's up to the reductions' order.
#include <type_traits>

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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // the GPU's own conversion, one instruction for the ten and a branch below (which the emulator
  // runs): the same bits for every number but a NaN's payload (a NaN stays NaN)
  bf16 b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
  return b;
#endif
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

// N elements of T moved by one load or store: 16 bytes when N = 16 / sizeof(T)
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Every thread ends with the block's total. blockDim.x: a multiple of 32, at most 1024.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kWarp];
  const unsigned lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();  // all partials written before any warp reads them
  return warp_sum(lane < blockDim.x / kWarp ? partial[lane] : 0.0f);
}

// Token i's K and V rows (row_words words each; k and v rows k_stride / v_stride words apart) go
// to slot indices[i] of the caches. Warp w of a block copies token blockIdx.x * warps + w; its
// lanes stride over the words. Word: 4 bytes, or 16 when every row and pointer allows.
template <typename Word, typename Index>
__global__ void store_kv_kernel(Word* __restrict__ k_cache, Word* __restrict__ v_cache,
                                const Word* __restrict__ k, const Word* __restrict__ v,
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
// (another rank holds that id). One block per token; threads stride over the row.
__global__ void embedding_kernel(uint16_t* __restrict__ out, const uint16_t* __restrict__ weight,
                                 const int32_t* __restrict__ ids, int64_t start, int64_t rows,
                                 int64_t row_units) {
  const int64_t t = blockIdx.x;
  const int64_t local = int64_t(ids[t]) - start;
  const bool mine = 0 <= local && local < rows;
  for (int64_t e = threadIdx.x; e < row_units; e += blockDim.x)
    out[t * row_units + e] = mine ? weight[local * row_units + e] : uint16_t(0);
}

// Row r of x starts at (r / inner) * outer_stride + (r % inner) * inner_stride (a [T, H, D] view
// inside the merged qkv for Qwen3's q/k norms); out is contiguous. With a residual:
// s = x + residual goes to residual_out and is what gets normalised. A block per row, or, for
// short rows (kWarpRows), a warp per row and several rows a block; each thread moves N elements
// at a time. A warp past the last row still joins its shuffles (the emulator needs every
// thread of the block at each). Every element is read and written by one thread, reads first,
// so out may be x and residual_out residual (in place, no __restrict__ on those four).
template <typename T, int N, bool kWarpRows>
__global__ void rms_norm_kernel(T* out, T* residual_out, const T* x, const T* residual,
                                const T* __restrict__ weight, int64_t rows, int64_t inner,
                                int64_t outer_stride, int64_t inner_stride, int64_t cols,
                                float eps) {
  using P = Pack<T, N>;
  const unsigned lanes = kWarpRows ? kWarp : blockDim.x;
  const unsigned lane = kWarpRows ? threadIdx.x % kWarp : threadIdx.x;
  const int64_t row = kWarpRows ? int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp
                                : int64_t(blockIdx.x);
  const int64_t packs = row < rows ? cols / N : 0;
  const P* xr = reinterpret_cast<const P*>(x + row / inner * outer_stride + row % inner * inner_stride);
  const bool add = residual != nullptr;
  const P* rr = add ? reinterpret_cast<const P*>(residual + row * cols) : nullptr;
  P* sum = add ? reinterpret_cast<P*>(residual_out + row * cols) : nullptr;
  P* o = reinterpret_cast<P*>(out + row * cols);
  const P* w = reinterpret_cast<const P*>(weight);
  float squares = 0.0f;
  for (int64_t p = lane; p < packs; p += lanes) {
    P s = xr[p];
    if (add) {
      const P r = rr[p];
      for (int i = 0; i < N; ++i) s.v[i] = from_float<T>(to_float(s.v[i]) + to_float(r.v[i]));
      sum[p] = s;
    }
    for (int i = 0; i < N; ++i) squares += to_float(s.v[i]) * to_float(s.v[i]);
  }
  const float total = kWarpRows ? warp_sum(squares) : block_sum(squares);
  const float inv = rsqrtf(total / float(cols) + eps);
  for (int64_t p = lane; p < packs; p += lanes) {  // this thread's own elements
    const P s = add ? sum[p] : xr[p], wp = w[p];
    P y;
    for (int i = 0; i < N; ++i)
      y.v[i] = from_float<T>(to_float(wp.v[i]) * round_to<T>(to_float(s.v[i]) * inv));
    o[p] = y;
  }
}

// One block per token: every (head, j < D/2) pair of q and k rotated by the token's angle
// (NeoX layout: j pairs with j + D/2), N consecutive j at a time. Inputs are rows q_stride /
// k_stride apart; outputs are contiguous [T, H, D]. table: [max_position, D] float32, cos then sin.
template <typename T, int N, typename Position>
__global__ void rope_kernel(T* __restrict__ q_out, T* __restrict__ k_out, const T* __restrict__ q,
                            const T* __restrict__ k, const float* __restrict__ table,
                            const Position* __restrict__ positions, int64_t q_stride,
                            int64_t k_stride, int q_heads, int k_heads, int head_dim) {
  using P = Pack<T, N>;
  const int64_t t = blockIdx.x;
  const int half = head_dim / 2, groups = half / N;
  const float* angle = table + int64_t(positions[t]) * head_dim;
  for (int p = threadIdx.x; p < (q_heads + k_heads) * groups; p += blockDim.x) {
    const int head = p / groups, j = p % groups * N;
    const bool is_q = head < q_heads;
    const int h = is_q ? head : head - q_heads;
    const T* in = is_q ? q + t * q_stride + h * head_dim : k + t * k_stride + h * head_dim;
    T* out = (is_q ? q_out + (t * q_heads + h) * head_dim : k_out + (t * k_heads + h) * head_dim);
    const P a = *reinterpret_cast<const P*>(in + j), b = *reinterpret_cast<const P*>(in + j + half);
    P lo, hi;
    for (int i = 0; i < N; ++i) {
      const float c = round_to<T>(angle[j + i]), s = round_to<T>(angle[half + j + i]);
      const float x1 = to_float(a.v[i]), x2 = to_float(b.v[i]);
      lo.v[i] = from_float<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
      hi.v[i] = from_float<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
    }
    *reinterpret_cast<P*>(out + j) = lo;
    *reinterpret_cast<P*>(out + j + half) = hi;
  }
}

// N floats of the cos/sin table from p, 16 bytes a load where N allows it (p is then 16-byte
// aligned: the launch checks the table, and a row's offsets are multiples of N floats)
template <int N>
__device__ __forceinline__ void load_angles(float (&out)[N], const float* __restrict__ p) {
  if constexpr (N % 4 == 0) {
    for (int i = 0; i < N; i += 4) {
      const Pack<float, 4> f = *reinterpret_cast<const Pack<float, 4>*>(p + i);
      for (int e = 0; e < 4; ++e) out[i + e] = f.v[e];
    }
  } else {
    for (int i = 0; i < N; ++i) out[i] = p[i];
  }
}

// Qwen3's q/k norms and the rotary embedding in one pass: `lanes` lanes per (token, head) row (the
// row's packs rounded up to a power of two, at most a warp), so a warp holds 32 / lanes rows, in
// token order, q's heads then k's. The row is normalised with its weight (q_weight or k_weight)
// and rounded to T as rms_norm_kernel rounds it, then rotated as rope_kernel rotates, so the
// result is theirs bit for bit (where rms_norm_kernel gives the row a warp: D / N <= 64): a lane
// sums the squares of the packs rms_norm_kernel's lane of that number sums, and the butterfly
// over the row's lanes adds what the warp's butterfly adds (its other partners hold zeros), so
// every lane of the row holds the same sum. Each lane then writes whole packs of the output, the
// first half's (x1 c - x2 s) or the second's (x2 c + x1 s). When a lane holds exactly one pack
// (lanes = D / N, Qwen3's heads), the row is read once: the normalised pack of the other half
// comes from lane ^ (lanes / 2) by shuffles. Otherwise a lane reads both halves from memory. One
// launch instead of three. A row past the last still joins the shuffles.
template <typename T, int N, typename Position>
__global__ void qk_norm_rope_kernel(T* __restrict__ q_out, T* __restrict__ k_out,
                                    const T* __restrict__ q, const T* __restrict__ k,
                                    const T* __restrict__ q_weight, const T* __restrict__ k_weight,
                                    const float* __restrict__ table,
                                    const Position* __restrict__ positions, int64_t tokens,
                                    int64_t q_stride, int64_t k_stride, int q_heads, int k_heads,
                                    int head_dim, float eps, int lane_bits) {
  using P = Pack<T, N>;
  // a shift, a mask and a 32-bit division while the row fits (64 bits: a long GPU subroutine)
  const int lanes = 1 << lane_bits, heads = q_heads + k_heads, half = head_dim / 2;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> lane_bits;
  const int lane = int(threadIdx.x) & (lanes - 1);
  const bool valid = row < tokens * heads;
  const int packs = valid ? head_dim / N : 0, groups = head_dim / N / 2;
  const int64_t t = row <= INT32_MAX ? int64_t(int32_t(row) / heads) : row / heads;
  const int head = int(row - t * heads);
  const bool is_q = head < q_heads;
  const int h = is_q ? head : head - q_heads;
  const T* in = is_q ? q + t * q_stride + h * head_dim : k + t * k_stride + h * head_dim;
  T* out = is_q ? q_out + (t * q_heads + h) * head_dim : k_out + (t * k_heads + h) * head_dim;
  const T* w = is_q ? q_weight : k_weight;
  const float* angle = valid ? table + int64_t(positions[t]) * head_dim : table;
  if (lanes == head_dim / N) {  // one pack a lane (the same for every row of the launch)
    P a = {};
    if (valid) a = reinterpret_cast<const P*>(in)[lane];
    float squares = 0.0f;
    for (int i = 0; i < N; ++i) squares += to_float(a.v[i]) * to_float(a.v[i]);
    for (int m = lanes / 2; m > 0; m >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, m);
    const float inv = rsqrtf(squares / float(head_dim) + eps);
    const P wp = reinterpret_cast<const P*>(w)[lane];
    float mine[N], other[N];
    for (int i = 0; i < N; ++i)
      mine[i] = round_to<T>(to_float(wp.v[i]) * round_to<T>(to_float(a.v[i]) * inv));
    for (int i = 0; i < N; ++i) other[i] = __shfl_xor_sync(0xffffffffu, mine[i], groups);
    if (!valid) return;
    const bool second = lane >= groups;  // this pack is in the second half: x2 c + x1 s
    const int j = (second ? lane - groups : lane) * N;
    float c[N], s[N];
    load_angles(c, angle + j);
    load_angles(s, angle + half + j);
    P y;
    for (int i = 0; i < N; ++i) {
      const float x1 = second ? other[i] : mine[i], x2 = second ? mine[i] : other[i];
      const float ci = round_to<T>(c[i]), si = round_to<T>(s[i]);
      y.v[i] = from_float<T>(second ? round_to<T>(x2 * ci) + round_to<T>(x1 * si)
                                    : round_to<T>(x1 * ci) - round_to<T>(x2 * si));
    }
    reinterpret_cast<P*>(out)[lane] = y;
    return;
  }
  float squares = 0.0f;
  for (int p = lane; p < packs; p += lanes) {
    const P a = reinterpret_cast<const P*>(in)[p];
    for (int i = 0; i < N; ++i) squares += to_float(a.v[i]) * to_float(a.v[i]);
  }
  for (int m = lanes / 2; m > 0; m >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, m);
  const float inv = rsqrtf(squares / float(head_dim) + eps);
  for (int p = lane; p < packs; p += lanes) {
    const bool second = p >= groups;  // this pack is in the second half: x2 c + x1 s
    const int j = (second ? p - groups : p) * N;
    const P a = *reinterpret_cast<const P*>(in + j), b = *reinterpret_cast<const P*>(in + j + half);
    const P wa = *reinterpret_cast<const P*>(w + j), wb = *reinterpret_cast<const P*>(w + j + half);
    float c[N], s[N];
    load_angles(c, angle + j);
    load_angles(s, angle + half + j);
    P y;
    for (int i = 0; i < N; ++i) {
      const float x1 = round_to<T>(to_float(wa.v[i]) * round_to<T>(to_float(a.v[i]) * inv));
      const float x2 = round_to<T>(to_float(wb.v[i]) * round_to<T>(to_float(b.v[i]) * inv));
      const float ci = round_to<T>(c[i]), si = round_to<T>(s[i]);
      y.v[i] = from_float<T>(second ? round_to<T>(x2 * ci) + round_to<T>(x1 * si)
                                    : round_to<T>(x1 * ci) - round_to<T>(x2 * si));
    }
    *reinterpret_cast<P*>(out + j + (second ? half : 0)) = y;
  }
}

// out[r, j] = silu(x[r, j]) * x[r, d + j] for x [rows, 2d]; a grid-stride loop over out, N
// elements at a time.
template <typename T, int N>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows,
                                    int64_t d) {
  using P = Pack<T, N>;
  const int64_t groups = d / N, n = rows * groups, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = i / groups, j = i % groups * N;
    const P gate = *reinterpret_cast<const P*>(x + r * 2 * d + j);
    const P up = *reinterpret_cast<const P*>(x + r * 2 * d + d + j);
    P y;
    for (int e = 0; e < N; ++e) {
      const float g = to_float(gate.v[e]);
      y.v[e] = from_float<T>(round_to<T>(g / (1.0f + expf(-g))) * to_float(up.v[e]));
    }
    *reinterpret_cast<P*>(out + r * d + j) = y;
  }
}

// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011): four
// random 32-bit words from a 128-bit counter under a 64-bit key, ten rounds of multiply-xor.
__device__ __forceinline__ void philox(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t a = uint64_t(0xD2511F53u) * c[0], b = uint64_t(0xCD9E8D57u) * c[2];
    const uint32_t c1 = c[1], c3 = c[3];
    c[0] = uint32_t(b >> 32) ^ c1 ^ k0;
    c[1] = uint32_t(b);
    c[2] = uint32_t(a >> 32) ^ c3 ^ k1;
    c[3] = uint32_t(a);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// (key, index) takes (k2, i2) if that is larger; a tie goes to the lower index
__device__ __forceinline__ void keep_best(float& key, int& index, float k2, int i2) {
  if (k2 > key || (k2 == key && i2 < index)) {
    key = k2;
    index = i2;
  }
}

// Every thread ends with the block's largest key and its index.
__device__ __forceinline__ void block_argmax(float& key, int& index) {
  __shared__ float keys[kWarp];
  __shared__ int indices[kWarp];
  const unsigned lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int m = kWarp / 2; m > 0; m >>= 1)
    keep_best(key, index, __shfl_xor_sync(0xffffffffu, key, m),
              __shfl_xor_sync(0xffffffffu, index, m));
  if (lane == 0) {
    keys[warp] = key;
    indices[warp] = index;
  }
  __syncthreads();  // every warp's best written before warp 0's lanes read them
  const bool have = lane < blockDim.x / kWarp;
  key = have ? keys[lane] : -INFINITY;
  index = have ? indices[lane] : 0;
  for (int m = kWarp / 2; m > 0; m >>= 1)
    keep_best(key, index, __shfl_xor_sync(0xffffffffu, key, m),
              __shfl_xor_sync(0xffffffffu, index, m));
}

// One block per row of logits: the token argmax_i (logits_i / T - log E_i), E_i drawn from Exp(1),
// which is i with probability softmax(logits / T)_i (the Gumbel-max trick: the Sampler's race in
// logarithms, so no softmax pass). E_i = -log u, u uniform in (0, 1) from 23 bits of Philox
// (seed; counter: i / 4, the row, the step): never 0 or 1, so every key is finite. One read of
// the logits, N = 4 of them a load when the rows allow.
template <typename T, int N>
__global__ void sample_kernel(int32_t* __restrict__ out, const T* __restrict__ logits,
                              const float* __restrict__ temperatures, int64_t row_stride,
                              int64_t vocab, uint64_t seed, uint64_t step) {
  const int64_t row = blockIdx.x;
  const T* lr = logits + row * row_stride;
  const float inv_t = 1.0f / temperatures[row];
  float best = -INFINITY;
  int best_i = 0;
  for (int64_t g = threadIdx.x; g < (vocab + 3) / 4; g += blockDim.x) {
    uint32_t c[4] = {uint32_t(g), uint32_t(row), uint32_t(step), uint32_t(step >> 32)};
    philox(c, uint32_t(seed), uint32_t(seed >> 32));
    Pack<T, 4> v;
    if (N == 4) {
      v = reinterpret_cast<const Pack<T, 4>*>(lr)[g];
    } else {
      for (int e = 0; e < 4; ++e) v.v[e] = lr[g * 4 + e < vocab ? g * 4 + e : 0];
    }
    for (int e = 0; e < 4 && g * 4 + e < vocab; ++e) {
      const float u = (float(c[e] >> 9) + 0.5f) * (1.0f / 8388608.0f);
      keep_best(best, best_i, to_float(v.v[e]) * inv_t - logf(-logf(u)), int(g * 4 + e));
    }
  }
  block_argmax(best, best_i);
  if (threadIdx.x == 0) out[row] = best_i;
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

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// launches rms_norm_kernel<T, N>: rows of at most 64 packs get a warp each
template <typename T, int N>
int launch_rms_norm(T* out, T* residual_out, const T* x, const T* residual, const T* weight,
                    int64_t rows, int64_t inner, int64_t outer_stride, int64_t inner_stride,
                    int64_t cols, float eps, void* stream) {
  const int64_t packs = cols / N;
  if (packs <= 2 * kWarp) {
    const unsigned warps = 4;
    return LAUNCH((rms_norm_kernel<T, N, true>), dim3(unsigned((rows + warps - 1) / warps)),
                  dim3(warps * kWarp), stream)(out, residual_out, x, residual, weight, rows, inner,
                                               outer_stride, inner_stride, cols, eps);
  }
  return LAUNCH((rms_norm_kernel<T, N, false>), dim3(unsigned(rows)), dim3(threads_for(4 * packs)),
                stream)(out, residual_out, x, residual, weight, rows, inner, outer_stride,
                        inner_stride, cols, eps);
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
  auto copy = [&](auto word) {
    using W = decltype(word);
    auto* kc = static_cast<W*>(k_cache);
    auto* vc = static_cast<W*>(v_cache);
    auto* kk = static_cast<const W*>(k);
    auto* vv = static_cast<const W*>(v);
    const int64_t n = sizeof(W);
    if (index_bytes == 4)
      return LAUNCH((store_kv_kernel<W, int32_t>), grid, block, stream)(
          kc, vc, kk, vv, static_cast<const int32_t*>(indices), num_tokens, row_bytes / n,
          k_stride_bytes / n, v_stride_bytes / n);
    return LAUNCH((store_kv_kernel<W, int64_t>), grid, block, stream)(
        kc, vc, kk, vv, static_cast<const int64_t*>(indices), num_tokens, row_bytes / n,
        k_stride_bytes / n, v_stride_bytes / n);
  };
  const bool wide = (row_bytes | k_stride_bytes | v_stride_bytes) % 16 == 0 &&
                    aligned16(k_cache) && aligned16(v_cache) && aligned16(k) && aligned16(v);
  return wide ? copy(Pack<uint32_t, 4>{}) : copy(uint32_t{});
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
    constexpr int N = 16 / sizeof(T);
    auto* o = static_cast<T*>(out);
    auto* ro = static_cast<T*>(residual_out);
    auto* xx = static_cast<const T*>(x);
    auto* r = static_cast<const T*>(residual);
    auto* w = static_cast<const T*>(weight);
    const bool wide = (cols | outer_stride | inner_stride) % N == 0 && aligned16(o) &&
                      aligned16(ro) && aligned16(xx) && aligned16(r) && aligned16(w);
    return wide ? launch_rms_norm<T, N>(o, ro, xx, r, w, rows, inner, outer_stride, inner_stride,
                                        cols, eps, stream)
                : launch_rms_norm<T, 1>(o, ro, xx, r, w, rows, inner, outer_stride, inner_stride,
                                        cols, eps, stream);
  });
}

// position_bytes: 4 (int32) or 8 (int64); strides in elements
int rope(void* q_out, void* k_out, const void* q, const void* k, const void* table,
         const void* positions, int dtype, int position_bytes, int64_t tokens, int64_t q_stride,
         int64_t k_stride, int q_heads, int k_heads, int head_dim, void* stream) {
  if (tokens == 0) return 0;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* qo = static_cast<T*>(q_out);
    auto* ko = static_cast<T*>(k_out);
    auto* qi = static_cast<const T*>(q);
    auto* ki = static_cast<const T*>(k);
    auto* tb = static_cast<const float*>(table);
    auto go = [&](auto width) {
      constexpr int N = decltype(width)::value;
      const dim3 grid{unsigned(tokens)};
      const dim3 block{threads_for(4 * (q_heads + k_heads) * (head_dim / 2 / N))};
      if (position_bytes == 4)
        return LAUNCH((rope_kernel<T, N, int32_t>), grid, block, stream)(
            qo, ko, qi, ki, tb, static_cast<const int32_t*>(positions), q_stride, k_stride,
            q_heads, k_heads, head_dim);
      return LAUNCH((rope_kernel<T, N, int64_t>), grid, block, stream)(
          qo, ko, qi, ki, tb, static_cast<const int64_t*>(positions), q_stride, k_stride,
          q_heads, k_heads, head_dim);
    };
    constexpr int N = 16 / sizeof(T);
    const bool wide = (head_dim / 2 | q_stride | k_stride) % N == 0 && aligned16(qo) &&
                      aligned16(ko) && aligned16(qi) && aligned16(ki);
    return wide ? go(std::integral_constant<int, N>{}) : go(std::integral_constant<int, 1>{});
  });
}

// q_norm, k_norm and rope of one attention layer (Qwen3): strides in elements; outputs
// contiguous [tokens, heads, head_dim]
int qk_norm_rope(void* q_out, void* k_out, const void* q, const void* k, const void* q_weight,
                 const void* k_weight, const void* table, const void* positions, int dtype,
                 int position_bytes, int64_t tokens, int64_t q_stride, int64_t k_stride,
                 int q_heads, int k_heads, int head_dim, float eps, void* stream) {
  if (tokens == 0) return 0;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* qo = static_cast<T*>(q_out);
    auto* ko = static_cast<T*>(k_out);
    auto* qi = static_cast<const T*>(q);
    auto* ki = static_cast<const T*>(k);
    auto* qw = static_cast<const T*>(q_weight);
    auto* kw = static_cast<const T*>(k_weight);
    auto* tb = static_cast<const float*>(table);
    const unsigned warps = 8;
    const int64_t rows = tokens * (q_heads + k_heads);
    auto go = [&](auto width) {
      constexpr int N = decltype(width)::value;
      int lanes = 1, lane_bits = 0;  // the row's packs, up to a power of two, at most a warp
      for (; lanes < kWarp && lanes < head_dim / N; ++lane_bits) lanes *= 2;
      const int64_t per_block = int64_t(warps) * (kWarp / lanes);
      const dim3 grid(unsigned((rows + per_block - 1) / per_block)), block(warps * kWarp);
      if (position_bytes == 4)
        return LAUNCH((qk_norm_rope_kernel<T, N, int32_t>), grid, block, stream)(
            qo, ko, qi, ki, qw, kw, tb, static_cast<const int32_t*>(positions), tokens, q_stride,
            k_stride, q_heads, k_heads, head_dim, eps, lane_bits);
      return LAUNCH((qk_norm_rope_kernel<T, N, int64_t>), grid, block, stream)(
          qo, ko, qi, ki, qw, kw, tb, static_cast<const int64_t*>(positions), tokens, q_stride,
          k_stride, q_heads, k_heads, head_dim, eps, lane_bits);
    };
    constexpr int N = 16 / sizeof(T);
    const bool wide = (head_dim / 2 | q_stride | k_stride) % N == 0 && aligned16(qo) &&
                      aligned16(ko) && aligned16(qi) && aligned16(ki) && aligned16(qw) &&
                      aligned16(kw) && aligned16(tb);
    return wide ? go(std::integral_constant<int, N>{}) : go(std::integral_constant<int, 1>{});
  });
}

int silu_and_mul(void* out, const void* x, int dtype, int64_t rows, int64_t d, void* stream) {
  if (rows * d == 0) return 0;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = 16 / sizeof(T);
    auto* o = static_cast<T*>(out);
    auto* xx = static_cast<const T*>(x);
    auto go = [&](auto width) {
      constexpr int n = decltype(width)::value;
      const int64_t blocks = (rows * d / n + 255) / 256;
      const dim3 grid(unsigned(blocks < 4096 ? blocks : 4096)), block(256);
      return LAUNCH((silu_and_mul_kernel<T, n>), grid, block, stream)(o, xx, rows, d);
    };
    const bool wide = d % N == 0 && aligned16(o) && aligned16(xx);
    return wide ? go(std::integral_constant<int, N>{}) : go(std::integral_constant<int, 1>{});
  });
}

// out: [rows] int32 tokens; temperatures: [rows] float32
int sample(void* out, const void* logits, const void* temperatures, int dtype, int64_t rows,
           int64_t row_stride, int64_t vocab, uint64_t seed, uint64_t step, void* stream) {
  if (rows == 0) return 0;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<int32_t*>(out);
    auto* l = static_cast<const T*>(logits);
    auto* t = static_cast<const float*>(temperatures);
    const dim3 grid{unsigned(rows)}, block{threads_for(vocab)};
    const bool packed = (vocab | row_stride) % 4 == 0 &&
                        reinterpret_cast<uintptr_t>(l) % (4 * sizeof(T)) == 0;
    if (packed)
      return LAUNCH((sample_kernel<T, 4>), grid, block, stream)(o, l, t, row_stride, vocab, seed,
                                                                step);
    return LAUNCH((sample_kernel<T, 1>), grid, block, stream)(o, l, t, row_stride, vocab, seed,
                                                              step);
  });
}

}  // extern "C"
