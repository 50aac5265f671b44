"""LLM: a Scheduler in offline mode: tokenizes in-process, keeps results in a map (chapter 7)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import cast

import torch

from minisgl.core import SamplingParams, prompt_error
from minisgl.scheduler import Scheduler, SchedulerConfig
from minisgl.scheduler.utils import PendingReq, TokenReply


class RequestAllFinished(Exception):
    """Raised by receive_reqs when nothing is left to do: ends run_forever."""


@dataclass
class RequestStatus:
    ignore_eos: bool
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False


def check_requests(prompts: list[str] | list[list[int]],
                   sampling_params: SamplingParams | list[SamplingParams],
                   vocab_size: int) -> list[SamplingParams]:
    """Refuse bad input before any work starts: each prompt is a str or a list of token ids in
    [0, vocab_size), with one SamplingParams for all or one per prompt (returned one per
    prompt). The API server's requests arrive as JSON: its request models check these."""
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} SamplingParams")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            continue
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt {i} must be a str or a list of token ids, "
                             f"got {type(prompt).__name__}")
        # the common case in C loops (half the time of the walk below, which a long prompt
        # in the timed path felt); anything else is walked to name the first bad token
        if set(map(type, prompt)) <= {int} and (not prompt or
                                                 0 <= min(prompt) and max(prompt) < vocab_size):
            continue
        for j, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt {i}: token {j} is {t!r}; a token id is an int in "
                                 f"[0, {vocab_size})")
    return sampling_params


class LLM(Scheduler):
    def __init__(self, model_path: str, dtype: torch.dtype | None = None, **config) -> None:
        """dtype None: bfloat16 on a GPU, float32 on the CPU. `config` takes the keywords of
        SchedulerConfig and EngineConfig: max_running_req, page_size, num_page_override,
        max_seq_len_override, attention_backend, memory_ratio, device, seed, cache_type,
        max_extend_tokens, admission ("expected" or "conservative") and
        schedule_conservativeness, tp_info and dist_init (tensor parallelism runs one process per
        rank, each making its LLM with its own DistributedInfo(rank, size) and the same
        dist_init rendezvous), cuda_graph_max_bs and moe_backend."""
        if dtype is None:
            device = config.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        super().__init__(SchedulerConfig(model_path=model_path, dtype=dtype, **config))
        self.queue: list[PendingReq] = []
        self.status: dict[int, RequestStatus] = {}
        self.vocab_size = self.config.model_config.vocab_size

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams],
                 ) -> list[dict[str, str | list[int]]]:
        """Generate for every prompt (text, or token ids); one dict per prompt, in order, with
        the output `text` and `token_ids` (the EOS token that ended it is left out)."""
        sampling_params = check_requests(prompts, sampling_params, self.vocab_size)
        ids = [self._tokenize(p) for p in prompts]
        for i, x in enumerate(ids):  # refuse before any work starts
            if (error := prompt_error(len(x), self.max_seq_len, f"prompt {i}")) is not None:
                raise ValueError(error)
        self.queue = [PendingReq(uid, x, sp)
                      for uid, (x, sp) in enumerate(zip(ids, sampling_params))]
        self.status = {uid: RequestStatus(sp.ignore_eos) for uid, sp in enumerate(sampling_params)}
        try:
            self.run_forever()
        except RequestAllFinished:
            pass
        if os.environ.get("MINISGL_CHECK_INTEGRITY") == "1":  # a debug switch (the tests')
            self.cache_manager.check_integrity()  # idle: every page is free or cached
        return [{"text": cast(str, self.tokenizer.decode(s.output_ids)), "token_ids": s.output_ids}
                for s in self.status.values()]

    def _tokenize(self, prompt: str | list[int]) -> torch.Tensor:
        if isinstance(prompt, str):
            return torch.tensor(self.tokenizer.encode(prompt), dtype=torch.int32)
        return torch.tensor(prompt, dtype=torch.int32)

    def receive_reqs(self, blocking: bool) -> list[PendingReq]:
        if blocking and not self.queue:
            raise RequestAllFinished
        reqs, self.queue = self.queue, []
        return reqs

    def send_result(self, replies: list[TokenReply]) -> None:
        for r in replies:
            status = self.status[r.uid]
            stopped_by_eos = r.next_token == self.eos_token_id and not status.ignore_eos
            if r.next_token >= 0 and not (r.finished and stopped_by_eos):  # -1: none (failed)
                status.output_ids.append(r.next_token)
            status.finished = r.finished
