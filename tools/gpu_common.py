"""What the GPU checks share (issue "14 ·"): the tests in tests/gpu/, benchmark/gpu_bench.py and
tools/gpu_tp.py. The tiny models and prompts and the bfloat16 tolerance; an LLM on CUDA with
overlap set; a spy on the logits the sampler sees; relative logits errors step by step; issue
5's speed workload; each of our CUDA kernels beside the torch ops it replaces; a random MoE layer
and a MoE model generating; one run of the server.

tools/ goes on sys.path to import it (tests/gpu/conftest.py and the two scripts put it there).
minisgl, transformers and the rest are imported inside the functions that use them, so that a
machine without CUDA collects tests/gpu quickly and skips it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minisgl.core import SamplingParams
    from minisgl.engine import Engine
    from minisgl.llm import LLM

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral"]
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(40, 72)), [11, 12]]
BF16_TOL = 2e-2  # relative logits error allowed in bfloat16


def shared_prefix_prompts(n: int, prefix_len: int, seed: int) -> list[list[int]]:
    """n prompts of ids in 3..499: one random prefix of prefix_len, then 8 to 10 more each."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 500, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 500, (8 + i % 3,), generator=g).tolist() for i in range(n)]


@contextmanager
def cuda_llm(path: Path, overlap: bool = True, **config: Any) -> Iterator[LLM]:
    """An LLM on CUDA for the block, shut down after it even when the block fails (one Engine at
    a time in a process). The torch backend unless `config` says otherwise (FlashInfer has no
    float32 kernels); CUDA graphs on, as by default (chapter 18). Overlap is set through
    MINISGL_DISABLE_OVERLAP_SCHEDULING, which the Scheduler reads when it is made; the variable
    is put back afterwards."""
    from minisgl.llm import LLM

    key = "MINISGL_DISABLE_OVERLAP_SCHEDULING"
    before = os.environ.get(key)
    os.environ[key] = "0" if overlap else "1"
    config.setdefault("attention_backend", "torch")
    try:
        llm = LLM(str(path), **config)
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
    try:
        assert llm.device.type == "cuda", f"the LLM runs on {llm.device}, not CUDA"
        assert llm.overlap == overlap, f"overlap is {llm.overlap}, asked for {overlap}"
        assert isinstance(llm.stream, torch.cuda.Stream), f"its stream is {llm.stream!r}"
        yield llm
    finally:
        llm.shutdown()


def spy_logits(engine: Engine) -> list[torch.Tensor]:
    """From now on, a float32 copy of every logits tensor the engine hands its sampler (on the
    engine's device), in order."""
    seen: list[torch.Tensor] = []
    sample = engine.sampler.sample

    def spy(logits: torch.Tensor, args: Any) -> torch.Tensor:
        seen.append(logits.float().clone())
        return sample(logits, args)

    engine.sampler.sample = spy  # type: ignore[method-assign]
    return seen


def generate_logged(path: Path, prompts: list[list[int]],
                    params: list[SamplingParams] | SamplingParams,
                    **config: Any) -> tuple[list[list[int]], list[torch.Tensor]]:
    """One generate on a fresh cuda_llm (`overlap` in config, default on): the tokens of every
    prompt and the logits of every step."""
    with cuda_llm(path, config.pop("overlap", True), **config) as llm:
        seen = spy_logits(llm.engine)
        out = llm.generate(prompts, params)
    return [list(o["token_ids"]) for o in out], seen


def relative_errors(got: list[list[int]], ref: list[list[int]], logits: list[torch.Tensor],
                    ref_logits: list[torch.Tensor]) -> list[float]:
    """Per step, the largest |a - b| / |b| (norms over the vocabulary) over the rows whose tokens
    so far are the reference's (teacher-forced: the same inputs); stops at a shape change."""
    errs = []
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        rows = [i for i in range(len(got)) if got[i][:step] == ref[i][:step]]
        if a.shape != b.shape or not rows:
            break
        errs.append(max(float((a[i] - b[i]).norm() / b[i].norm()) for i in rows))
    return errs


