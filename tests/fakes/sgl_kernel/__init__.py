"""A fake `sgl_kernel` package for CPU tests (chapter 17): see flash_attn.py."""
