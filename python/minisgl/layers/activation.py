"""SwiGLU's activation: silu(gate) * up on a merged [.., 2 * intermediate] input (chapter 2)."""

from minisgl.kernel import silu_and_mul

__all__ = ["silu_and_mul"]
