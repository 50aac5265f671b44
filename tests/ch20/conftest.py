"""Chapter 20's tests run the Triton MoE kernel in Triton's interpreter when there is no GPU.

`triton.jit` decides between compiling and interpreting when it decorates a kernel, that is when
minisgl/kernel/fused_moe.py is first imported, and it reads TRITON_INTERPRET then. Only the
triton MoE backend imports that module, lazily, and pytest imports this file while it collects,
before any test runs; so setting the variable here, at import, reaches every kernel these tests
launch, in this process and in the processes they start (the server, the TP ranks), which inherit
the environment. On a machine with CUDA it is left alone: there the same tests compile the kernel
for the GPU. In a whole-suite run the variable stays set for the other chapters too; nothing
else imports Triton."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
