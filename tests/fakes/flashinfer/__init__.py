"""A fake `flashinfer` for CPU tests (chapter 17): the two paged wrappers our backend uses, a
plain-torch attention inside, and checks of every argument our backend passes. The constructors,
`plan` and `run` take FlashInfer 0.5.3's parameters by their names and in their order, up to the
last one our backend uses, and nothing else: a keyword the real wrapper lacks (a typo) fails here
with a TypeError, as it would on the GPU. It says nothing about FlashInfer's kernels; the real
ones run on the H200 (chapter 17's GPU runs)."""

from __future__ import annotations

from typing import Any

import torch

calls: list[tuple[str, str]] = []  # ("prefill" | "decode", "plan" | "run"), in order
layouts: list[dict[str, Any]] = []  # what each plan call was given, in order


def _host_int32(name: str, x: torch.Tensor) -> None:
    # the real plan copies these to the host itself: a device tensor would cost a sync
    assert x.dtype == torch.int32 and x.device.type == "cpu", f"{name}: {x.dtype} on {x.device}"


class _Paged:
    kind = ""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert float_workspace_buffer.dtype == torch.uint8 and kv_layout == "NHD"
        self.layout: dict[str, Any] | None = None

    def _plan(self, qo_indptr: torch.Tensor | None, indptr: torch.Tensor, indices: torch.Tensor,
              last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
              page_size: int, causal: bool, sm_scale: float | None, q_data_type: Any,
              kv_data_type: Any) -> None:
        _host_int32("paged_kv_indptr", indptr)
        _host_int32("paged_kv_last_page_len", last_page_len)
        assert indices.dtype == torch.int32, indices.dtype
        bs = len(last_page_len)
        assert len(indptr) == bs + 1 and int(indptr[0]) == 0 and len(indices) == int(indptr[-1])
        pages = indptr[1:] - indptr[:-1]
        assert bool((pages >= 1).all()), "every request has at least one page"
        assert bool(((last_page_len >= 1) & (last_page_len <= page_size)).all())
        kv_lens = (pages - 1) * page_size + last_page_len
        if qo_indptr is None:  # decode: one query per request
            qo_indptr = torch.arange(bs + 1, dtype=torch.int32)
        _host_int32("qo_indptr", qo_indptr)
        q_lens = qo_indptr[1:] - qo_indptr[:-1]
        assert bool((q_lens <= kv_lens).all()), "a query sees at least itself"
        assert num_qo_heads % num_kv_heads == 0
        self.layout = dict(qo_indptr=qo_indptr.tolist(), kv_indptr=indptr.tolist(),
                           indices=indices.long(), kv_lens=kv_lens.tolist(),
                           heads=(num_qo_heads, num_kv_heads, head_dim), page_size=page_size,
                           causal=causal, scale=sm_scale if sm_scale else head_dim**-0.5,
                           dtypes=(q_data_type, kv_data_type or q_data_type))
        calls.append((self.kind, "plan"))
        layouts.append(dict(self.layout, kind=self.kind))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]
            ) -> torch.Tensor:
        layout = self.layout
        assert layout is not None, "run before plan"
        calls.append((self.kind, "run"))
        k_cache, v_cache = paged_kv_cache
        hq, hkv, d = layout["heads"]
        page = layout["page_size"]
        assert k_cache.shape[1:] == (page, hkv, d) and v_cache.shape == k_cache.shape
        assert q.shape == (layout["qo_indptr"][-1], hq, d), q.shape
        assert (q.dtype, k_cache.dtype) == layout["dtypes"], (q.dtype, k_cache.dtype)
        out = torch.empty_like(q)
        keys_all, values_all = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
        for i, kv_len in enumerate(layout["kv_lens"]):
            pages = layout["indices"][layout["kv_indptr"][i]:layout["kv_indptr"][i + 1]]
            slots = (pages[:, None] * page + torch.arange(page)).flatten()[:kv_len]
            a, b = layout["qo_indptr"][i], layout["qo_indptr"][i + 1]
            qi = q[a:b].double().transpose(0, 1)  # [Hq, n, D]
            ki = keys_all[slots].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
            vi = values_all[slots].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
            scores = qi @ ki.transpose(1, 2) * layout["scale"]  # [Hq, n, kv_len]
            if layout["causal"]:  # query j sits at position kv_len - n + j
                n = b - a
                pos = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
                scores = scores.masked_fill(~pos, float("-inf"))
            out[a:b] = (scores.softmax(-1) @ vi).transpose(0, 1).to(q.dtype)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    kind = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None,
                 custom_mask_buf: torch.Tensor | None = None,
                 mask_indptr_buf: torch.Tensor | None = None, backend: str = "auto") -> None:
        buffers = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                   paged_kv_last_page_len_buf, custom_mask_buf, mask_indptr_buf)
        assert not use_cuda_graph and all(b is None for b in buffers), "no prefill graphs"
        assert backend in ("auto", "fa2", "fa3"), backend
        super().__init__(float_workspace_buffer, kv_layout)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: int | None = None, custom_mask: Any = None,
             packed_custom_mask: Any = None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
             window_left: int = -1, logits_soft_cap: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type: Any = "float16", kv_data_type: Any = None, non_blocking: bool = True
             ) -> None:
        assert custom_mask is None and window_left == -1 and pos_encoding_mode == "NONE"
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
                   q_data_type, kv_data_type)


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    kind = "decode"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self.use_tensor_cores = use_tensor_cores
        # graph mode (chapter 18): plan copies the layout into these fixed device buffers, and
        # run reads it from them, as the captured kernels of the real one do
        self.buffers = None
        if use_cuda_graph:
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                       paged_kv_last_page_len_buffer)
            assert all(b is not None and b.dtype == torch.int32 for b in buffers)
            self.buffers = buffers

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, data_type: Any = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             non_blocking: bool = True) -> None:
        assert window_left == -1 and pos_encoding_mode == "NONE"
        self._plan(None, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, False, sm_scale, q_data_type, kv_data_type)
        if self.buffers is not None:
            indptr_buf, indices_buf, last_buf = self.buffers
            assert len(indptr) == len(indptr_buf), "a graph wrapper serves one batch size"
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]
            ) -> torch.Tensor:
        if self.buffers is not None:  # what the fixed buffers hold now, not what plan saw
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():  # a kernel reads device memory; no host read here
                indptr_buf, indices_buf, last_buf = self.buffers
                kv_indptr = indptr_buf.tolist()
                pages = torch.tensor(kv_indptr[1:]) - torch.tensor(kv_indptr[:-1])
                assert self.layout is not None
                self.layout = dict(self.layout, kv_indptr=kv_indptr,
                                   indices=indices_buf[: kv_indptr[-1]].long(),
                                   kv_lens=((pages - 1) * self.layout["page_size"]
                                            + last_buf.cpu()).tolist())
                return super().run(q, paged_kv_cache)
        return super().run(q, paged_kv_cache)
