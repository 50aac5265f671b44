"""Core data structures: SamplingParams, Req, Batch and the process-wide Context (chapter 1)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:  # layers above this one; only their names are needed here
    from minisgl.attention import BaseAttnBackend, BaseAttnMetadata
    from minisgl.kvcache import BaseCacheHandle, BaseKVCachePool
    from minisgl.moe import BaseMoeBackend

FinishReason = Literal["stop", "length", "abort"]
"""Why a request ended: "stop" (EOS or a stop string), "length" (max_tokens or the context is
full) or "abort" (its client went away)."""


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


def prompt_error(num_tokens: int, max_seq_len: int, name: str = "the prompt") -> str | None:
    """Why a prompt of num_tokens tokens can never run within max_seq_len, or None: it must
    have a last position to sample from, and leave room for one output token. The one rule
    (and message) of both LLM.generate, which raises it, and the server, which answers it as
    a 400; `name` says which prompt."""
    if num_tokens == 0:
        return f"{name} is empty"
    if num_tokens >= max_seq_len:
        return (f"{name} has {num_tokens} tokens; max_seq_len is {max_seq_len}, so a prompt may "
                f"have at most {max_seq_len - 1} (one output token)")
    return None


class Req:
    """One request's state. Its tokens 0..device_len-1 have (or are about to have) KV slots:

    - `cached_len`: tokens whose K/V are already in the cache;
    - `device_len`: tokens the next forward pass will have seen (cached + this step's new ones);
    - `max_device_len`: prompt + output budget, the most this request will ever hold.

    Its tokens live in a host buffer with room for the ones to come: appending a sampled
    token is one store, and `input_ids` is a view of the filled part (a new tensor per token,
    and a tensor's len(), were a step's largest host costs at batch 256).
    """

    def __init__(self, input_ids: torch.Tensor, table_idx: int, cached_len: int, output_len: int,
                 uid: int, sampling_params: SamplingParams,
                 cache_handle: BaseCacheHandle | None = None, retractions: int = 0) -> None:
        if input_ids.device.type != "cpu":
            raise ValueError("Req.input_ids must live on the CPU")
        self.host_len = n = len(input_ids)  # tokens known on the host: len(input_ids)
        self._host = torch.empty(n + min(max(output_len, 0), 256), dtype=input_ids.dtype)
        self._host[:n] = input_ids
        self._host_np = self._host.numpy()
        self.table_idx, self.cached_len, self.output_len = table_idx, cached_len, output_len
        self.uid, self.sampling_params = uid, sampling_params
        self.cache_handle = cache_handle  # what the prefix cache matched for it
        self.retractions = retractions  # times it gave its KV back and was queued again
        self.device_len = n
        self.max_device_len = n + output_len
        if not 0 <= self.cached_len < self.device_len <= self.max_device_len:
            raise ValueError(f"bad lengths: {self}")

    @property
    def input_ids(self) -> torch.Tensor:
        """int32 on the CPU: the prompt, then every sampled token."""
        return self._host[: self.host_len]

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

    def append_host(self, next_token: int | torch.Tensor) -> None:
        """The token sampled for the slot complete_one reserved, onto input_ids."""
        n = self.host_len
        if n == len(self._host):  # full (past 256 tokens, or past the budget in tests): double
            grown = torch.empty(2 * n, dtype=self._host.dtype)
            grown[:n] = self._host
            self._host, self._host_np = grown, grown.numpy()
        self._host_np[n] = int(next_token)
        self.host_len = n + 1

    def __repr__(self) -> str:
        return (f"Req(uid={self.uid}, table_idx={self.table_idx}, cached_len={self.cached_len}, "
                f"device_len={self.device_len}, max_device_len={self.max_device_len})")


@dataclass
class Batch:
    """The requests of one forward pass, all in the same phase."""

    reqs: list[Req]
    phase: Literal["prefill", "decode"]
    # filled by whoever prepares the batch: the scheduler, or a caller by hand
    input_ids: torch.Tensor = field(init=False)  # [sum of extend_len], on the device
    positions: torch.Tensor = field(init=False)  # same shape: each token's position
    out_loc: torch.Tensor = field(init=False)  # same shape: KV slot each token writes
    padded_reqs: list[Req] = field(init=False)  # reqs plus dummies (CUDA graphs)
    # filled by the attention backend
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
    moe_backend: BaseMoeBackend = field(init=False)  # an MoE model's experts
    forward_count: int = field(default=0, init=False)  # forward passes begun
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
