"""Chapter 21: what the online comparison stands on. The scheduler's step trace, one torch thread
beside a GPU, the integrity walk as a switch, and benchmark/online.py (its summaries on known
input, then a real run against our server on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from benchmarks import FOLDER, load

from minisgl.core import SamplingParams
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.trace import LaunchProfile
from minisgl.utils import device as device_utils

online = load("online")


def test_the_step_trace_accounts_for_every_token(make_llm: Callable, model_dir: Callable,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With MINISGL_STEP_TRACE set, one row per loop step: the prefill rows carry every prompt
    token once, the decode rows every output token after the first, and each part's time."""
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINISGL_STEP_TRACE", str(trace))
    llm = make_llm(model_dir("tiny-qwen3"), overlap=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 17, 30)]
    outs = [4, 7, 5]
    llm.generate(prompts, [SamplingParams(max_tokens=k, ignore_eos=True) for k in outs])
    llm.trace.write()
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    prefill = [r for r in rows if r.get("phase") == "prefill"]
    decode = [r for r in rows if r.get("phase") == "decode"]
    assert sum(r["tokens"] for r in prefill) == sum(map(len, prompts))  # distinct: no cache hits
    assert sum(r["size"] for r in decode) == sum(k - 1 for k in outs)
    assert all(r["tokens"] == r["size"] for r in decode)
    for r in rows:
        assert all(r[p] >= 0 for p in online.PARTS)
    times = [r["t"] for r in rows]
    assert times == sorted(times)
    assert len(rows) == len(prefill) + len(decode) + 1  # the last step only finishes the last


