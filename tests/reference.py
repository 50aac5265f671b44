"""Hugging Face transformers as the independent reference for alignment tests (chapter 0)."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

LOGIT_TOL = 1e-3  # max |Δlogit| allowed in float32 at every decode step
MIN_DISTINCT = 6  # 16 greedy tokens must hold this many distinct ids


def require_model(path: Path) -> Path:
    """`path` when it holds a model; else exit saying how to download it (the mains use this)."""
    if not (path / "config.json").is_file():
        sys.exit(f"{path} is missing: run `python tools/models.py smollm2` in the repository root")
    return path


@lru_cache(maxsize=4)
def hf_model(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # never stop early: the engines ignore EOS too
    return model


@lru_cache(maxsize=4)
def hf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


Reference = tuple[list[int], list[torch.Tensor]]


def kept_for_the_run(generate: Callable[[Path, list[int], int], Reference]
                     ) -> Callable[[Path, list[int], int], Reference]:
    """Where MINISGL_REFERENCE_CACHE names a folder (`make test` makes a fresh one and removes
    it at the end), HF's answer is kept there for the other processes of the same run: the live
    tests, every tree's tests and mains ask it the same questions. The key: the model's files
    (path, size, modification time), the prompt, n and the torch and transformers versions."""

    @functools.wraps(generate)
    def kept(path: Path, prompt: list[int], n: int) -> Reference:
        folder = os.environ.get("MINISGL_REFERENCE_CACHE")
        if not folder:
            return generate(path, prompt, n)
        import transformers

        files = [(str(f), f.stat().st_size, f.stat().st_mtime_ns)
                 for f in sorted(Path(path).resolve().iterdir()) if f.is_file()]
        key = repr([files, [int(t) for t in prompt], n, torch.__version__,
                    transformers.__version__])
        file = Path(folder) / (hashlib.sha256(key.encode()).hexdigest() + ".pt")
        if file.is_file():
            tokens, logits = torch.load(file, weights_only=True)
            return tokens, list(logits)
        tokens, logits_list = generate(path, prompt, n)
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:  # whole or not at all
            torch.save((tokens, torch.stack(logits_list) if logits_list else torch.empty(0)), f)
        os.replace(f.name, file)
        return tokens, logits_list

    return kept


@kept_for_the_run
def hf_greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF `generate`, greedy: the n new tokens and the raw logits [vocab] of every step."""
    ids = torch.tensor([prompt])
    # An explicit mask: otherwise HF guesses one and hides every prompt token equal to the pad id
    # (SmolLM2's pad id is <|im_end|>, which every chat prompt contains).
    out = hf_model(path).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt):].tolist(), [x[0].float() for x in out.logits]


def assert_aligned(tokens: list[int], logits: list[torch.Tensor],
                   ref_tokens: list[int], ref_logits: list[torch.Tensor]) -> float:
    """Same tokens, enough distinct ids, logits within LOGIT_TOL at every step; returns max |Δ|."""
    assert tokens == ref_tokens, f"tokens differ:\n ours {tokens}\n HF   {ref_tokens}"
    assert len(set(tokens)) >= MIN_DISTINCT, f"only {len(set(tokens))} distinct ids in {tokens}"
    assert len(logits) == len(ref_logits)
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    assert worst <= LOGIT_TOL, f"max |Δlogit| {worst:.2e} > {LOGIT_TOL}"
    return worst
