"""第 19 章的 main：自定义 kernel。同一份 csrc/kernels.cu，先用 nvcc 编成 H100/H200 的 GPU 版
（这台机器没有 GPU 也能编），再用 g++ 编成 CPU 模拟器版，在 CPU 上真的跑：每个 kernel 和 torch
的算子比一遍；删掉 block 归约里的 __syncthreads，模拟器每次都给出错答案；最后 SmolLM2 的每一层
都走我们的 kernel（模拟器上），回答和 torch 算子逐 token 相同；服务进程也用它们答同一个问题。"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoTokenizer

from minisgl import kernel
from minisgl.core import SamplingParams
from minisgl.kernel import cuda, reference
from minisgl.llm import LLM

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")


def compile_for_the_gpu(tmp: Path) -> None:
    if shutil.which("nvcc") is None:
        print("nvcc not found: the GPU build is skipped (the emulator below needs only g++)")
        return
    cmd = cuda.build_command(False, cuda.CSRC / "kernels.cu", tmp / "gpu.so", arch="sm_90")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    print(f"nvcc -arch=sm_90: exit code {done.returncode}, "
          f"{'a shared library for the GPU' if done.returncode == 0 else done.stderr[-500:]}")


def compare_with_torch() -> None:
    """Each kernel on the emulator against the torch ops it replaces, on random inputs."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x, r = (torch.randn(6, 576, generator=g).to(dtype) for _ in range(2))
        w = torch.randn(576, generator=g).to(dtype)
        gate_up = torch.randn(6, 3072, generator=g).to(dtype)
        qkv = torch.randn(6, 15 * 64 + 2 * 5 * 64, generator=g).to(dtype)  # SmolLM2: 9 q, 3 kv
        q, k = qkv[:, :9 * 64], qkv[:, 9 * 64:12 * 64]
        positions = torch.tensor([0, 1, 2, 40, 41, 99])
        table = torch.randn(128, 64, generator=g)
        pairs = {
            "rms_norm": (cuda.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)),
            "add+rms_norm": (cuda.fused_add_rms_norm(x, r, w, 1e-5),
                             reference.fused_add_rms_norm(x, r, w, 1e-5)),
            "rope": (cuda.rope(positions, q, k, table, 64),
                     reference.apply_rope(positions, q, k, table)),
            "silu_and_mul": (cuda.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)),
        }
        for name, (ours, torchs) in pairs.items():
            ours, torchs = (t if isinstance(t, tuple) else (t,) for t in (ours, torchs))
            worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ours, torchs))
            same = all(torch.equal(a, b) for a, b in zip(ours, torchs))
            print(f"  {str(dtype)[6:]:<8} {name:<13} "
                  f"{'bit-equal to torch' if same else f'max |diff| {worst:.1e}'}")


def missing_barrier(tmp: Path) -> None:
    """The same RMSNorm built without the barrier between writing and reading the partial sums."""
    shutil.copytree(cuda.CSRC, tmp / "csrc")
    source = (tmp / "csrc" / "kernels.cu").read_text()
    (tmp / "csrc" / "kernels.cu").write_text(source.replace("  __syncthreads();", "", 1))
    broken = cuda.open_library(cuda.build(True, tmp / "csrc"))
    x, w = torch.randn(3, 1024, generator=torch.Generator().manual_seed(1)), torch.ones(1024)
    good = cuda.rms_norm(x, w, 1e-6)
    load = cuda.load
    cuda.load = lambda emulate: broken  # type: ignore[assignment]
    try:
        bad, again = cuda.rms_norm(x, w, 1e-6), cuda.rms_norm(x, w, 1e-6)
    finally:
        cuda.load = load  # type: ignore[assignment]
    print(f"without __syncthreads: max |diff| {float((bad - good).abs().max()):.2f} on 3 rows of "
          f"1024; run again, wrong again: {not torch.allclose(again, good)}")


def generate(prompt: list[int], mode: str) -> tuple[list[int], Counter]:
    """12 greedy tokens with MINISGL_KERNELS=mode, and how often each of our kernels ran."""
    os.environ["MINISGL_KERNELS"] = mode
    kernel.mode.cache_clear()
    calls: Counter = Counter()
    call = cuda._call
    cuda._call = lambda t, name, *a: calls.update([name]) or call(t, name, *a)  # type: ignore
    llm = LLM(str(MODEL), dtype=torch.float32, num_page_override=256, max_seq_len_override=128)
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        llm.shutdown()
        cuda._call = call  # type: ignore[assignment]
    return out[0]["token_ids"], calls


def serve(question: str) -> str:
    """The server, its scheduler on our kernels (emulated): one streamed chat answer."""
    sys.path.insert(0, str(Path("tests").resolve()))
    from helpers import ask_server
    from serving import gone  # the server harness of the tests

    os.environ["MINISGL_KERNELS"] = "cuda"  # the server's processes inherit it
    with tempfile.TemporaryDirectory() as tmp:
        text, code, server = ask_server(MODEL, Path(tmp), question, max_tokens=12)
        print(f"MINISGL_KERNELS=cuda python -m minisgl: exit code {code}, all processes gone: "
              f"{gone(server.pids(), 10)}")
    return text


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MINISGL_KERNEL_CACHE"] = tmp  # a cold cache: build on first use, as a reader
        compile_for_the_gpu(Path(tmp))
        start = time.perf_counter()
        cuda.load(True)
        print(f"g++ -DMINISGL_EMULATE: built the emulator in {time.perf_counter() - start:.1f} s")
        print("our kernels on the emulator vs torch's ops:")
        compare_with_torch()
        missing_barrier(Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(MODEL)
        question = "What is the capital of France?"
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               tokenize=True, add_generation_prompt=True,
                                               return_dict=False)
        ours, calls = generate(prompt, "cuda")
        torchs, _ = generate(prompt, "torch")
        end = torchs.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in torchs else None
        answer = tokenizer.decode(torchs[:end], skip_special_tokens=True)  # the server stops there
        print(f"SmolLM2, 12 tokens: ours (emulated) {tokenizer.decode(ours)!r}; torch's ops "
              f"{tokenizer.decode(torchs)!r}; same tokens: {ours == torchs}")
        print("  calls:", ", ".join(f"{name} {n}" for name, n in sorted(calls.items())))
        streamed = serve(question)
        print(f"  streamed {streamed!r}; the offline answer on torch's ops: {streamed == answer}")


if __name__ == "__main__":
    main()
