"""msgpack encoding of the messages between processes (chapter 12): a type tag and a registry, no
pickle."""

from __future__ import annotations

import dataclasses
from types import UnionType
from typing import Any, TypeVar

import msgpack
import torch

T = TypeVar("T")

# msgpack extension codes: a registered dataclass, and a 1-D CPU tensor
_EXT_MESSAGE, _EXT_TENSOR = 1, 2
_TENSOR_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64)}
_REGISTRY: dict[str, type] = {}


class MessageError(ValueError):
    """Bytes that do not decode to a registered message: the frame is refused, not half-read."""


def message(cls: type[T]) -> type[T]:
    """Class decorator: register a dataclass under its name, the tag that travels with it."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass to be sent between processes")
    if _REGISTRY.setdefault(cls.__name__, cls) is not cls:
        raise TypeError(f"two message classes are named {cls.__name__}; tags must be unique")
    return cls


def encode(obj: object) -> bytes:
    """obj (a registered dataclass, possibly nesting others, lists, dicts and tensors) as bytes."""
    return msgpack.packb(obj, default=_pack_ext, use_bin_type=True)


def decode(data: bytes, expected: type[T] | UnionType) -> T:
    """The object that encode() turned into data, which must be an `expected`. Raises
    MessageError, naming the problem, for anything else."""
    try:
        obj = msgpack.unpackb(data, ext_hook=_unpack_ext, raw=False, strict_map_key=True)
    except MessageError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for malformed input
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise MessageError(f"not a msgpack message ({detail})") from None
    if not isinstance(obj, expected):
        want = getattr(expected, "__name__", str(expected))
        raise MessageError(f"expected a {want}, got a {type(obj).__name__}")
    return obj


def _pack_ext(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, torch.Tensor):
        dtype = str(obj.dtype).removeprefix("torch.")
        if obj.dim() != 1 or obj.device.type != "cpu" or dtype not in _TENSOR_DTYPES:
            raise TypeError(f"only 1-D CPU tensors of {sorted(_TENSOR_DTYPES)} can be sent, got "
                            f"shape {tuple(obj.shape)} {obj.dtype} on {obj.device}")
        raw = obj.contiguous().view(torch.uint8).numpy().tobytes()
        return msgpack.ExtType(_EXT_TENSOR, msgpack.packb([dtype, raw], use_bin_type=True))
    name = type(obj).__name__
    if _REGISTRY.get(name) is not type(obj):
        raise TypeError(f"cannot send a {name}: register it with @message")
    cls: Any = type(obj)  # a registered dataclass (checked above)
    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)}
    payload = msgpack.packb([name, fields], default=_pack_ext, use_bin_type=True)
    return msgpack.ExtType(_EXT_MESSAGE, payload)


def _unpack_ext(code: int, payload: bytes) -> object:
    if code == _EXT_TENSOR:
        dtype, raw = msgpack.unpackb(payload, raw=False)
        if dtype not in _TENSOR_DTYPES:
            raise MessageError(f"unknown tensor dtype {dtype!r}")
        if not raw:  # frombuffer refuses an empty buffer
            return torch.empty(0, dtype=_TENSOR_DTYPES[dtype])
        return torch.frombuffer(bytearray(raw), dtype=_TENSOR_DTYPES[dtype])
    if code != _EXT_MESSAGE:
        raise MessageError(f"unknown msgpack extension code {code}")
    name, fields = msgpack.unpackb(payload, ext_hook=_unpack_ext, raw=False)
    cls = _REGISTRY.get(name)
    if cls is None:
        raise MessageError(f"unknown message type {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:  # missing or extra fields, or a check in __post_init__
        raise MessageError(f"bad {name}: {e}") from None