def hf_on_cuda(path: Path, dtype: torch.dtype) -> Any:
    """HF's model of `path` on CUDA in `dtype`, for inference; it never stops at EOS (as ours
    with ignore_eos)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


def speed_workload(path: Path, n: int) -> tuple[list[list[int]], list[int]]:
    """Issue 5's workload: n prompts of random ids, input and output lengths uniform in
    100..512, seed 0; the prompts and their output lengths."""
    import transformers

    g = torch.Generator().manual_seed(0)
    in_lens = torch.randint(100, 513, (n,), generator=g).tolist()
    out_lens = torch.randint(100, 513, (n,), generator=g).tolist()
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in in_lens], out_lens


KernelCase = tuple[Callable[[], Any], Callable[[], Any], int]


def kernel_cases(dtype: torch.dtype, t: int) -> dict[str, KernelCase]:
    """Each of our kernels and the torch ops it replaces, on the Qwen3-0.6B shapes for t tokens:
    name -> (ours, torch's, bytes the op must move at least). Needs the kernels built."""
    from minisgl.kernel import cuda, reference

    hidden, hq, hk, d, inter, vocab = 1024, 16, 8, 128, 3072, 151936
    size = torch.finfo(dtype).bits // 8
    g = torch.Generator(device="cuda").manual_seed(t)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    x, r, w = rand(t, hidden), rand(t, hidden), rand(hidden)
    x2, r2 = x.clone(), r.clone()  # ours works in place: its first call sees these values
    qkv, wd = rand(t, (hq + 2 * hk) * d), rand(d)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d]
    positions = torch.randint(0, 4096, (t,), generator=g, device="cuda", dtype=torch.int32)
    angles = torch.outer(torch.arange(4096.0, device="cuda"),
                         1e6 ** (-torch.arange(0, d, 2, device="cuda") / d))
    table = torch.cat([angles.cos(), angles.sin()], -1)
    cos, sin = reference.rope_cos_sin(positions, table, dtype)  # once per forward, not timed
    gate_up = rand(t, 2 * inter)
    slots = 16384
    k_cache, v_cache = rand(slots, hk, d), rand(slots, hk, d)
    kk, vv = rand(t, hk, d), qkv[:, (hq + hk) * d:].view(t, hk, d)
    loc = torch.rand(slots, generator=g, device="cuda").argsort()[:t].to(torch.int32)  # distinct
    emb, ids = rand(vocab, hidden), torch.randint(0, vocab, (t,), generator=g, device="cuda",
                                                  dtype=torch.int32)
    qn = q.view(t, hq, d)
    half = emb[vocab // 2:].contiguous()  # rank 1 of 2 (chapter 16): rows [vocab / 2, vocab)

    def masked() -> torch.Tensor:  # torch's ops for a rank's range, as kernel.embedding has them
        local = ids - vocab // 2
        mine = (local >= 0) & (local < len(half))
        rows = reference.embedding(torch.where(mine, local, 0), half)
        return rows * mine.unsqueeze(-1).to(rows.dtype)

    return {
        "rms_norm [T,1024]": (lambda: cuda.rms_norm(x, w, 1e-6),
                              lambda: reference.rms_norm(x, w, 1e-6), 2 * t * hidden * size),
        "add+rms_norm [T,1024]": (lambda: cuda.fused_add_rms_norm(x2, r2, w, 1e-6),
                                  lambda: reference.fused_add_rms_norm(x, r, w, 1e-6),
                                  4 * t * hidden * size),
        "q_norm [T,16,128] in qkv": (lambda: cuda.rms_norm(qn, wd, 1e-6),
                                     lambda: reference.rms_norm(qn, wd, 1e-6),
                                     2 * t * hq * d * size),
        "rope q,k [T,24,128]": (lambda: cuda.rope(positions, q, k, table, d),
                                lambda: reference.apply_rope_with(q, k, cos, sin),
                                2 * t * (hq + hk) * d * size),
        "silu_and_mul [T,6144]": (lambda: cuda.silu_and_mul(gate_up),
                                  lambda: reference.silu_and_mul(gate_up), 3 * t * inter * size),
        "store_kv [T,8,128]": (lambda: cuda.store_cache(k_cache, v_cache, loc, kk, vv),
                               lambda: reference.store_cache(k_cache, v_cache, loc, kk, vv),
                               4 * t * hk * d * size),
        "embedding [T] of 151936": (lambda: cuda.embedding(ids, emb),
                                    lambda: reference.embedding(ids, emb),
                                    2 * t * hidden * size),
        "embedding, half the vocab": (lambda: cuda.embedding(ids, half, vocab // 2), masked,
                                      2 * t * hidden * size),
    }


MOE_SHAPE = dict(hidden=2048, experts=128, top_k=8, inter=768)  # one Qwen3-30B-A3B layer
MOE_TINY = dict(hidden=64, experts=8, top_k=2, inter=32)  # tiny-qwen3-moe's, for the CPU
# Triton against torch on one layer: the relative error allowed per dtype
MOE_LIMITS = [(torch.bfloat16, BF16_TOL), (torch.float32, 1e-4)]


def moe_layer(tokens: int, hidden: int, experts: int, top_k: int, inter: int,
              dtype: torch.dtype, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random x, gate_up [E, 2I, H], down [E, H, I] and router logits, scaled like a trained
    layer's (unit activations in, unit activations out). top_k is the shape's, not used here."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    return (x.to(device, dtype), gate_up.to(device, dtype), down.to(device, dtype),
            logits.to(device))


def moe_layer_error(backends: dict[str, Any], shape: dict[str, int], tokens: int,
                    dtype: torch.dtype, device: str) -> float:
    """|triton - torch| / |torch| (norms over the whole output, in float64) on one random layer
    of `shape` for `tokens` tokens (seed = tokens), the router renormalising its top k."""
    x, gate_up, down, logits = moe_layer(tokens, **shape, dtype=dtype, device=device, seed=tokens)
    ref, got = (backends[b].forward(x, gate_up, down, logits, shape["top_k"], True)
                for b in ("torch", "triton"))
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def moe_generate(model: Path, device: str, backend: str, dtype: torch.dtype
                 ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """A Qwen3-MoE model generating 24 greedy tokens for 4 random prompts (5, 40, 130 and 17
    ids, seed 0) with `backend`: the tokens, and the logits of every step on the CPU. CUDA
    graphs up to batch 8 on a GPU (the torch backend turns them off), none on the CPU. Attention
    is the torch backend in every run, so only the MoE backend differs (and FlashInfer 0.5.3 has
    no prefill configuration for tiny-qwen3-moe's head_dim 32: on an H100 its prefill raised
    "Invalid configuration")."""
    import transformers

    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 130, 17)]
    llm = LLM(str(model), dtype=dtype, device=device, moe_backend=backend,
              attention_backend="torch", num_page_override=4096, max_seq_len_override=512,
              cuda_graph_max_bs=8 if device == "cuda" else 0)
    try:
        seen = spy_logits(llm.engine)
        out = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    finally:
        llm.shutdown()
    return [list(o["token_ids"]) for o in out], [s.cpu() for s in seen]


@dataclass
class ServeRun:
    """One run of `python -m minisgl`: how it came up, one streamed chat completion through the
    openai client, and how it stopped after SIGTERM."""

    command: list[str]
    ready_s: float
    log_lines: list[str]  # what it logged about its attention backend and its graphs
    chunks: int
    stream_s: float
    finish_reason: str | None
    text: str  # random weights pick ids the small tokenizer has no text for: may be empty
    exit_code: int
    children: int  # its child processes when SIGTERM was sent
    left_running: int  # of those, the ones still alive 10 s after it exited (then killed)

    @property
    def streamed_to_length(self) -> bool:
        """The stream ended because max_tokens was reached, as a run that ignores EOS must."""
        return self.finish_reason == "length"

    @property
    def stopped_clean(self) -> bool:
        return self.exit_code == 0 and self.left_running == 0


def run_server(path: Path, flags: tuple[str, ...] = (), log_dir: Path | None = None) -> ServeRun:
    """`python -m minisgl --attn auto` (and `flags`) serving `path` on a free port, its output in
    LOG_DIR/serve-PORT.log: wait until /health answers (400 s at most), read its log lines on
    the backend and the graphs, stream one chat completion of 32 tokens, then SIGTERM it and its
    processes. Raises, after the SIGTERM, when the server does not come up or the chat fails."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (log_dir or Path(tempfile.gettempdir())) / f"serve-{port}.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                                      os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "minisgl", "--model", str(path), "--attn", "auto", "--port",
           str(port), "--max-seq-len-override", "4096", *flags]
    start = time.perf_counter()
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(server, port, log, start)
        ready_s = time.perf_counter() - start
        log_lines = [line.split(": ", 1)[-1] for line in log.read_text().splitlines()
                     if "attention:" in line or "graphs" in line and "capturing" not in line]
        chat = _stream_one_chat(port)
    finally:
        stopped = _stop(server)
    return ServeRun(cmd, ready_s, log_lines, *chat, *stopped)


def _wait_healthy(server: subprocess.Popen, port: int, log: Path, start: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if server.poll() is not None or time.perf_counter() - start > 400:
            raise RuntimeError(f"no server: {log.read_text()[-2000:]}")
        time.sleep(1)


def _stream_one_chat(port: int) -> tuple[int, float, str | None, str]:
    """Chunks, seconds, the last chunk's finish_reason and the text of one streamed greedy chat
    completion of 32 tokens."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    t = time.perf_counter()
    chunks = list(client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Hello!"}], max_tokens=32,
        temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return len(chunks), time.perf_counter() - t, chunks[-1].choices[0].finish_reason, text


def _stop(server: subprocess.Popen) -> tuple[int, int, int]:
    """SIGTERM to the server: its exit code, how many child processes it had, and how many of
    them were still running 10 s after it exited (those are killed)."""
    import psutil

    try:
        family = psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:  # it died already: the caller's error says why
        family = []
    server.send_signal(signal.SIGTERM)
    code = server.wait(timeout=60)
    _, alive = psutil.wait_procs(family, timeout=10)
    for p in alive:
        p.kill()
    return code, len(family), len(alive)
