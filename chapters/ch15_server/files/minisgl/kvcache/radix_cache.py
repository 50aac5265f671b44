"""RadixPrefixCache: a radix tree of token pages with ref counts and LRU eviction (chapter 9)."""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .base import BaseCacheHandle, BasePrefixCache, InsertResult, SizeInfo


def match_len(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two 1-D token tensors."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


class RadixNode:
    """An edge of the tree: `key` tokens whose K/V sit in slots `value`. Children are keyed by
    their first page of tokens, so two children never start with the same page."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, parent: RadixNode | None,
                 tick: int) -> None:
        self.key, self.value = key, value  # [length] int32 on the CPU / on the device
        self.parent = parent
        self.children: dict[Hashable, RadixNode] = {}
        self.ref_count = 0  # running requests whose locked handle passes through this node
        self.last_access = tick  # logical clock of the last match / insert touching it

    @property
    def length(self) -> int:
        return len(self.key)

    def __lt__(self, other: RadixNode) -> bool:  # heapq: least recently used first
        return self.last_access < other.last_access


@dataclass(frozen=True)
class RadixCacheHandle(BaseCacheHandle):
    node: RadixNode  # the deepest node of the match; its path from the root is the prefix

    def get_matched_indices(self) -> torch.Tensor:
        parts, node = [], self.node
        while node.parent is not None:
            parts.append(node.value)
            node = node.parent
        if not parts:
            return node.value  # the root's empty tensor
        return torch.cat(parts[::-1])


class RadixPrefixCache(BasePrefixCache):
    """One tree per cache salt, so that a match never crosses salts. The default salt's root is
    always there; another salt's is made by its first insertion and dropped by the eviction
    that empties it. The sizes, the clock and the LRU order of eviction span all the trees."""

    def __init__(self, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self._empty = torch.empty(0, dtype=torch.int32, device=device)
        self.root = self._new_root()  # the default salt ""
        self.roots: dict[str, RadixNode] = {"": self.root}
        self.evictable_size = 0
        self.protected_size = 0
        self._tick = 0

    def _new_root(self) -> RadixNode:
        root = RadixNode(torch.empty(0, dtype=torch.int32), self._empty, None, 0)
        root.ref_count = 1  # a root holds nothing and is never evicted
        return root

    def _child_key(self, ids: torch.Tensor) -> Hashable:
        return tuple(ids[: self.page_size].tolist())

    def match_prefix(self, input_ids: torch.Tensor, salt: str = "") -> BaseCacheHandle:
        root = self.roots.get(salt)
        if root is None:  # nothing cached under this salt: an empty match, at any root
            return RadixCacheHandle(0, self.root, salt=salt)
        node, length = self._walk(root, input_ids)
        return RadixCacheHandle(length, node, salt=salt)

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        assert isinstance(handle, RadixCacheHandle)
        node = handle.node
        while node.parent is not None:
            if unlock:
                node.ref_count -= 1
                if node.ref_count < 0:
                    raise RuntimeError("radix cache: a handle was unlocked more often than locked")
                if node.ref_count == 0:
                    self.evictable_size += node.length
                    self.protected_size -= node.length
            else:
                if node.ref_count == 0:
                    self.evictable_size -= node.length
                    self.protected_size += node.length
                node.ref_count += 1
            node = node.parent

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor,
                      salt: str = "") -> InsertResult:
        length = len(input_ids) // self.page_size * self.page_size  # whole pages only
        input_ids, indices = input_ids[:length], indices[:length]
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = self._new_root()
        node, matched = self._walk(root, input_ids)
        if matched < length:  # a new leaf for the part the tree does not have yet
            leaf = RadixNode(input_ids[matched:].clone(), indices[matched:].clone(), node,
                             self._tick)
            node.children[self._child_key(leaf.key)] = leaf
            self.evictable_size += leaf.length
            node = leaf
        return InsertResult(matched, RadixCacheHandle(length, node, salt=salt))

    def evict(self, size: int) -> torch.Tensor:
        if size > self.evictable_size:
            raise RuntimeError(f"radix cache: cannot evict {size} tokens, "
                               f"only {self.evictable_size} are unreferenced")
        leaves = [n for n in self._nodes() if not n.children and n.ref_count == 0]
        heapq.heapify(leaves)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < size:
            node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key)]
            freed.append(node.value)
            evicted += node.length
            self.evictable_size -= node.length
            if parent.parent is not None and not parent.children and parent.ref_count == 0:
                heapq.heappush(leaves, parent)  # it has just become an unreferenced leaf
        # a salt's emptied tree goes, or every salt ever seen would keep a root
        self.roots = {s: r for s, r in self.roots.items() if r.children or r is self.root}
        return torch.cat(freed) if freed else self._empty

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_size, self.protected_size)

    def check_integrity(self) -> None:
        if self.roots.get("") is not self.root:
            raise RuntimeError("radix cache: the default salt's root is missing")
        for salt, root in self.roots.items():
            if root.parent is not None or root.length or root.ref_count != 1:
                raise RuntimeError(f"radix cache: the root of salt {salt!r} is not a bare root")
        evictable = protected = 0
        for node in self._nodes():
            if node.parent is None:
                continue
            problems = []
            if node.length == 0 or node.length % self.page_size:
                problems.append(f"length {node.length} is not a positive multiple of a page")
            if len(node.value) != node.length:
                problems.append(f"{len(node.value)} slots for {node.length} tokens")
            # a lock counts every node from the handle's up to (not including) the root
            parent_refs = node.parent.ref_count if node.parent.parent is not None else None
            if node.ref_count < 0 or (parent_refs is not None and node.ref_count > parent_refs):
                problems.append(f"ref count {node.ref_count}, parent's {node.parent.ref_count}")
            if node.parent.children.get(self._child_key(node.key)) is not node:
                problems.append("not found under its first page in its parent")
            if problems:
                raise RuntimeError(f"radix cache: node {node.key[:8].tolist()}...: "
                                   + "; ".join(problems))
            if node.ref_count:
                protected += node.length
            else:
                evictable += node.length
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise RuntimeError(f"radix cache: counted evictable/protected {evictable}/{protected}, "
                               f"recorded {self.evictable_size}/{self.protected_size}")

    def _nodes(self) -> list[RadixNode]:
        nodes, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _walk(self, root: RadixNode, input_ids: torch.Tensor) -> tuple[RadixNode, int]:
        """Follow input_ids down the tree of `root` page by page; split the last node if the
        match ends inside it. Returns the deepest matched node and the matched (page-aligned)
        length."""
        self._tick += 1
        node, matched = root, 0
        while len(input_ids) - matched >= self.page_size:
            child = node.children.get(self._child_key(input_ids[matched:]))
            if child is None:
                break
            # at least the first page matches: that is how the child was found
            n = match_len(child.key, input_ids[matched:]) // self.page_size * self.page_size
            split = n < child.length
            if split:  # the match ends inside this edge: cut it there
                child = self._split(child, n)
            child.last_access = self._tick
            node, matched = child, matched + n
            if split:
                break
        return node, matched

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node` after `at` tokens: a new parent holds the first part, node keeps the rest."""
        parent = node.parent
        assert parent is not None and 0 < at < node.length
        head = RadixNode(node.key[:at], node.value[:at], parent, node.last_access)
        head.ref_count = node.ref_count
        parent.children[self._child_key(head.key)] = head
        node.key, node.value, node.parent = node.key[at:], node.value[at:], head
        head.children[self._child_key(node.key)] = node
        return head
