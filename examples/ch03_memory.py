"""第 3 章示例：加载 SmolLM2（float32）要多占多少内存——我们的加载与 HF from_pretrained 对照。

    python examples/ch03_memory.py

每种加载在一个新进程里做：先 import 好要用的库、记下常驻内存（VmRSS），再加载模型，
读出进程的峰值常驻内存（VmHWM）。两者之差就是“加载过程多占的内存”，与权重字节数相比。
之后把每个权重读一遍（第一次前向也会这样做），再读一次峰值：HF 用 mmap 懒加载，
权重在被读到之前并不占常驻内存，所以只看加载那一刻对它并不公平。
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def child(kind: str) -> None:
    """Runs in a fresh process: imports, baseline, load, peak; prints one JSON line."""
    import torch

    if kind == "ours":
        from minisgl.models import ModelConfig, create_model, load_hf_config, load_weight

        config = ModelConfig.from_hf(load_hf_config(MODEL))
        base = status_kib("VmRSS")
        with torch.device("meta"):
            model = create_model(config)
        model.load_state_dict(load_weight(MODEL, torch.device("cpu"), torch.float32,
                                          config.tie_word_embeddings))
        tensors = list(model.state_dict().values())
    else:
        from transformers import AutoModelForCausalLM

        base = status_kib("VmRSS")
        hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        unique = {t.data_ptr(): t for t in hf.state_dict().values()}  # tied: counted once
        tensors = list(unique.values())
    loaded = (status_kib("VmHWM") - base) * 1024
    with torch.no_grad():
        for t in tensors:  # read every weight once, as the first forward pass would
            t.sum()
    resident = (status_kib("VmHWM") - base) * 1024
    weights = sum(t.numel() * t.element_size() for t in tensors)
    print(json.dumps({"loaded": loaded, "resident": resident, "weights": weights}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=["ours", "hf"])
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "smollm2"], check=True)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}; "
          f"date {datetime.date.today()}")
    results = {}
    for kind in ("ours", "hf"):
        out = subprocess.run([sys.executable, __file__, "--child", kind], capture_output=True,
                             text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    weights = results["ours"]["weights"]
    print(f"weight bytes (float32, tied lm_head counted once): {weights / 2**20:.1f} MiB")
    print("peak RSS - RSS after imports, right after loading / after reading every weight once:")
    for kind, label in (("ours", "minisgl load_weight"), ("hf", "HF from_pretrained")):
        r = results[kind]
        print(f"  {label}: {r['loaded'] / 2**20:.1f} MiB ({r['loaded'] / weights:.2f} x) / "
              f"{r['resident'] / 2**20:.1f} MiB ({r['resident'] / weights:.2f} x)")
    ours, hf = results["ours"], results["hf"]
    print(f"ours below 1.5 x weights: {ours['resident'] < 1.5 * weights}; "
          f"ours below HF once resident: {ours['resident'] < hf['resident']}; "
          f"ours below HF right after loading: {ours['loaded'] < hf['loaded']}")


if __name__ == "__main__":
    main()