def test_no_trace_without_the_variable(make_llm: Callable, model_dir: Callable,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINISGL_STEP_TRACE", raising=False)
    assert make_llm(model_dir("tiny-qwen3")).trace is None


def test_the_launch_profile_ranks_the_ops_inside_prefill_launches(
        make_llm: Callable, model_dir: Callable, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """MINISGL_LAUNCH_PROFILE=FILE:2: the profiler covers the first two prefill launches and
    writes at the second; the operators it ranks ran inside them (their host time fits in
    the launches' time), and the model's matmuls are among them. Without it: no profiler."""
    out = tmp_path / "launch.json"
    monkeypatch.setenv("MINISGL_LAUNCH_PROFILE", f"{out}:2")
    llm = make_llm(model_dir("tiny-qwen3"), overlap=True)
    rng = random.Random(5)
    for n in (12, 20, 7):  # one prefill launch each; the third comes after the file is written
        llm.generate([[rng.randrange(3, 500) for _ in range(n)]],
                     SamplingParams(max_tokens=3, ignore_eos=True))
    result = json.loads(out.read_text())
    assert result["launches"] == 2 and result["launch_ms"] > 0
    names = [name for name, _, _ in result["ops"]]
    assert any(n in names for n in ("aten::mm", "aten::addmm", "aten::linear")), names
    assert sum(ms for _, ms, _ in result["ops"]) <= result["launch_ms"] * 1.05
    monkeypatch.delenv("MINISGL_LAUNCH_PROFILE")
    assert LaunchProfile.from_env() is None


def test_one_torch_thread_beside_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        assert device_utils.set_host_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        assert device_utils.set_host_threads() == 2  # the user's choice stands
    finally:
        torch.set_num_threads(before)


def test_the_integrity_walk_is_a_switch(make_llm: Callable, model_dir: Callable,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, generate never walks the pages (it is not a cost of every call); on, it does."""
    llm = make_llm(model_dir("tiny-qwen3"))
    walks: list[int] = []
    monkeypatch.setattr(llm.cache_manager, "check_integrity", lambda: walks.append(1))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    monkeypatch.delenv("MINISGL_CHECK_INTEGRITY")
    llm.generate([[5, 6, 7]], params)
    assert walks == []
    monkeypatch.setenv("MINISGL_CHECK_INTEGRITY", "1")
    llm.generate([[5, 6, 7]], params)
    assert walks == [1]


def test_the_trace_summary_splits_runs_and_phases(tmp_path: Path) -> None:
    rows = [{"t": 1.0, "receive": 0.1, "prepare": 2.0, "launch": 20.0, "wait": 0.0,
             "reply": 0.5, "phase": "prefill", "size": 4, "tokens": 4000},
            {"t": 1.1, "receive": 0.0, "prepare": 1.0, "launch": 0.5, "wait": 3.0,
             "reply": 1.0, "phase": "decode", "size": 8, "tokens": 8},
            {"t": 1.2, "receive": 0.0, "prepare": 3.0, "launch": 0.5, "wait": 1.0,
             "reply": 1.0, "phase": "decode", "size": 8, "tokens": 8},
            {"t": 5.0, "receive": 0.0, "prepare": 9.0, "launch": 9.0, "wait": 9.0,
             "reply": 9.0, "phase": "decode", "size": 2, "tokens": 2}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = online.summarize_trace(path, [("a", 0.5, 1.5), ("b", 4.0, 6.0), ("none", 7.0, 8.0)])
    assert set(s) == {"a", "b"}
    a = s["a"]
    assert a["steps"] == 3 and a["prefill"]["count"] == 1 and a["decode"]["count"] == 2
    assert a["decode"]["prepare"] == 2.0 and a["decode"]["wait"] == 2.0
    assert a["decode"]["size_p50"] == 8
    assert a["wait_share"] == pytest.approx(4.0 / 1e3 / 1.0)
    assert a["host_share"] == pytest.approx((2 + 20 + 0.5 + 1 + 0.5 + 1 + 3 + 0.5 + 1) / 1e3)
    assert s["b"]["steps"] == 1 and s["b"]["prefill"]["count"] == 0


def test_a_lone_requests_first_token_is_split_into_hops() -> None:
    # sent at 10.000 s, picked up by the loop 3 ms later (receive ends at 10.003), prefill 1 +
    # 5 ms; the next step (2 + 1 + 0 + 4 ms) hands its token out at 10.015; the client reads it
    # at 10.020. A second request whose prefill the trace missed is counted, not matched. A
    # third one's token reached the client (30.010) before the step that sent it ended (30.012):
    # matched all the same, its `out` below zero.
    def step(t: float, receive: float, parts: tuple[float, ...], phase: str) -> dict:
        return {"t": t, "receive": receive, **dict(zip(online.PARTS[1:], parts)),
                "phase": phase, "size": 1, "tokens": 1}

    steps = [step(9.0, 1003.0, (1.0, 5.0, 0.0, 0.0), "prefill"),
             step(10.009, 0.0, (2.0, 1.0, 0.0, 3.0), "decode"),
             step(10.015, 0.0, (1.0, 1.0, 0.0, 1.0), "decode"),
             step(29.9, 100.5, (1.0, 2.0, 0.0, 0.0), "prefill"),
             step(30.0035, 0.0, (2.0, 2.0, 0.0, 4.5), "decode")]
    hops = online.first_token_hops(steps, [[10.0, 0.020], [20.0, 0.020], [30.0, 0.010]])
    assert hops["matched"] == 2 and hops["of"] == 3
    assert hops["each"][0] == pytest.approx([3.0, 12.0, 5.0])
    assert hops["each"][1] is None
    assert hops["each"][2] == pytest.approx([0.5, 11.5, -2.0])
    assert hops["in"] == pytest.approx(1.75)  # medians of the matched


def test_lone_requests_are_compared_prompt_by_prompt() -> None:
    def run(each: list) -> dict:
        return {"c=1 r0": {"first_token_ms": {"each": each}}, "c=4 r0": {}}

    traces = {"a": run([[1.0, 10.0, 1.0], [2.0, 20.0, 1.0], None]),
              "b": run([[1.5, 12.0, 1.0], [2.0, 21.0, 1.0], [9.0, 9.0, 9.0]])}
    [line] = online.paired_hops(traces, ["a", "b"])
    assert line.startswith("first token c=1 r0, b − a, ms per request (2): ")
    assert "in +0.25 (+0.00..+0.00)" in line  # the median of +0.5 and 0: pairs, not medians
    assert "scheduler +1.50 (+1.00..+1.00)" in line and "total +1.75" in line


def test_the_report_gives_ratios_per_round() -> None:
    def row(engine: str, rnd: int, tok: float) -> dict:
        return {"engine": engine, "round": rnd, "load": "c=4", "out_tok_s": tok,
                "ttft_ms_p50": 10.0, "itl_ms_p99": 5.0, "client_cpu": 0.1}

    rows = [row("ours", 0, 100), row("other", 0, 50), row("ours", 1, 120), row("other", 1, 90)]
    text = online.report(rows, ["ours", "other"], ["c=4"])
    assert "110 (100–120)" in text[1]
    assert text[2].endswith("0.62 (0.50–0.75)")  # 50/100 and 90/120, median of the two


def test_pooled_rounds_rename_engines_and_count_the_lower_rounds() -> None:
    def row(engine: str, rnd: int, tok: float, ttft: float, itl: float) -> dict:
        return {"engine": engine, "round": rnd, "load": "c=4", "out_tok_s": tok,
                "ttft_ms_p50": ttft, "itl_ms_p99": itl, "client_cpu": 0.1}

    # run 1 names ours "new" beside an engine that is dropped; run 2 calls it "ours"
    one = {"rows": [row("base", 0, 100, 10, 5), row("new", 0, 120, 12, 4),
                    row("old", 0, 1, 1, 1)]}
    two = {"rows": [row("ours", 0, 90, 20, 6), row("base", 0, 100, 15, 6),
                    row("base", 1, 100, 15, 6), row("ours", 1, 150, 10, 7)]}
    text = online.pooled([(one, {"base": "base", "new": "ours"}), (two, {})])
    assert [line.split()[1] for line in text[1:]] == ["base", "ours"]
    # ratios 1.2, 0.9, 1.5 (rounds of the two runs kept apart); the base's TTFT lower in
    # rounds 1 and 2 of the three, its ITL p99 lower in 2 (one of them a tie)
    assert "1.20 (0.90–1.50)" in text[2] and text[2].endswith("2/3, 2/3"), text


def test_pyspy_summary(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text("main (m.py:1);f (minisgl/a.py:3);cudaSync (libcuda.so) 7\n"
                   "main (m.py:1);g (minisgl/b.py:9) 3\n")
    s = online.summarize_pyspy(raw)
    assert s["samples"] == 10
    assert s["self"] == [("cudaSync (libcuda.so)", 7), ("g (minisgl/b.py:9)", 3)]
    assert dict(s["minisgl_inclusive"]) == {"f (minisgl/a.py:3)": 7, "g (minisgl/b.py:9)": 3}


def test_prompt_tokens_counts_what_the_server_tokenizes(model_dir: Callable[[str], Path]) -> None:
    """A chat request's prompt, counted by the client as our TokenizeManager counts it (chat
    template, no special tokens added twice); token ids count as they are."""
    from transformers import AutoTokenizer

    from minisgl.message import TokenizeMsg
    from minisgl.tokenizer.tokenize import TokenizeManager

    tok = AutoTokenizer.from_pretrained(model_dir("tiny-qwen3"))
    texts = ["hello world", "the cat sat on the mat " * 7]
    server = TokenizeManager(tok)
    want = [len(server.tokenize(TokenizeMsg(uid=i, prompt=[{"role": "user", "content": t}],
                                            sampling_params=SamplingParams(), stop=[])))
            for i, t in enumerate(texts)]
    assert online.prompt_tokens([(t, 4) for t in texts] + [([5, 6, 7], 4)], tok) == want + [3]
    assert want[1] > want[0] > len(tok.encode("hello world"))  # the template's tokens counted


def test_the_pool_note_says_when_ttft_measures_memory() -> None:
    """The H100 sweep's 256 in flight: prompts of 624 tokens on average and 256 out need 225,280
    KV tokens; 160,000 pages hold about 182 of them. 450,000 hold all; 0 is the server's own."""
    prompts, outputs = [424, 824] * 128, [256] * 256
    note = online.pool_note("c=256 r0", 256, prompts, outputs, 160000)
    assert note is not None and "225,280 KV tokens" in note and "about 182 run at once" in note
    assert online.pool_note("c=256 r0", 256, prompts, outputs, 450000) is None
    assert online.pool_note("c=256 r0", 256, prompts, outputs, 0) is None
    assert online.pool_note("c=16 r0", 16, prompts, outputs, 160000) is None


def test_a_saved_runs_notes_are_drawn_again_from_its_command(
        model_dir: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`online.py --notes RUN.json MODEL`: each round's requests drawn again from the saved
    command and the round's seed, a note for each N in flight the pool cannot hold at once,
    with what the run measured beside it."""
    from transformers import AutoTokenizer

    argv = ["--model", "m", "--engine", "a=python", "--num-pages", "300", "--concurrency", "1",
            "16", "--rates", "8", "--input-len", "8", "24", "--output-len", "4", "6",
            "--vocab", "500", "--out", "o"]
    a = online.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(model_dir("tiny-qwen3"))
    notes = online.round_notes(a, tok, 1)
    assert [n.split(":")[0] for n in notes] == ["c=16 r1"]  # 16 × ~30 tokens > 300; 1 fits
    seed = online.round_seed(1, 1)  # c=16 is the second load
    requests = online.requests_for(("concurrency", 16.0), a, tok, seed)
    assert len(requests) == 48 and notes[0] == online.pool_note(
        "c=16 r1", 16, online.prompt_tokens(requests, tok), [k for _, k in requests], 300)
    row = {"engine": "a", "round": 1, "load": "c=16", "ttft_ms_p50": 12.3, "ttft_ms_p99": 45.6}
    saved = {"command": " ".join(["benchmark/online.py", *argv]), "rows": [row],
             "traces": {"a": {"c=16 r1": {"decode": {"size_p50": 9}}}}}
    online.print_notes(saved, str(model_dir("tiny-qwen3")))
    assert capsys.readouterr().out == (f"{notes[0]}. TTFT p50 / p99 ms {{'a': '12 / 46'}}; "
                                       "decode batch p50 {'a': 9}\n")


def test_online_runs_our_server_side_by_side(model_dir: Callable[[str], Path],
                                             tmp_path: Path) -> None:
    """Two servers of our package, one round each of one request in flight and one rate, with
    the step trace and the launch profile: every request completes, every number the report
    needs is there, and each lone request's first token is followed through the hops."""
    out = tmp_path / "online"
    python = str(FOLDER.parent / "python")
    done = subprocess.run(
        [sys.executable, str(FOLDER / "online.py"), "--model", str(model_dir("tiny-qwen3")),
         "--engine", f"a={python}", "--engine", f"b={python}", "--server-args", "",
         "--num-pages", "0",
         "--rounds", "2", "--concurrency", "1", "--rates", "8", "--rate-seconds", "0.5",
         "--min-prompts", "3", "--input-len", "8", "24", "--output-len", "4", "6", "--vocab",
         "500", "--trace", "--launch-profile", "3", "--out", str(out),
         "--base-port", str(20000 + os.getpid() % 20000)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out / "online.json").read_text())
    assert [(r["round"], r["load"]) for r in result["rows"]] == [
        (0, "c=1"), (0, "c=1"), (0, "8/s"), (0, "8/s"),
        (1, "c=1"), (1, "c=1"), (1, "8/s"), (1, "8/s")]
    assert [r["engine"] for r in result["rows"]][:2] == ["a", "b"]  # turns rotate per round
    assert [r["engine"] for r in result["rows"]][4:6] == ["b", "a"]
    for r in result["rows"]:
        asked = 3 if r["load"] == "c=1" else 4  # 3 per slot in flight; 8/s for 0.5 s
        assert r["failed"] == 0 and r["completed"] == asked and r["out_tok_s"] > 0
        assert r["client_cpu"] > 0 and r["server_cpu"]["main"] >= 0
        assert len(r["ttft_ms"]) == asked and min(r["ttft_ms"]) > 0
        assert statistics.median(r["ttft_ms"]) == pytest.approx(r["ttft_ms_p50"], abs=0.1)
    assert {e["exit_code"] for e in result["engines"].values()} == {0}
    assert result["pool_notes"] == []  # each server sized its own pool
    for name in ("a", "b"):
        runs = result["traces"][name]
        assert set(runs) == {"c=1 r0", "8/s r0", "c=1 r1", "8/s r1"}
        assert all(s["decode"]["count"] > 0 for s in runs.values())
        for run in ("c=1 r0", "c=1 r1"):  # every lone request followed through the hops
            hops = runs[run]["first_token_ms"]
            assert hops["matched"] == hops["of"] == 3, hops
            assert min(hops["in"], hops["scheduler"]) > 0, hops
        assert "first_token_ms" not in runs["8/s r0"]
        assert result["launch_profiles"][name]["launches"] == 3
    assert [x.split(",")[0] for x in result["first_token_pairs"]] == [
        "first token c=1 r0", "first token c=1 r1"]


def test_the_step_timer_times_any_package(model_dir: Callable[[str], Path],
                                          tmp_path: Path) -> None:
    """benchmark/steptimer wraps the scheduler of whatever minisgl is imported (here ours, on
    the GPU the official's too): one row per step, prefill rows carry the prompts' tokens. On
    the CPU the prefill's tokens are ready at once, so ours hands them out before the next
    batch is scheduled: that step's row says when (`early`), and a first token is matched to
    that moment rather than to the step's end."""
    script = ("from minisgl.llm import LLM\nfrom minisgl.core import SamplingParams\n"
              f"llm = LLM({str(model_dir('tiny-qwen3'))!r})\n"
              "llm.generate([[5] * 30, [7] * 50], SamplingParams(max_tokens=5, ignore_eos=True))\n")
    timer = FOLDER / "steptimer" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("steptimer_sitecustomize", timer)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # MINISGL_STEP_TIMER unset here: it only defines things
    assert module.TARGET == Scheduler.__module__  # a renamed module would go untimed
    path = tmp_path / "steps.jsonl"
    env = dict(os.environ, MINISGL_STEP_TIMER=str(path),
               PYTHONPATH=f"{FOLDER / 'steptimer'}:{FOLDER.parent / 'python'}")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (part,) = tmp_path.glob("steps.jsonl.*")
    rows = [json.loads(x) for x in part.read_text().splitlines()]
    phases = [r.get("phase") for r in rows]
    assert phases[0] == "prefill" and rows[0]["tokens"] == 80 and rows[0]["size"] == 2
    assert phases.count("decode") == 4  # 5 tokens: one from the prefill, four decode steps
    assert all(r["launch"] > 0 for r in rows if "phase" in r)
    assert all(r[p] >= 0 for r in rows for p in online.PARTS)
    step = rows[1]  # the first decode step, which handed the first tokens out first
    assert "early" in step and all("early" not in r for r in rows[2:])
    assert step["receive"] <= step["early"] <= sum(step[p] for p in online.PARTS) + 0.01
    hops = online.first_token_hops(rows, [[rows[0]["t"], step["t"] + step["early"] / 1e3
                                           - rows[0]["t"] + 0.001]])
    assert hops["matched"] == 1 and hops["out"] == pytest.approx(1.0, abs=1e-3)
    s = online.summarize_trace(part, [("all", rows[0]["t"], rows[-1]["t"])])
    assert s["all"]["prefill"]["tokens_p50"] == 80
    assert s["all"]["turn_ms"]["p99"] >= s["all"]["turn_ms"]["p50"] > 0
    gap = s["all"]["emit_gap_ms"]
    assert gap["max"] >= gap["p99"] >= gap["p50"] > 0
    assert gap["max"] >= gap["p99_by_stream"] >= gap["p50"]


def test_a_pause_that_stalls_many_streams_weighs_as_many_gaps() -> None:
    # 200 short gaps of one stream each, one pause of 256 streams: a scheduler's p99 over its
    # gaps misses the pause, a client's p99 over its streams' gaps does not
    gaps, sizes = [2.0] * 200 + [50.0], [1] * 200 + [256]
    assert online._quantile(gaps, 0.99) == 2.0
    assert online._weighted_quantile(gaps, sizes, 0.99) == 50.0
    assert online._weighted_quantile(gaps, [1] * 201, 0.99) == 2.0

