"""Weight loading (chapter 3): safetensors read straight into the final tensors, q/k/v merged,
experts stacked."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from io import BufferedReader

import torch
from tqdm import tqdm

from minisgl.distributed.shard import Shard

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
# HF names merged into one of our weights: suffix -> (merged name, its parts in order)
_MERGES = {
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
}


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """(offset of the data area, {name: {"dtype", "shape", "data_offsets"}}). A safetensors
    file is an 8-byte little-endian header length, a JSON header, then the raw bytes."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return 8 + header_len, header


def _read_into(f: BufferedReader, base: int, info: dict, out: torch.Tensor,
               rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> None:
    """Read one tensor's bytes from the open file into `out` (any dtype, any device): all of
    it, or only rows [a, b) (one read), or only columns [a, b) of a matrix (one read per row):
    a tensor-parallel rank reads just its slice."""
    start, end = info["data_offsets"]
    src_dtype, shape = _DTYPES[info["dtype"]], info["shape"]
    item = src_dtype.itemsize
    direct = out.dtype == src_dtype and out.device.type == "cpu" and out.is_contiguous()
    buffer = out if direct else torch.empty(out.shape, dtype=src_dtype)
    flat = buffer.view(-1).view(torch.uint8).numpy().data  # a memoryview of its bytes
    if cols is not None:  # a [rows, cols] matrix, its columns [a, b): row after row
        a, b = cols
        width = (b - a) * item
        for i in range(shape[0]):
            f.seek(base + start + (i * shape[1] + a) * item)
            if f.readinto(flat[i * width:(i + 1) * width]) != width:
                raise ValueError(f"{f.name}: a tensor is truncated")
    else:
        row = item * (int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)
        a, b = rows if rows is not None else (0, (end - start) // row)
        f.seek(base + start + a * row)
        if f.readinto(flat[:(b - a) * row]) != (b - a) * row:
            raise ValueError(f"{f.name}: a tensor is truncated")
    if not direct:
        out.copy_(buffer)  # converts dtype and moves to the device


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) one at a time, in file order, without memory-mapping."""
    base, header = read_header(path)
    with open(path, "rb") as f:
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            out = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            _read_into(f, base, info, out)
            yield name, out


def _local_shape(shape: list[int], shard: Shard) -> list[int]:
    """A tensor's shape on this rank: its sharded dimension cut to the rank's share."""
    if shard.dim is None:
        return list(shape)
    return [shard.size if i == shard.dim else n for i, n in enumerate(shape)]


def _destination(name: str) -> tuple[str, str | None, int | None]:
    """Our name for an HF tensor, which part of a merged tensor it is (None: not merged), and
    which expert it belongs to (None: no expert's). HF stores each expert apart
    (mlp.experts.3.gate_proj.weight); we stack them: that is [3] of mlp.experts.gate_up_proj,
    an [E, 2I, H] tensor."""
    *prefix, part, kind = name.split(".")  # e.g. [...self_attn], q_proj, weight
    merged = part in _MERGES
    if len(prefix) > 1 and prefix[-2] == "experts" and prefix[-1].isdigit():
        expert = int(prefix.pop())
        return ".".join([*prefix, _MERGES[part][0] if merged else part]), \
            part if merged else None, expert
    if not merged:
        return name, None, None
    return ".".join([*prefix, _MERGES[part][0], kind]), part, None


def load_weight(model_path: str | Path, device: torch.device, dtype: torch.dtype,
                tie_word_embeddings: bool = False,
                shards: Callable[[str], Shard] = lambda name: Shard()) -> dict[str, torch.Tensor]:
    """All weights under our names, in `dtype` on `device`: q/k/v -> qkv_proj, gate/up ->
    gate_up_proj. A tied checkpoint's lm_head.weight (if saved at all) is dropped.

    The headers are read first, so every result tensor (merged ones included) is allocated
    once at its final size and each tensor's bytes are read straight into its rows: no
    intermediate copies, so loading needs about one copy of the weights and no more.
    `shards(name)` is a tensor-parallel rank's slice of each tensor: the rank
    allocates and reads only that, so it needs about 1/tp of the weights. An expert's tensors
    go to their row of the stacked tensor, each read in place like the others."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    headers = {file: read_header(file) for file in files}
    parts: dict[str, dict[str | None, list[int]]] = {}  # our name -> part -> shape
    experts: dict[str, set[tuple[str | None, int]]] = {}  # stacked name -> (part, expert) seen
    for _, header in headers.values():
        for name, info in header.items():
            if not (tie_word_embeddings and name == "lm_head.weight"):
                key, part, expert = _destination(name)
                parts.setdefault(key, {})[part] = _local_shape(info["shape"], shards(name))
                if expert is not None:
                    experts.setdefault(key, set()).add((part, expert))
    rows: dict[tuple[str, str | None], int] = {}  # (our name, part) -> first row
    result: dict[str, torch.Tensor] = {}
    for key, shapes in parts.items():
        merged = [] if None in shapes else list(_MERGES[next(p for p in shapes if p)][1])
        order: list[str | None] = [*merged] if merged else [None]
        missing = [p for p in merged if p not in shapes]
        if missing:
            name = key.replace(_MERGES[missing[0]][0], missing[0])
            raise KeyError(f"the checkpoint has no tensor {name!r} (needed for {key})")
        first = 0
        for part in order:
            rows[key, part] = first
            first += shapes[part][0] if shapes[part] else 1
        tail = shapes[order[0]][1:]
        shape = shapes[None] if order == [None] else [first, *tail]
        if key in experts:  # one row per expert: every expert must bring every part
            count = 1 + max(e for _, e in experts[key])
            gaps = [(p, e) for e in range(count) for p in order if (p, e) not in experts[key]]
            if gaps:
                stem, own = key.rsplit(".", 1)
                raise KeyError(f"the checkpoint has no tensor "
                               f"'{stem}.{gaps[0][1]}.{gaps[0][0] or own}.weight' (needed for {key})")
            shape = [count, *shape]
        # zeros: a vocabulary padded to a multiple of tp has rows no checkpoint fills
        result[key] = torch.zeros(shape, dtype=dtype, device=device)
    with tqdm(total=len(rows), desc="loading weights", unit=" tensors", leave=False) as bar:
        for file, (base, header) in headers.items():
            with open(file, "rb") as f:
                for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                    key, part, expert = _destination(name)
                    if (key, part) not in rows:
                        continue  # the tied lm_head
                    shard, out = shards(name), result[key]
                    if expert is not None:
                        out = out[expert]
                    if part is not None:
                        first = rows[key, part]
                        out = out[first : first + _local_shape(info["shape"], shard)[0]]
                    if shard.dim is None:
                        _read_into(f, base, info, out)
                    elif shard.dim == 0:
                        _read_into(f, base, info, out[: shard.stop - shard.start],
                                   rows=(shard.start, shard.stop))
                    else:
                        _read_into(f, base, info, out, cols=(shard.start, shard.stop))
                    bar.update()
    return result
