"""The server's command line: the official flag names and defaults (chapter 15)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from minisgl.distributed import DistributedInfo
from minisgl.distributed.shard import local_config
from minisgl.model_config import ModelConfig, load_hf_config
from minisgl.moe import MOE_BACKENDS
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler.admission import ADMISSION_MODES, admission_error

from . import limits
from .limits import Limits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# prompt tokens per prefill step: while a long prompt fills in such steps, running streams get
# every other step; on the CPU a smaller step keeps their gaps short (measured there)
GPU_PREFILL_CHUNK, CPU_PREFILL_CHUNK = 8192, 256
GPU_STREAMING_CHUNK = 2048  # prompt tokens a prefill step computes while flowing streams wait
# The launcher forks its children, and a forked child cannot use CUDA once its parent has
# initialised it: GPUs are counted with torch.cuda.device_count(), which asks NVML and leaves
# CUDA alone, never with torch.cuda.is_available(), which initialises the driver.


@dataclass(frozen=True)
class ServerArgs:
    scheduler: SchedulerConfig
    host: str
    port: int
    num_tokenizer: int
    shell: bool
    limits: Limits  # what a client may do and use

    @property
    def tp_size(self) -> int:
        return self.scheduler.tp_info.size

    @property
    def model_name(self) -> str:
        """What /v1/models and every response call the model: its folder's name."""
        return os.path.basename(os.path.normpath(self.scheduler.model_path))


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    p = argparse.ArgumentParser(prog="python -m minisgl", allow_abbrev=False,
                                description="An OpenAI-compatible LLM server.")
    p.add_argument("--model-path", "--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto: the dtype in the model's config.json (float32 if none)")
    p.add_argument("--tensor-parallel-size", "--tp-size", "--tp", type=int, default=1,
                   dest="tp_size", help="GPUs (or CPU processes) per model")
    p.add_argument("--max-running-requests", type=int, default=256,
                   help="requests decoded together at most (rows of the page table)")
    p.add_argument("--max-seq-len-override", type=int, default=None,
                   help="context length; default: the model's")
    p.add_argument("--memory-ratio", type=float, default=0.9,
                   help="GPU: share of free memory for weights and KV cache")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback: only "
                   "this machine; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=1919)
    p.add_argument("--cuda-graph-max-bs", "--graph", type=int, default=None,
                   help="largest decode batch replayed from a CUDA graph; 0: no graphs; "
                   "default 256 on a GPU, 0 on the CPU")
    p.add_argument("--num-tokenizer", "--tokenizer-count", type=int, default=0,
                   help="tokenizer worker processes; 0: the detokenizer also tokenizes")
    p.add_argument("--max-prefill-length", "--max-extend-length", type=int, default=None,
                   dest="max_extend_tokens", help="prompt tokens one prefill step computes; "
                   f"default {GPU_PREFILL_CHUNK} on a GPU, {CPU_PREFILL_CHUNK} on the CPU")
    p.add_argument("--streaming-prefill-length", type=int, default=None,
                   dest="streaming_extend_tokens", help="while running streams wait for their "
                   "next token, a prefill step computes at most this many prompt tokens and the "
                   "streams get a decode step between such steps: a bound on their inter-token "
                   f"gap, paid in time to first token; 0: off; default {GPU_STREAMING_CHUNK} on "
                   "a GPU, off on the CPU")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from memory)")
    p.add_argument("--page-size", type=int, default=1, help="tokens per KV page")
    p.add_argument("--attention-backend", "--attn", default="auto",
                   help="attention backend; auto picks one for the device")
    p.add_argument("--moe-backend", default="auto", choices=["auto", *MOE_BACKENDS.names()],
                   help="an MoE model's experts; auto: triton on a GPU with Triton, else torch")
    p.add_argument("--cache-type", "--cache", default="radix", choices=["radix", "naive"],
                   help="prefix cache")
    p.add_argument("--admission", default="expected", choices=ADMISSION_MODES,
                   help="expected: a running request keeps the KV room for the output it is "
                   "expected to use, and requests are retracted (and recomputed later) when that "
                   "runs out; conservative: it keeps room for all of max_tokens, never retracted")
    p.add_argument("--schedule-conservativeness", type=float, default=1.0,
                   help="with --admission expected: higher expects more output per request "
                   "(fewer admitted, fewer retractions); raise it if retractions are frequent")
    p.add_argument("--shell-mode", "--shell", action="store_true", dest="shell",
                   help="chat in this terminal instead of serving HTTP")
    limits.add_flags(p)
    a = p.parse_args(argv)
    if a.num_tokenizer < 0:
        p.error(f"--num-tokenizer must be 0 or more, not {a.num_tokenizer}")
    if not os.path.isdir(a.model_path):
        p.error(f"--model {a.model_path}: no such folder (this server loads local models; "
                "`python tools/models.py smollm2` makes one)")
    if error := _tp_error(a.tp_size, a.model_path):
        p.error(error)
    if error := admission_error(a.admission, a.schedule_conservativeness,
                                ("--admission", "--schedule-conservativeness")):
        p.error(error)
    if a.streaming_extend_tokens is None:
        a.streaming_extend_tokens = GPU_STREAMING_CHUNK if torch.cuda.device_count() > 0 else 0
    if a.streaming_extend_tokens < 0:
        p.error(f"--streaming-prefill-length must be 0 (off) or more, not "
                f"{a.streaming_extend_tokens}")
    config = SchedulerConfig(
        model_path=a.model_path, dtype=_dtype(a.dtype, a.model_path),
        max_running_req=a.max_running_requests, attention_backend=a.attention_backend,
        page_size=a.page_size, memory_ratio=a.memory_ratio,
        max_seq_len_override=a.max_seq_len_override, num_page_override=a.num_pages,
        cache_type=a.cache_type, max_extend_tokens=a.max_extend_tokens or _prefill_chunk(),
        streaming_extend_tokens=a.streaming_extend_tokens,
        tp_info=DistributedInfo(0, a.tp_size), cuda_graph_max_bs=a.cuda_graph_max_bs,
        moe_backend=a.moe_backend, admission=a.admission,
        schedule_conservativeness=a.schedule_conservativeness)
    try:
        bounds = limits.from_flags(a, a.max_running_requests)
    except ValueError as e:
        p.error(str(e))
    return ServerArgs(config, host=a.host, port=a.port, num_tokenizer=a.num_tokenizer,
                      shell=a.shell, limits=bounds)


def _tp_error(tp: int, model_path: str) -> str | None:
    """Why the model cannot be split tp ways here, or None: said before any process starts."""
    if tp < 1:
        return f"--tp-size must be 1 or more, not {tp}"
    if 0 < (gpus := torch.cuda.device_count()) < tp:
        return f"--tp-size {tp}: one GPU per rank, and this machine has {gpus}"
    try:
        local_config(ModelConfig.from_hf(load_hf_config(model_path)), DistributedInfo(0, tp))
    except ValueError as e:
        return f"--tp-size {tp}: {e}"
    return None


def _prefill_chunk() -> int:
    return GPU_PREFILL_CHUNK if torch.cuda.device_count() > 0 else CPU_PREFILL_CHUNK


def _dtype(name: str, model_path: str) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    config = load_hf_config(model_path)
    configured = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(str(configured), torch.float32)
