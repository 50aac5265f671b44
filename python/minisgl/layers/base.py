"""BaseOP and OPList: layers without torch.nn.Module, with recursive state dicts (chapter 2)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch

StateDict = dict[str, torch.Tensor]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class BaseOP:
    """An operator: tensors and sub-operators are plain attributes; names starting with `_`
    are private (not weights). `state_dict` walks the attributes recursively."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def state_dict(self, *, prefix: str = "", result: StateDict | None = None) -> StateDict:
        result = {} if result is None else result
        for name, value in self.__dict__.items():
            if name.startswith("_"):
                continue
            if isinstance(value, torch.Tensor):
                result[_join(prefix, name)] = value
            elif isinstance(value, BaseOP):
                value.state_dict(prefix=_join(prefix, name), result=result)
        return result

    def load_state_dict(self, state_dict: StateDict, *, prefix: str = "",
                        _top: bool = True) -> None:
        """Replace every weight by the tensor of the same name, popping it from `state_dict`;
        at the top level, complain about anything left over."""
        for name, value in self.__dict__.items():
            if name.startswith("_"):
                continue
            key = _join(prefix, name)
            if isinstance(value, torch.Tensor):
                if key not in state_dict:
                    raise KeyError(f"the checkpoint has no tensor {key!r}, which the model needs")
                item = state_dict.pop(key)
                if item.shape != value.shape or item.dtype != value.dtype:
                    raise ValueError(f"{key}: expected {tuple(value.shape)} {value.dtype}, "
                                     f"got {tuple(item.shape)} {item.dtype}")
                setattr(self, name, item)
            elif isinstance(value, BaseOP):
                value.load_state_dict(state_dict, prefix=key, _top=False)
        if _top and state_dict:
            raise ValueError(f"tensors the model does not use: {sorted(state_dict)[:8]}")


class StateLessOP(BaseOP):
    """An operator without weights."""

    def state_dict(self, *, prefix: str = "", result: StateDict | None = None) -> StateDict:
        return {} if result is None else result

    def load_state_dict(self, state_dict: StateDict, *, prefix: str = "",
                        _top: bool = True) -> None:
        if _top and state_dict:
            raise ValueError(f"tensors the model does not use: {sorted(state_dict)[:8]}")


T = TypeVar("T", bound=BaseOP)


class OPList(BaseOP, Generic[T]):
    """A list of operators, named 0, 1, 2, ... in the state dict (like HF's `layers.0`)."""

    def __init__(self, ops: list[T]) -> None:
        self.op_list = ops

    def state_dict(self, *, prefix: str = "", result: StateDict | None = None) -> StateDict:
        result = {} if result is None else result
        for i, op in enumerate(self.op_list):
            op.state_dict(prefix=_join(prefix, str(i)), result=result)
        return result

    def load_state_dict(self, state_dict: StateDict, *, prefix: str = "",
                        _top: bool = True) -> None:
        for i, op in enumerate(self.op_list):
            op.load_state_dict(state_dict, prefix=_join(prefix, str(i)), _top=False)
        if _top and state_dict:
            raise ValueError(f"tensors the model does not use: {sorted(state_dict)[:8]}")
