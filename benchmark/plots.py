"""The figures of chapter 21 (which introduces this script), drawn from committed results files.

    python benchmark/plots.py            # writes docs/assets/ch21/*.svg (five figures)
    python benchmark/plots.py --check    # redraws into a temporary folder; exit 1 if any differs

throughput.svg: offline output tok/s per configuration on the H200 (bench_offline.py).
latency.svg: TTFT, ITL and E2E p50/p99 per arrival rate (bench_serving.py) on the CPU.
online.svg: the H100 sweep of online.py (today's code, two calls pooled), ours and the official
side by side, rounds in turns: output tok/s, TTFT p50 and the inter-token gap p99 per load.
workloads.svg: offline, ours / the official per workload (nano-vllm's and our four), each
round and their median.
step.svg: where a decode step's GPU time goes, ours (before and after the sampler fix) against
the official, from the kernel profiles of bench_offline.py --profile.

The SVGs keep matplotlib's path glyphs (svg.fonttype "path"), so their Chinese renders on any
machine without the font; a fixed hash salt and no date make a rerun byte-identical with the
same matplotlib (pinned in constraints.txt).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import re
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib import font_manager
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmark" / "results"
OUT = ROOT / "docs" / "assets" / "ch21"
CJK_FONT = "Noto Sans CJK SC"
WIDTH = 8.3  # inches: 600 pt, about 800 px at a page's width
OURS, OFFICIAL = "#1f77b4", "#d95f02"
SERIES = [OURS, OFFICIAL, "#2ca02c", "#7b3294", "#8c564b"]  # one per serving file, in turn


@dataclass(frozen=True)
class Serving:
    """One serving results file and what its JSON does not say: the model, and a short name of
    the device (its JSON's `machine` is the long one)."""

    file: str
    model: str
    device: str

    def label(self, report: dict[str, Any]) -> str:
        return f"{report['server']} · {self.model}（{self.device}）"


SERVING = [Serving("2026-12-02-cpu-ch21_serving.json", "SmolLM2-135M-Instruct", "CPU")]

# (label, source file, configuration): the bars of throughput.svg, top to bottom
BARS = [
    ("ours torch 后端 (eager, 重叠关)", "2026-12-02-h200-ch21_ablate.json", "ours:torch:eager:off"),
    ("ours torch 后端 (eager, 重叠开)", "2026-12-02-h200-ch21_ablate.json", "ours:torch:eager:on"),
    ("ours FlashInfer (eager, 重叠关)", "2026-12-02-h200-ch21_ablate.json", "ours:fi:eager:off"),
    ("ours FlashInfer (eager, 重叠开)", "2026-12-02-h200-ch21_ablate.json", "ours:fi:eager:on"),
    ("ours FlashInfer+图 (重叠关)", "2026-12-02-h200-ch21_offline.json", "ours:fi:graph:off"),
    ("ours FlashInfer+图+重叠，采样排序*", "2026-12-02-h200-ch21_offline-a746c97.txt",
     "ours:fi:graph:on"),
    ("ours FlashInfer+图+重叠，第 19 章 kernel†", "2026-12-02-h200-ch21_offline-0bf2c45.json",
     "ours:fi:graph:on"),
    ("ours FlashInfer+图+重叠", "2026-12-02-h200-ch21_offline.json", "ours:fi:graph:on"),
    ("官方 FlashInfer+图+重叠", "2026-12-02-h200-ch21_offline.json", "official:fi:graph:on"),
]
FLOOR_TOK_S = 40_000  # the chapter's estimate from KV and weight reads per step
# (label, profile file, engine): the bars of step.svg, top to bottom; the files' tok/s are not
# plotted (see step())
PROFILES = [("ours，采样排序*", "2026-12-02-h200-ch21_profile-a746c97.json", "ours"),
            ("ours，第 19 章 kernel†", "2026-12-02-h200-ch21_profile-0bf2c45.json", "ours"),
            ("ours", "2026-12-02-h200-ch21_profile.json", "ours"),
            ("官方", "2026-12-02-h200-ch21_profile.json", "official")]

# (category, colour, pattern of kernel names); the first match wins, "其他" takes the rest
CATEGORIES = [
    ("注意力", "#4e79a7", r"BatchDecode|BatchPrefill"),
    ("矩阵乘", "#f28e2b", r"nvjet|gemm|cutlass"),
    ("采样", "#e15759", r"radix_sort|RadixSort|softmax|sampling|fill_reverse_indices|multinomial"
                       r"|exponential|sample_kernel"),
    ("归一化", "#76b7b2", r"rms_?norm"),
    ("RoPE", "#59a14f", r"rope|rotary"),
    ("激活", "#edc948", r"silu|act_and_mul"),
    ("KV 写入", "#b07aa1", r"store_kv"),
    ("其他", "#9c755f", r""),
]
OUTSIDE = ("前 15 之外", "#bab0ac")


def setup_style() -> None:
    """A CJK font by family name (warning if missing), sizes legible at page width, and the
    settings that make the SVG output reproducible."""
    try:
        font_manager.findfont(font_manager.FontProperties(family=CJK_FONT),
                              fallback_to_default=False)
        families = [CJK_FONT, "DejaVu Sans"]
    except ValueError:
        warnings.warn(f"font {CJK_FONT!r} not found: Chinese text will show as boxes",
                      stacklevel=2)
        families = ["DejaVu Sans"]
    plt.rcParams.update({
        "font.family": families, "font.size": 10.5, "axes.titlesize": 11.5,
        "axes.labelsize": 10.5, "xtick.labelsize": 10, "ytick.labelsize": 10.5,
        "legend.fontsize": 10, "figure.titlesize": 12.5,
        "axes.spines.top": False, "axes.spines.right": False,
        "figure.facecolor": "white", "savefig.facecolor": "white",  # the book has a dark mode
        "svg.fonttype": "path", "svg.hashsalt": "minisgl-ch21",
    })


def save(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="svg", metadata={"Date": None, "Creator": "benchmark/plots.py"})
    plt.close(fig)


def caption(fig: Figure, text: str) -> None:
    fig.text(0.01, 0.01, text, fontsize=9.5, color="#555555", ha="left", va="bottom")


# --- throughput.svg -------------------------------------------------------------------------

ROW = re.compile(r"^(\S+:\S+:\S+:\S+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def offline_table(path: Path) -> dict[str, dict[str, float]]:
    """The rows of a bench_offline.py text table, by configuration (a table printed twice, per
    group then all, gives each configuration once)."""
    rows: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if m := ROW.match(line):
            s, tok, tok_s, step, peak, start = (float(x) for x in m.groups()[1:])
            rows.setdefault(m[1], {"seconds": s, "output_tokens": tok, "tok_s": tok_s,
                                   "step_ms_p50": step, "peak_gib": peak, "startup_s": start})
    return rows


def offline_rows(path: Path) -> dict[str, dict[str, Any]]:
    """Rows by configuration from a bench_offline.py report, JSON or text."""
    if path.suffix == ".json":
        return {r["config"]: r for r in json.loads(path.read_text())["rows"]}
    return offline_table(path)


def throughput(path: Path) -> None:
    loaded: dict[str, dict[str, dict[str, Any]]] = {}
    labels, values, colours = [], [], []
    for label, file, config in BARS:
        rows = loaded.setdefault(file, offline_rows(RESULTS / file))
        labels.append(label)
        values.append(float(rows[config]["tok_s"]))
        colours.append(OFFICIAL if config.startswith("official") else OURS)
    fig, ax = plt.subplots(figsize=(WIDTH, 5.2))
    y = range(len(labels))
    ax.barh(y, values, color=colours, height=0.62)
    for i, v in zip(y, values):
        ax.text(v + 400, i, f"{v:,.0f}", va="center", fontsize=10.5)
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.axvline(FLOOR_TOK_S, color="#444444", ls="--", lw=1.2)
    ax.text(FLOOR_TOK_S - 500, len(labels) - 0.55, "物理下限估计 ≈40k\n（KV 与权重读取）",
            ha="right", va="bottom", fontsize=10, color="#444444")
    ax.set_xlim(0, FLOOR_TOK_S * 1.06)
    ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:.0f}k")
    ax.set_xlabel("输出吞吐（tok/s，越高越好）")
    ax.set_title("H200 · 随机权重 Qwen3-0.6B 形状 · nano-vllm 负载（256 请求）", loc="left")
    caption(fig, "2026-12-02；中位数（3 轮），eager 四行各 1 轮；蓝：ours，橙：官方 mini-sglang；"
                 "图 = CUDA 图，重叠 = 重叠调度\n"
                 "* 修正采样器之前（a746c97）、† 改 kernel 之前（0bf2c45），各是另一次调用；"
                 "数据：benchmark/results/…-h200-ch21_*")
    fig.tight_layout(rect=(0, 0.075, 1, 1))
    save(fig, path)


# --- latency.svg ----------------------------------------------------------------------------

PANELS = [("TTFT（首 token）", ["ttft"]), ("ITL（token 间隔）", ["itl"]),
          ("E2E（整个请求）", ["e2e"])]


def rate_label(rate: float | str) -> str:
    if rate == "inf":
        return "∞\n（一次发完）"
    return f"{float(rate):g}"


def latency(path: Path, servings: list[Serving]) -> None:
    reports = [(s, json.loads((RESULTS / s.file).read_text())) for s in servings]
    rates: list[float | str] = []  # categorical x: every file's rates, in the order first seen
    for _, rep in reports:
        rates += [r["rate"] for r in rep["rows"] if r["rate"] not in rates]
    x = {rate: i for i, rate in enumerate(rates)}
    first_s, first = reports[0]
    if len(reports) == 1:
        notes = [first["machine"], workload_note(first)]
    else:
        notes = [line for s, rep in reports
                 for line in (f"{s.label(rep)}：{rep['machine']}", "　" + workload_note(rep))]
    # inches: title and legend rows and panel titles; panels; tick labels, x label, caption
    rows = 1 if len(reports) == 1 else len(reports)
    top, bottom = 0.7 + 0.27 * rows, 0.9 + 0.19 * len(notes)
    height = top + 2.3 + bottom
    fig, axes = plt.subplots(1, len(PANELS), figsize=(WIDTH, height), sharex=True)
    for ax, (title, metrics) in zip(axes, PANELS):
        for k, (_, rep) in enumerate(reports):
            colour = SERIES[k % len(SERIES)]
            xs = [x[r["rate"]] for r in rep["rows"]]
            for metric in metrics:
                for q, ls, mk in (("p50", "-", "o"), ("p99", "--", "s")):
                    ys = [r[f"{metric}_ms_{q}"] for r in rep["rows"]]
                    ys = [float("nan") if v is None else v for v in ys]
                    ax.plot(xs, ys, ls=ls, marker=mk, ms=4, color=colour, lw=1.6)
        ax.set_title(title)
        ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
        ax.set_xlim(-0.45, len(rates) - 0.55)  # room for the two-line label of "inf"
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", color="#dddddd", lw=0.8)
        ax.set_axisbelow(True)
    axes[0].set_ylabel("毫秒")
    legend_y = 1 - 0.4 / height
    fig.legend(handles=[Line2D([], [], color="#333333", ls=ls, marker=mk, ms=4, label=q)
                        for q, ls, mk in (("p50", "-", "o"), ("p99", "--", "s"))],
               loc="upper right", ncol=2, frameon=False, bbox_to_anchor=(1, legend_y))
    if len(reports) > 1:
        fig.legend(handles=[Line2D([], [], color=SERIES[k % len(SERIES)], lw=3,
                                   label=s.label(rep)) for k, (s, rep) in enumerate(reports)],
                   loc="upper left", frameon=False, bbox_to_anchor=(0, legend_y))
    title = (f"在线服务延迟 · {first_s.label(first)} · {first['date']}"
             if len(reports) == 1 else f"在线服务延迟 · {first['date']}")
    fig.suptitle(title, x=0.01, ha="left")
    caption(fig, "\n".join(notes))
    fig.supxlabel("请求到达率（请求/秒，泊松）", fontsize=10.5,
                  y=(0.15 + 0.19 * len(notes)) / height, va="bottom")
    fig.subplots_adjust(left=0.7 / WIDTH, right=1 - 0.3 / WIDTH, top=1 - top / height,
                        bottom=bottom / height, wspace=0.35)
    save(fig, path)


def workload_note(report: dict[str, Any]) -> str:
    """The workload of a serving report, and how many of its requests failed."""
    wl = report["workload"]
    (i0, i1), (o0, o1) = wl["input_len"], wl["output_len"]
    failed = sum(r["failed"] for r in report["rows"])
    counted = ("" if all(r.get("output_len_source", "usage") == "usage" for r in report["rows"])
               else "；没有 usage，输出长度按请求的记（请求都带 ignore_eos）")
    conc = f"，并发上限 {wl['max_concurrency']}" if wl.get("max_concurrency") else ""
    return (f"每个到达率 {wl['num_prompts']} 个请求{conc}，输入 {i0}–{i1}、输出 {o0}–{o1} token，"
            f"失败 {failed} 个{counted}")


# --- online.svg -----------------------------------------------------------------------------

# two calls on the same code (f69bf87), each with three servers started once: (results file,
# {engine in that file: name on the plot}); engines not named are left out
ONLINE = [("2026-12-07-h100-ch21_online-f69bf87-1.json", {"s2048": "ours", "official": "official"}),
          ("2026-12-07-h100-ch21_online-f69bf87-2.json", {"ours": "ours", "official": "official"})]
ONLINE_PANELS = [("输出 tok/s", "out_tok_s"), ("TTFT p50（毫秒）", "ttft_ms_p50"),
                 ("token 间隔 p99（毫秒）", "itl_ms_p99")]


def online(path: Path) -> None:
    """benchmark/online.py's sweeps: each metric per load, one line per engine at the median of
    the rounds of every call, a bar from the smallest to the largest round."""
    results = [json.loads((RESULTS / name).read_text()) for name, _ in ONLINE]
    result = results[0]
    rows = [{**r, "engine": names[r["engine"]]} for res, (_, names) in zip(results, ONLINE)
            for r in res["rows"] if r["engine"] in names]
    loads = list(dict.fromkeys(r["load"] for r in rows))
    engines = list(dict.fromkeys(ONLINE[0][1].values()))
    closed = [i for i, ld in enumerate(loads) if ld.startswith("c=")]
    poisson = [i for i, ld in enumerate(loads) if not ld.startswith("c=")]
    height = 4.0
    fig, axes = plt.subplots(1, len(ONLINE_PANELS), figsize=(WIDTH, height))
    for ax, (title, key) in zip(axes, ONLINE_PANELS):
        for k, engine in enumerate(engines):
            colour = SERIES[k % len(SERIES)]
            per = [[r[key] for r in rows if r["engine"] == engine and r["load"] == ld]
                   for ld in loads]
            mid = [statistics.median(v) for v in per]  # as the tables: the mean of the middle two
            for group in (closed, poisson):  # no line from the last N in flight to a rate
                ax.errorbar(group, [mid[i] for i in group],
                            yerr=[[mid[i] - min(per[i]) for i in group],
                                  [max(per[i]) - mid[i] for i in group]],
                            color=colour, marker="o", ms=4, lw=1.6, capsize=3)
        ax.set_title(title)
        ax.set_xticks(range(len(loads)), [ld.replace("c=", "") for ld in loads])
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", color="#dddddd", lw=0.8)
        ax.set_axisbelow(True)
    fig.legend(handles=[Line2D([], [], color=SERIES[k % len(SERIES)], lw=3,
                               label={"ours": "ours", "official": "官方"}.get(e, e))
                        for k, e in enumerate(engines)],
               loc="upper right", ncol=len(engines), frameon=False,
               bbox_to_anchor=(1, 1 - 0.4 / height))
    rounds = sum(1 + max(r["round"] for r in res["rows"]) for res in results)
    fig.suptitle(f"在线服务：并排、轮流，{len(results)} 次调用共 {rounds} 轮 · {result['date']}",
                 x=0.01, ha="left")
    caption(fig, f"{result['machine']}；横轴：同时在途的请求数，或泊松到达率（/s）；"
                 "点是各轮的中位数，竖线是最小到最大")
    fig.subplots_adjust(left=0.8 / WIDTH, right=1 - 0.2 / WIDTH, top=1 - 1.0 / height,
                        bottom=0.75 / height, wspace=0.35)
    save(fig, path)


# --- workloads.svg --------------------------------------------------------------------------

# (label, results file, workload): the bars of workloads.svg, top to bottom
WORKLOAD_BARS = [("nano-vllm 的，H200", "2026-12-03-h200-ch21_workloads-a16fbae.json", None),
                 ("nano-vllm 的，H100", "2026-12-07-h100-ch21_workloads-f69bf87-2-nano.json",
                  "nano"),
                 ("共享前缀，H200", "2026-12-05-h200-ch21_workloads-5123ed2.json", "prefix"),
                 ("共享前缀，H100", "2026-12-07-h100-ch21_workloads-f69bf87-1.json", "prefix"),
                 ("长提示词，H200", "2026-12-05-h200-ch21_workloads-5123ed2.json", "long"),
                 ("长提示词，H100", "2026-12-07-h100-ch21_long-cvt.json", "long"),
                 ("1,024 个短请求，H200", "2026-12-03-h200-ch21_workloads-2dc152d.json", "short"),
                 ("1,024 个短请求，H100", "2026-12-07-h100-ch21_workloads-f69bf87-1.json", "short"),
                 ("混合，H200", "2026-12-03-h200-ch21_workloads-2dc152d.json", "mixed"),
                 ("混合，H100", "2026-12-07-h100-ch21_workloads-f69bf87-2.json", "mixed")]


def round_ratios(path: Path, workload: str | None) -> list[float]:
    """ours / official output tok/s in each round of one workload (the same draw for both)."""
    rows = [r for r in json.loads((RESULTS / path).read_text())["rows"]
            if r.get("workload") == workload]
    by = {r["config"].split(":")[0]: r["tok_s_all"] for r in rows}
    return [a / b for a, b in zip(by["ours"], by["official"])]


def workloads(path: Path) -> None:
    """bench_offline.py's workloads: ours / the official per workload, the median of the rounds
    as a bar, each round as a dot; lines at 1 (even) and 1.05."""
    height = 0.55 * len(WORKLOAD_BARS) + 1.4
    fig, ax = plt.subplots(figsize=(WIDTH, height))
    for i, (_, source, workload) in enumerate(WORKLOAD_BARS):
        ratios = sorted(round_ratios(Path(source), workload))
        mid = ratios[len(ratios) // 2]
        y = len(WORKLOAD_BARS) - 1 - i
        ax.barh(y, mid, color=SERIES[0] if mid >= 1 else SERIES[1], height=0.6)
        ax.plot(ratios, [y] * len(ratios), "o", color="#333333", ms=3.5)
        ax.text(max(max(ratios), 1.05) + 0.02, y, f"{mid:.2f}（{ratios[0]:.2f}–{ratios[-1]:.2f}）",
                va="center", fontsize=9)
    ax.axvline(1.0, color="#333333", lw=1)
    ax.axvline(1.05, color="#333333", lw=1, ls="--")
    ax.set_yticks(range(len(WORKLOAD_BARS)), [b[0] for b in reversed(WORKLOAD_BARS)])
    ax.set_xlim(0.6, 1.75)
    ax.grid(axis="x", color="#dddddd", lw=0.8)
    ax.set_axisbelow(True)
    fig.suptitle("离线：ours / 官方的输出 tok/s，每种负载轮流 3～5 轮", x=0.01, ha="left")
    caption(fig, "H200：2026-12-03、05，三次调用；H100：2026-12-07，两台机器三次调用；"
                 "条是各轮的中位数，点是每一轮；实线 1，虚线 1.05")
    fig.subplots_adjust(left=2.0 / WIDTH, right=1 - 0.2 / WIDTH, top=1 - 0.6 / height,
                        bottom=0.75 / height)
    save(fig, path)


# --- step.svg -------------------------------------------------------------------------------

def category(kernel: str) -> str:
    return next(name for name, _, pattern in CATEGORIES
                if re.search(pattern, kernel, re.IGNORECASE))


def step_split(profile: dict[str, Any]) -> dict[str, float]:
    """ms per step by category, plus what the top kernels leave of the GPU's busy time."""
    steps = profile["steps"]
    split = {name: 0.0 for name, _, _ in CATEGORIES}
    for kernel, ms, _calls in profile["kernels"]:
        split[category(kernel)] += ms / steps
    split[OUTSIDE[0]] = profile["gpu_busy_ms"] / steps - sum(split.values())
    return split


def step(path: Path) -> None:
    """Ours against the official, one stacked bar each. The profile file's tok/s are not used:
    the official's one round there includes a one-off JIT compile of FlashInfer's sampling."""
    bars = []
    for label, file, engine in PROFILES:
        rows = json.loads((RESULTS / file).read_text())["rows"]
        bars.append((label, next(r for r in rows if r["config"].startswith(engine + ":"))))
    colours = {name: c for name, c, _ in CATEGORIES} | {OUTSIDE[0]: OUTSIDE[1]}
    fig, ax = plt.subplots(figsize=(WIDTH, 4.6))
    used: set[str] = set()
    for i, (_, row) in enumerate(bars):
        p = row["profile"]
        left = 0.0
        for name, ms in step_split(p).items():
            if ms <= 0:
                continue
            used.add(name)
            ax.barh(i, ms, left=left, color=colours[name], height=0.55, edgecolor="white",
                    lw=0.6)
            if ms >= 0.45:
                ax.text(left + ms / 2, i, f"{ms:.2f}", ha="center", va="center", fontsize=10,
                        color="white" if name in ("注意力", "采样") else "#222222")
            left += ms
        wall = p["wall_ms"] / p["steps"]
        ax.plot([wall, wall], [i - 0.4, i + 0.4], color="#222222", lw=1.5)
        ax.text(wall + 0.1, i, f"墙钟 {wall:.2f} ms\nGPU 忙 {left:.2f} ms", va="center",
                fontsize=10)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlim(0, max(r["profile"]["wall_ms"] / r["profile"]["steps"] for _, r in bars) * 1.2)
    ax.set_xlabel("每步毫秒（50 个解码步的平均）")
    ax.set_title("一个解码步的 GPU 时间去了哪里 · H200 · FlashInfer+图+重叠", loc="left")
    order = [n for n in colours if n in used]
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in order],
              labels=order, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=5,
              frameon=False, handlelength=1.2, columnspacing=1.0)
    caption(fig, "2026-12-02；torch profiler，运行中段 50 步；按内核名归类前 15 个内核。"
                 "竖线：墙钟时间，与 GPU 忙的差是 GPU 空等主机的时间\n"
                 "* 修正采样器之前（a746c97）、† 第 21 章改 kernel 之前（0bf2c45），各是另一次调用")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    save(fig, path)


def draw(out: Path) -> list[Path]:
    setup_style()
    out.mkdir(parents=True, exist_ok=True)
    figures: list[tuple[str, Callable[[Path], None]]] = [
        ("throughput.svg", throughput), ("latency.svg", lambda p: latency(p, SERVING)),
        ("online.svg", online), ("workloads.svg", workloads), ("step.svg", step)]
    for name, fn in figures:
        fn(out / name)
    return [out / name for name, _ in figures]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=OUT, help="folder of the SVGs (%(default)s)")
    p.add_argument("--check", action="store_true",
                   help="redraw into a temporary folder; exit 1 if any SVG in --out differs")
    a = p.parse_args(argv)
    if not a.check:
        for path in draw(a.out):
            print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [f.name for f in draw(Path(tmp))
                 if not (a.out / f.name).exists() or not filecmp.cmp(f, a.out / f.name, False)]
    for name in stale:
        print(f"differs from a fresh drawing: {a.out / name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
