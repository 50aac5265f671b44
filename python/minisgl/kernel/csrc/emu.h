// A CPU emulator for small CUDA kernels (chapter 19). Compiled by a host C++ compiler in place of
// nvcc, it runs the grid's blocks one after another; inside a block every CUDA thread is a fiber
// (ucontext) on one OS thread. A fiber runs until it finishes or reaches __syncthreads(), then the
// next one runs: a barrier is where the block's threads take turns. What it implements:
//   - threads that never talk to each other (exact);
//   - __shared__ memory (a static: one block runs at a time) and __syncthreads();
//   - warp shuffles (__shfl_xor_sync), as a barrier of the whole block: every thread of the block
//     must reach the same shuffle, which our kernels' reductions do.
// Because fibers run in order, a missing __syncthreads is not a rare race here but a sure wrong
// answer. Threads that leave a barrier unreached by others (divergence), atomics, cooperative
// groups and anything else are not emulated: the launch fails with a message.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static thread_local  // one block at a time: the block's shared memory

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaStream_t = void*;

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// what the running CUDA thread sees
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {

constexpr size_t kStackBytes = 32 * 1024;

struct Fiber {
  ucontext_t context;
  bool done = false;
};

inline thread_local ucontext_t scheduler;
inline thread_local Fiber* running = nullptr;
inline thread_local const std::function<void()>* body = nullptr;
inline thread_local const char* error = nullptr;  // set when a launch cannot be emulated
inline thread_local uint64_t boards[2][1024];      // what warp shuffles exchange
inline thread_local unsigned shuffles[1024];       // per CUDA thread: shuffles done in this block

inline void fiber_main() {
  (*body)();
  running->done = true;  // then uc_link returns to the scheduler
}

// this thread waits at a barrier: hand over to the next one
inline void barrier() { swapcontext(&running->context, &scheduler); }

inline unsigned thread_rank() {
  return (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
}

// one block: start every thread, then let them run turn by turn from barrier to barrier
inline bool run_block(dim3 block, const std::function<void()>& kernel) {
  const unsigned n = block.x * block.y * block.z;
  std::vector<Fiber> fibers(n);
  static thread_local std::vector<char> stacks;  // kept between blocks and launches
  if (stacks.size() < n * kStackBytes) stacks.resize(n * kStackBytes);
  body = &kernel;
  std::memset(shuffles, 0, sizeof(shuffles));
  for (unsigned i = 0; i < n; ++i) {
    getcontext(&fibers[i].context);
    fibers[i].context.uc_stack.ss_sp = stacks.data() + i * kStackBytes;
    fibers[i].context.uc_stack.ss_size = kStackBytes;
    fibers[i].context.uc_link = &scheduler;
    makecontext(&fibers[i].context, fiber_main, 0);
  }
  for (;;) {
    unsigned finished = 0;
    for (unsigned i = 0; i < n; ++i) {
      if (fibers[i].done) { ++finished; continue; }
      threadIdx = dim3(i % block.x, i / block.x % block.y, i / (block.x * block.y));
      running = &fibers[i];
      swapcontext(&scheduler, &fibers[i].context);
      finished += fibers[i].done;
    }
    if (finished == n) return true;
    if (finished != 0) {  // some threads returned while others wait at a barrier
      error = "the CPU emulator cannot run this kernel: a barrier or shuffle was not reached by "
              "every thread of the block (divergent control flow)";
      return false;
    }
  }
}

template <typename Kernel, typename... Args>
bool launch(dim3 grid, dim3 block, Kernel kernel, Args... args) {
  const std::function<void()> call = [&] { kernel(args...); };
  gridDim = grid;
  blockDim = block;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3(x, y, z);
        if (!run_block(block, call)) return false;
      }
  return true;
}

}  // namespace emu

inline void __syncthreads() { emu::barrier(); }

// every lane of a warp swaps values with lane ^ mask, through a block-wide board: write, wait
// for all, read. Two boards taken in turns make one barrier enough: before anyone writes a board
// again, everyone has passed the barrier of the shuffle in between, so has read it.
template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  static_assert(sizeof(T) <= 8, "the emulated shuffle moves at most 8 bytes");
  const unsigned me = emu::thread_rank(), other = (me & ~31u) | ((me & 31u) ^ unsigned(lane_mask));
  uint64_t* board = emu::boards[emu::shuffles[me]++ % 2];
  std::memcpy(&board[me], &value, sizeof(T));
  emu::barrier();
  T got;
  std::memcpy(&got, &board[other], sizeof(T));
  return got;
}

// LAUNCH(kernel, grid, block, stream)(args...) is kernel<<<grid, block, 0, stream>>>(args...);
// it evaluates to 0, or 1 with the reason in emu::error.
#define LAUNCH(kernel, grid, block, stream) \
  [&](auto... args) -> int { (void)(stream); return emu::launch(grid, block, kernel, args...) ? 0 : 1; }

inline const char* launch_error(int) { return emu::error ? emu::error : "no error"; }
