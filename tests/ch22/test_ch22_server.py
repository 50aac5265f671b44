"""Chapter 22: the server under KV pressure. Twelve clients at once on a pool of 120 tokens
with a low guess of their output: the scheduler retracts, /debug/scheduler counts it, every
client still gets the text of a pool that never retracts, and once idle every row and page is
back and the ratio is at its start again."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from driver import prompts, reference
from serving import Server

BATCH, MAX_TOKENS = prompts(12), 48


def test_debug_scheduler_counts_retractions(model_dir: Callable[[str], Path],
                                            tmp_path: Path) -> None:
    path = model_dir("tiny-qwen3")
    expected = reference(path, tuple(map(tuple, BATCH)), MAX_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    server = Server(path, tmp_path, "--num-pages", "120", "--schedule-conservativeness", "0.1")
    try:
        server.wait_ready()
        before = server.stats()
        assert (before["retractions"], before["retracted_reqs"], before["recomputed_tokens"]) \
            == (0, 0, 0) and before["new_token_ratio"] == pytest.approx(0.07)

        def complete(prompt: list[int]) -> str:
            status, raw = server.request("POST", "/v1/completions", {
                "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}, timeout=60)
            assert status == 200, raw
            return json.loads(raw)["choices"][0]["text"]

        with ThreadPoolExecutor(len(BATCH)) as pool:
            texts = list(pool.map(complete, BATCH))
        assert texts == [tokenizer.decode(out, skip_special_tokens=True) for out in expected]
        deadline = time.monotonic() + 30
        while not (stats := server.stats())["idle"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stats["idle"] and stats["integrity"] == "ok", stats
        assert stats["retractions"] > 0 and stats["retracted_reqs"] >= stats["retractions"]
        assert stats["recomputed_tokens"] > 0 and stats["new_token_ratio"] == pytest.approx(0.07)
        assert "KV cache pool is full: retracted" in server.log.read_text()
    finally:
        server.stop()
