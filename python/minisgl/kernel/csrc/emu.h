// A CPU emulator for simple CUDA kernels (chapter 19): compiled by a host C++ compiler in place
// of nvcc, it runs every block, and every thread of a block, one after another. That is exact
// for kernels whose threads never talk to each other (no __syncthreads, shared memory handoffs
// or warp shuffles): each thread only reads inputs and writes its own outputs. Kernels that
// need more are not emulated; their tests say so and skip.
#pragma once
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaStream_t = void*;

// what a running thread sees; one "thread" runs at a time
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

template <typename Kernel, typename... Args>
void emu_launch(dim3 grid, dim3 block, Kernel kernel, Args... args) {
  gridDim = grid;
  blockDim = block;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = dim3(bx, by, bz);
        for (unsigned tz = 0; tz < block.z; ++tz)
          for (unsigned ty = 0; ty < block.y; ++ty)
            for (unsigned tx = 0; tx < block.x; ++tx) {
              threadIdx = dim3(tx, ty, tz);
              kernel(args...);
            }
      }
}

// `LAUNCH(kernel, grid, block, stream)(args...)` is kernel<<<grid, block, 0, stream>>>(args...)
#define LAUNCH(kernel, grid, block, stream) \
  [&](auto... args) { (void)(stream); emu_launch(grid, block, kernel, args...); }
