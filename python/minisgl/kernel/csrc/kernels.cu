// Small CUDA kernels of the engine (chapter 19): the KV store (one warp per token) and the
// embedding lookup of a vocabulary range (tensor parallelism, chapter 16). Each has a plain-torch
// reference in python/minisgl/kernel/reference.py; the same source runs on the CPU emulator.
#include "launch.h"

namespace {

constexpr unsigned kWarp = 32;

// Token i's K and V rows (row_words 32-bit words each) go to slot indices[i] of the caches.
// Warp w of a block copies token blockIdx.x * warps + w; its lanes stride over the words.
template <typename Index>
__global__ void store_kv_kernel(uint32_t* __restrict__ k_cache, uint32_t* __restrict__ v_cache,
                                const uint32_t* __restrict__ k, const uint32_t* __restrict__ v,
                                const Index* __restrict__ indices, int64_t num_tokens,
                                int64_t row_words) {
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (token >= num_tokens) return;
  const int64_t slot = int64_t(indices[token]);
  for (int64_t w = threadIdx.x % kWarp; w < row_words; w += kWarp) {
    k_cache[slot * row_words + w] = k[token * row_words + w];
    v_cache[slot * row_words + w] = v[token * row_words + w];
  }
}

// Row t of out is weight[ids[t] - start] when start <= ids[t] < start + rows, else zeros
// (another rank holds that id, chapter 16). One block per token; threads stride over the row.
__global__ void embedding_kernel(uint16_t* __restrict__ out, const uint16_t* __restrict__ weight,
                                 const int32_t* __restrict__ ids, int64_t start, int64_t rows,
                                 int64_t row_elems, int64_t elem_units) {
  const int64_t t = blockIdx.x;
  const int64_t local = int64_t(ids[t]) - start;
  const bool mine = 0 <= local && local < rows;
  const int64_t n = row_elems * elem_units;  // in 16-bit units
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x)
    out[t * n + e] = mine ? weight[local * n + e] : uint16_t(0);
}

}  // namespace

extern "C" {

// index_bytes: 4 (int32 indices) or 8 (int64)
void store_kv(void* k_cache, void* v_cache, const void* k, const void* v, const void* indices,
              int index_bytes, int64_t num_tokens, int64_t row_bytes, void* stream) {
  const unsigned warps = 4;
  const dim3 grid(unsigned((num_tokens + warps - 1) / warps)), block(warps * kWarp);
  if (num_tokens == 0) return;
  auto* kc = static_cast<uint32_t*>(k_cache);
  auto* vc = static_cast<uint32_t*>(v_cache);
  auto* kk = static_cast<const uint32_t*>(k);
  auto* vv = static_cast<const uint32_t*>(v);
  if (index_bytes == 4)
    LAUNCH(store_kv_kernel<int32_t>, grid, block, stream)(
        kc, vc, kk, vv, static_cast<const int32_t*>(indices), num_tokens, row_bytes / 4);
  else
    LAUNCH(store_kv_kernel<int64_t>, grid, block, stream)(
        kc, vc, kk, vv, static_cast<const int64_t*>(indices), num_tokens, row_bytes / 4);
}

// elem_bytes: 2 (bf16, fp16) or 4 (fp32), copied as 16-bit units
void embedding(void* out, const void* weight, const void* ids, int64_t num_tokens, int64_t start,
               int64_t rows, int64_t row_elems, int elem_bytes, void* stream) {
  if (num_tokens == 0) return;
  LAUNCH(embedding_kernel, dim3(unsigned(num_tokens)), dim3(256), stream)(
      static_cast<uint16_t*>(out), static_cast<const uint16_t*>(weight),
      static_cast<const int32_t*>(ids), start, rows, row_elems, int64_t(elem_bytes / 2));
}

}  // extern "C"
