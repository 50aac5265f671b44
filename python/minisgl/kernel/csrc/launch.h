// LAUNCH(kernel, grid, block, stream)(args...): a CUDA launch under nvcc, the CPU emulator
// (emu.h) under a host compiler with MINISGL_EMULATE defined (chapter 19).
#pragma once
#ifdef MINISGL_EMULATE
#include "emu.h"
#else
#include <cstdint>
#include <cuda_runtime.h>
#define LAUNCH(kernel, grid, block, stream) \
  [&](auto... args) { kernel<<<grid, block, 0, (cudaStream_t)(stream)>>>(args...); }
#endif
