"""A fake `flashinfer` for CPU tests (chapter 17): the two paged wrappers our backend uses, with
FlashInfer 0.5.3's constructor, `plan` and `run` signatures, a plain-torch attention inside, and
checks of every argument our backend passes. It says nothing about FlashInfer's kernels; the
real ones are checked on the H200 (tools/gpu_check.py)."""

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

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 **kwargs: Any) -> None:
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

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
            *args: Any, **kwargs: Any) -> torch.Tensor:
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

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: int | None = None, custom_mask: Any = None,
             packed_custom_mask: Any = None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
             window_left: int = -1, logits_soft_cap: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type: Any = "float16", kv_data_type: Any = None, non_blocking: bool = True,
             **kwargs: Any) -> None:
        assert custom_mask is None and window_left == -1 and pos_encoding_mode == "NONE"
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
                   q_data_type, kv_data_type)


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    kind = "decode"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, data_type: Any = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             non_blocking: bool = True, **kwargs: Any) -> None:
        assert window_left == -1 and pos_encoding_mode == "NONE"
        self._plan(None, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, False, sm_scale, q_data_type, kv_data_type)
