"""Chapter 16: the offline LLM on tp real processes over gloo gives HF's greedy tokens. Every
rank runs the same scheduler on the same prompts, so they step through the same batches."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo

from helpers import run_ranks
from reference import hf_greedy

PROMPTS = [[5, 80, 200, 31, 7, 99], [260, 18, 44], list(range(40, 100))]


def _generate(path: str, tp: DistributedInfo, rendezvous: str
              ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of PROMPTS, and the logits of every step as the sampler saw them."""
    from minisgl.llm import LLM

    llm = LLM(path, dtype=torch.float32, num_page_override=512, tp_info=tp,
              dist_init=rendezvous)
    seen: list[torch.Tensor] = []
    sample = llm.engine.sampler.sample
    llm.engine.sampler.sample = lambda logits, args: seen.append(logits.clone()) or sample(
        logits, args)
    try:
        got = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
        return [g["token_ids"] for g in got], seen
    finally:
        llm.shutdown()


def _rank(rank: int, size: int, rendezvous: str, path: str, out: mp.Queue) -> None:
    tokens, logits = _generate(path, DistributedInfo(rank, size), rendezvous)
    out.put((rank, tokens, [x.tolist() for x in logits]))  # plain data: the process ends


def _assert_tp_matches(path: Path, size: int, tmp_path: Path) -> None:
    """tp ranks over gloo: on every rank HF's greedy tokens, and logits equal to one rank's."""
    results, _ = run_ranks(_rank, size, tmp_path, str(path), timeout_s=180)
    expected = [hf_greedy(path, p, 8)[0] for p in PROMPTS]
    _, one_rank_logits = _generate(str(path), DistributedInfo(0, 1), "")
    for _, tokens, logits in results:
        assert tokens == expected  # every rank, the same tokens, HF's
        assert len(logits) == len(one_rank_logits)  # the same batches, step by step
        for a, b in zip(logits, one_rank_logits):
            assert torch.tensor(a).shape == b.shape  # as many columns as the vocabulary
            assert (torch.tensor(a) - b).abs().max() <= 1e-4  # and the same logits as one rank


@pytest.mark.parametrize("arch,size", [("tiny-qwen3", 2), ("tiny-llama", 2), ("tiny-qwen2", 2),
                                       ("tiny-mistral", 2), ("tiny-llama-kv1", 2),  # KV copied
                                       ("tiny-qwen3", 4)])  # 2 KV heads on 4 ranks: copied
def test_tp_gives_hf_greedy_tokens(arch: str, size: int, tmp_path: Path,
                                   model_dir: Callable[[str], Path]) -> None:
    _assert_tp_matches(model_dir(arch), size, tmp_path)


def _cut_vocabulary(src: Path, dst: Path, vocab: int) -> Path:
    """A copy of the checkpoint at `src` whose vocabulary is its first `vocab` tokens."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    old, config["vocab_size"] = config["vocab_size"], vocab
    (dst / "config.json").write_text(json.dumps(config))
    [file] = sorted(src.glob("*.safetensors"))
    tensors = load_file(file)
    save_file({k: v[:vocab] if v.shape[0] == old else v for k, v in tensors.items()},
              dst / file.name)
    return dst


@pytest.mark.parametrize("arch,size", [("tiny-qwen3", 2), ("tiny-llama", 4)])
def test_tp_with_a_vocabulary_no_rank_count_divides(arch: str, size: int, tmp_path: Path,
                                                    model_dir: Callable[[str], Path]) -> None:
    """509 tokens (a prime): the last rank's share of the embedding and of the LM head (tied in
    tiny-qwen3, its own in tiny-llama) ends in padding rows, which must neither be looked up nor
    win the argmax; the logits are cut back to 509."""
    path = _cut_vocabulary(model_dir(arch), tmp_path / "model", 509)
    _assert_tp_matches(path, size, tmp_path)
