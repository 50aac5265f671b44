"""Chapter 0: the naive engine equals HF transformers token for token, logits at every step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from naive import NaiveEngine, rms_norm, rope
from reference import assert_aligned, hf_greedy, hf_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:"]
MODELS = ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral", "SmolLM2-135M-Instruct"]


@pytest.fixture(scope="module", params=MODELS)
def model(request, model_dir) -> tuple[Path, NaiveEngine]:
    path = model_dir(request.param)
    return path, NaiveEngine(path)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_matches_hf_token_for_token(model, prompt: str) -> None:
    path, engine = model
    ids = hf_tokenizer(path)(prompt)["input_ids"]
    tokens, logits = engine.generate(ids, 16)
    assert_aligned(tokens, logits, *hf_greedy(path, ids, 16))


def test_chat_prompt_on_smollm2(model_dir) -> None:
    path = model_dir("SmolLM2-135M-Instruct")
    tok = hf_tokenizer(path)
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    tokens, logits = NaiveEngine(path).generate(ids, 16)
    assert_aligned(tokens, logits, *hf_greedy(path, ids, 16))


def test_eos_stops_generation(model_dir) -> None:
    path = model_dir("tiny-qwen3")
    engine = NaiveEngine(path)
    tokens, _ = engine.generate([5, 6, 7, 8], 16)
    stop = tokens[3]  # pretend the 4th token is EOS: generation ends at its first occurrence
    cut, logits = engine.generate([5, 6, 7, 8], 16, eos_id=stop)
    assert cut == tokens[: tokens.index(stop) + 1] and len(logits) == len(cut)


def test_cache_reuse_equals_full_recompute(model_dir) -> None:
    """Logits of the last token are the same whether the prefix came from the cache or not."""
    engine = NaiveEngine(model_dir("tiny-llama"))
    ids = [11, 42, 7, 300, 9, 128]
    engine.reset()
    full = engine.forward(ids)[-1]
    engine.reset()
    engine.forward(ids[:4])
    engine.forward(ids[4:5])
    step = engine.forward(ids[5:])[-1]
    assert torch.allclose(full, step, atol=1e-5)


def test_rms_norm_against_float64() -> None:
    x = torch.randn(5, 64)
    w = torch.rand(64)
    x64 = x.double()
    ref = w.double() * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(rms_norm(x, w, 1e-6).double(), ref, atol=1e-5)


def test_rope_against_complex_rotation() -> None:
    """Independent reference: (x[j], x[j + d/2]) as a complex number turned by pos * freq[j]."""
    t, h, d, theta = 7, 3, 16, 10000.0
    x = torch.randn(t, h, d, dtype=torch.float64)
    pos = torch.arange(3, 3 + t)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    freq = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    z = z * torch.polar(torch.ones_like(freq), pos[:, None].double() * freq)[:, None, :]
    ref = torch.cat([z.real, z.imag], -1)
    assert torch.allclose(rope(x.float(), pos, theta).double(), ref, atol=1e-5)


def test_missing_model_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tools/models.py"):
        NaiveEngine(tmp_path / "nope")


def test_unsupported_architecture_is_refused(model_dir, tmp_path: Path) -> None:
    src = model_dir("tiny-qwen3-moe")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        NaiveEngine(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
