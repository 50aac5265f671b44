"""A fake sgl_kernel.flash_attn for CPU tests (chapter 17): flash_attn_with_kvcache with
sgl-kernel 0.3.17's signature, checks of the arguments our fa backend passes, and a plain-torch
attention inside. FlashAttention 3 itself (far too large to carry to the H200) is not checked
anywhere in this book."""

from __future__ import annotations

from typing import Any

import torch

calls: list[dict[str, Any]] = []


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Any = None, v: Any = None, qv: Any = None, rotary_cos: Any = None,
                            rotary_sin: Any = None, cache_seqlens: torch.Tensor | None = None,
                            cache_batch_idx: Any = None, cache_leftpad: Any = None,
                            page_table: torch.Tensor | None = None,
                            cu_seqlens_q: torch.Tensor | None = None,
                            cu_seqlens_k_new: Any = None, max_seqlen_q: int | None = None,
                            rotary_seqlens: Any = None, q_descale: Any = None,
                            k_descale: Any = None, v_descale: Any = None,
                            softmax_scale: float | None = None, causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1), attention_chunk: Any = None,
                            softcap: float = 0.0, rotary_interleaved: bool = True,
                            scheduler_metadata: Any = None, num_splits: int = 0,
                            pack_gqa: Any = None, sm_margin: int = 0,
                            return_softmax_lse: bool = False, sinks: Any = None,
                            ver: int = 3) -> torch.Tensor:
    assert k is None and v is None, "new K/V are stored by the pool before attention"
    assert cache_seqlens is not None and page_table is not None and cu_seqlens_q is not None
    for name, x in (("cache_seqlens", cache_seqlens), ("page_table", page_table),
                    ("cu_seqlens_q", cu_seqlens_q)):
        assert x.dtype == torch.int32 and x.device == q.device, f"{name}: {x.dtype} {x.device}"
    bs = len(cache_seqlens)
    assert page_table.shape[0] == bs and len(cu_seqlens_q) == bs + 1
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    assert int(cu_seqlens_q[-1]) == q.shape[0] and max(q_lens) == max_seqlen_q
    page = k_cache.shape[1]
    assert int(cache_seqlens.max()) <= page_table.shape[1] * page, "table too narrow"
    assert k_cache.shape == v_cache.shape and k_cache.dtype == q.dtype
    calls.append(dict(causal=causal, scale=softmax_scale, bs=bs))
    hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    keys_all, values_all = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    out = torch.empty_like(q)
    for i, n in enumerate(q_lens):
        kv_len, a = int(cache_seqlens[i]), int(cu_seqlens_q[i])
        pos = torch.arange(kv_len)
        slots = page_table[i, pos // page].long() * page + pos % page
        qi = q[a:a + n].double().transpose(0, 1)
        ki = keys_all[slots].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        vi = values_all[slots].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        scores = qi @ ki.transpose(1, 2) * scale
        if causal:  # bottom-right aligned: query j sits at kv_len - n + j
            seen = pos[None, :] <= (kv_len - n + torch.arange(n))[:, None]
            scores = scores.masked_fill(~seen, float("-inf"))
        out[a:a + n] = (scores.softmax(-1) @ vi).transpose(0, 1).to(q.dtype)
    return out
