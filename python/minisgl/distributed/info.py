"""DistributedInfo: this process's rank among the tensor-parallel ranks (chapter 16)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedInfo:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size}: need 0 <= rank < size, size >= 1")

    @property
    def is_primary(self) -> bool:
        """Rank 0: the one that talks to the tokenizer and replies."""
        return self.rank == 0

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, rows): refused, naming the numbers, when it
        does not divide."""
        if total % self.size:
            raise ValueError(f"{what} = {total} does not divide by tp = {self.size}; pick a tp "
                             f"that divides it (divisors: {_divisors(total)})")
        return total // self.size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_INFO = DistributedInfo()


def set_tp_info(info: DistributedInfo) -> None:
    global _INFO
    _INFO = info


def get_tp_info() -> DistributedInfo:
    return _INFO
