// LAUNCH(kernel, grid, block, stream)(args...): a CUDA launch under nvcc, the CPU emulator
// (emu.h) under a host compiler with MINISGL_EMULATE defined. Either way it
// evaluates to 0 or an error code that launch_error() explains.
#pragma once
#ifdef MINISGL_EMULATE
#include "emu.h"
#else
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#define LAUNCH(kernel, grid, block, stream)                                   \
  [&](auto... args) -> int {                                                 \
    kernel<<<grid, block, 0, (cudaStream_t)(stream)>>>(args...);             \
    return int(cudaGetLastError());                                          \
  }
inline const char* launch_error(int code) { return cudaGetErrorString(cudaError_t(code)); }
#endif
