"""Core data structures: SamplingParams, Req, Batch and the process-wide Context (chapter 1)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:  # these arrive in chapters 4 and 5; only their names are needed here
    from minisgl.attention import BaseAttnBackend, BaseAttnMetadata
    from minisgl.kvcache import BaseKVCachePool
    from minisgl.moe import BaseMoeBackend


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token, and when it stops. Checked where it is made (a
    ValueError names the bad field), and frozen so that it stays valid:

    - `temperature` >= 0; 0 means greedy;
    - `top_k` is -1 (no limit, the default) or >= 1; 1 keeps only the best token;
    - `top_p` in (0, 1]; 1 means no cut;
    - `max_tokens` >= 1: prefill always samples one token.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        rules = {"temperature": (self.temperature >= 0.0, ">= 0 (0 means greedy)"),
                 "top_k": (self.top_k == -1 or self.top_k >= 1, "-1 (no limit) or >= 1"),
                 "top_p": (0.0 < self.top_p <= 1.0, "in (0, 1]"),
                 "max_tokens": (self.max_tokens >= 1, ">= 1")}
        for name, (ok, allowed) in rules.items():
            if not ok:  # also catches NaN, which fails every comparison
                raise ValueError(f"SamplingParams.{name} must be {allowed}, "
                                 f"got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return (self.temperature <= 0.0 or self.top_k == 1) and self.top_p == 1.0


@dataclass(eq=False)
class Req:
    """One request's state. Its tokens 0..device_len-1 have (or are about to have) KV slots:

    - `cached_len`: tokens whose K/V are already in the cache;
    - `device_len`: tokens the next forward pass will have seen (cached + this step's new ones);
    - `max_device_len`: prompt + output budget, the most this request will ever hold.
    """

    input_ids: torch.Tensor  # int32, on the CPU: prompt, then every sampled token
    table_idx: int  # its row of the page table
    cached_len: int
    output_len: int  # how many tokens it may still generate
    uid: int
    sampling_params: SamplingParams
    cache_handle: Any = None  # the prefix-cache handle, from chapter 9 on

    def __post_init__(self) -> None:
        if self.input_ids.device.type != "cpu":
            raise ValueError("Req.input_ids must live on the CPU")
        self.device_len = len(self.input_ids)
        self.max_device_len = len(self.input_ids) + self.output_len
        if not 0 <= self.cached_len < self.device_len <= self.max_device_len:
            raise ValueError(f"bad lengths: {self}")

    @property
    def extend_len(self) -> int:
        """Tokens this step computes: the whole uncached prompt in prefill, 1 in decode."""
        return self.device_len - self.cached_len

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    @property
    def can_decode(self) -> bool:
        return self.remain_len > 0

    def complete_one(self) -> None:
        """After a forward pass: all seen tokens are cached, and one more slot is reserved
        for the token about to be sampled (the next step's input)."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_host(self, next_token: torch.Tensor) -> None:
        self.input_ids = torch.cat([self.input_ids, next_token.view(1).to(self.input_ids)])

    def __repr__(self) -> str:
        return (f"Req(uid={self.uid}, table_idx={self.table_idx}, cached_len={self.cached_len}, "
                f"device_len={self.device_len}, max_device_len={self.max_device_len})")


@dataclass
class Batch:
    """The requests of one forward pass, all in the same phase."""

    reqs: list[Req]
    phase: Literal["prefill", "decode"]
    # filled by whoever prepares the batch (by hand until chapter 7, then the scheduler)
    input_ids: torch.Tensor = field(init=False)  # [sum of extend_len], on the device
    positions: torch.Tensor = field(init=False)  # same shape: each token's position
    out_loc: torch.Tensor = field(init=False)  # same shape: KV slot each token writes
    padded_reqs: list[Req] = field(init=False)  # reqs plus dummies (CUDA graphs, chapter 18)
    # filled by the attention backend (chapter 5)
    attn_metadata: BaseAttnMetadata = field(init=False)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def padded_size(self) -> int:
        return len(self.padded_reqs)


@dataclass
class Context:
    """What every layer may read during a forward pass; one per process."""

    page_size: int
    page_table: torch.Tensor = field(init=False)  # [rows, max_seq_len]: token slot per position
    kv_cache: BaseKVCachePool = field(init=False)
    attn_backend: BaseAttnBackend = field(init=False)
    moe_backend: BaseMoeBackend = field(init=False)  # an MoE model's experts (chapter 20)
    forward_count: int = field(default=0, init=False)  # forward passes begun (chapter 18)
    _batch: Batch | None = field(default=None, init=False)

    @property
    def batch(self) -> Batch:
        if self._batch is None:
            raise RuntimeError("no batch is running: call the model inside ctx.forward_batch()")
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        """Make `batch` the current batch for the duration of one forward pass."""
        if self._batch is not None:
            raise RuntimeError("forward_batch() does not nest")
        self._batch = batch
        self.forward_count += 1
        try:
            yield
        finally:
            self._batch = None


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context | None) -> None:
    """Install the process's Context (an Engine does this); None removes it again."""
    global _GLOBAL_CTX
    if ctx is not None and _GLOBAL_CTX is not None:
        raise RuntimeError("a global Context is already set: shut the old engine down first")
    _GLOBAL_CTX = ctx


def forward_count() -> int:
    """The installed Context's forward passes so far; 0 without one (layers tested alone)."""
    return 0 if _GLOBAL_CTX is None else _GLOBAL_CTX.forward_count


def get_global_ctx() -> Context:
    if _GLOBAL_CTX is None:
        raise RuntimeError("no global Context: create an Engine (or call set_global_ctx) first")
    return _GLOBAL_CTX
