"""Chapter 9: the prefix caches (radix and naive) and the CacheManager that hands their pages to
requests: exact small examples, then random use checked against independent models."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from minisgl.core import Req, SamplingParams
from minisgl.kvcache import BasePrefixCache, InsertResult, SizeInfo, create_prefix_cache
from minisgl.kvcache.naive_cache import NaivePrefixCache
from minisgl.kvcache.radix_cache import RadixCacheHandle, RadixNode, RadixPrefixCache, match_len
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.utils import PendingReq

from machines import ManagerMachine, ids, slots_of

CPU = torch.device("cpu")


def radix(page_size: int) -> RadixPrefixCache:
    cache = create_prefix_cache("radix", page_size, CPU)
    assert isinstance(cache, RadixPrefixCache)
    return cache


def tree_contents(cache: RadixPrefixCache) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Every cached page-aligned prefix (its tokens) -> the slots of its last page, read off
    the tree. Pages, not tokens: with pages of 2, [0 0] and [0 1] are two pages that both hold
    a token 0 at position 0, each in a slot of its own."""
    ps = cache.page_size
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            keys, values = child.key.tolist(), child.value.tolist()
            for end in range(ps, len(keys) + 1, ps):
                out[prefix + tuple(keys[:end])] = tuple(values[end - ps : end])
            stack.append((child, prefix + tuple(keys)))
    return out


def path_of(handle: RadixCacheHandle) -> list[RadixNode]:
    """The nodes from the handle's node up to (not including) the root."""
    nodes, node = [], handle.node
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    return nodes


# --- the interface and the factory ------------------------------------------------------------

def test_create_prefix_cache_by_name() -> None:
    """The registry builds both caches by name; only the radix one reuses prefixes (the scheduler
    skips its deferral check for the other); an unknown name is refused with the known names
    listed."""
    assert isinstance(create_prefix_cache("radix", 4, CPU), RadixPrefixCache)
    assert isinstance(create_prefix_cache("naive", 4, CPU), NaivePrefixCache)
    assert all(isinstance(create_prefix_cache(name, 1, CPU), BasePrefixCache)
               for name in ("radix", "naive"))
    assert RadixPrefixCache.reuses_prefixes and not NaivePrefixCache.reuses_prefixes
    with pytest.raises(KeyError, match="naive, radix"):
        create_prefix_cache("lru", 4, CPU)


def test_size_info_and_insert_result() -> None:
    """SizeInfo adds up its two sizes; InsertResult carries the length the tree held before the
    insert and the handle."""
    info = SizeInfo(evictable_size=3, protected_size=5)
    assert info.total_size == 8 and tuple(info) == (3, 5)
    handle = radix(1).match_prefix(ids())
    assert InsertResult(2, handle).cached_len == 2 and InsertResult(2, handle).handle is handle


@pytest.mark.parametrize(("a", "b", "n"), [((), (), 0), ((1, 2, 3), (1, 2, 3), 3),
                                           ((1, 2, 3), (1, 2), 2), ((1, 2, 3), (1, 9, 3), 1),
                                           ((5,), (6,), 0)])
def test_match_len(a: tuple[int, ...], b: tuple[int, ...], n: int) -> None:
    """match_len is the length of the common prefix, whichever tensor comes first."""
    assert match_len(ids(*a), ids(*b)) == match_len(ids(*b), ids(*a)) == n


# --- the naive cache --------------------------------------------------------------------------

def test_naive_cache_caches_nothing() -> None:
    """The naive cache matches nothing, even right after an insert, and refuses to evict a single
    token."""
    cache = create_prefix_cache("naive", 4, CPU)
    handle = cache.match_prefix(ids(1, 2, 3, 4, 5, 6, 7, 8))
    assert handle.cached_len == 0 and slots_of(handle) == []
    result = cache.insert_prefix(ids(1, 2, 3, 4, 5, 6, 7, 8), ids(*range(8)))
    assert isinstance(result, InsertResult) and result.cached_len == 0
    assert result.handle.cached_len == 0 and slots_of(result.handle) == []
    assert cache.match_prefix(ids(1, 2, 3, 4)).cached_len == 0  # still nothing
    cache.lock_handle(handle)
    cache.lock_handle(handle, unlock=True)
    assert cache.size_info == SizeInfo(0, 0)
    assert cache.evict(0).tolist() == []
    with pytest.raises(RuntimeError, match="holds none"):
        cache.evict(1)
    cache.check_integrity()


# --- the radix cache: matching and inserting --------------------------------------------------

def test_radix_match_and_insert_page_size_1() -> None:
    """Page size 1: matches shorter than, equal to and longer than what is cached, one that ends
    inside an edge, and inserts over a cached prefix: cached_len is what the tree held before, and
    the handle's slots are the tree's ones first, then the new ones."""
    cache = radix(1)
    empty = cache.match_prefix(ids(1, 2, 3))
    assert empty.cached_len == 0 and slots_of(empty) == []
    first = cache.insert_prefix(ids(1, 2, 3), ids(10, 11, 12))
    assert first.cached_len == 0 and first.handle.cached_len == 3
    assert slots_of(first.handle) == [10, 11, 12]
    assert cache.size_info == SizeInfo(3, 0)
    assert cache.match_prefix(ids(1, 2, 3, 4)).cached_len == 3  # longer than what is cached
    assert slots_of(cache.match_prefix(ids(1, 2, 9))) == [10, 11]  # ends inside the edge
    assert cache.match_prefix(ids(5, 1, 2)).cached_len == 0
    assert cache.match_prefix(ids()).cached_len == 0
    # inserting a longer sequence: the first three were already cached, our copies are spare
    second = cache.insert_prefix(ids(1, 2, 3, 4), ids(20, 21, 22, 23))
    assert second.cached_len == 3 and second.handle.cached_len == 4
    assert slots_of(second.handle) == [10, 11, 12, 23]
    # inserting what is already there adds nothing
    again = cache.insert_prefix(ids(1, 2), ids(30, 31))
    assert again.cached_len == 2 and slots_of(again.handle) == [10, 11]
    assert cache.size_info == SizeInfo(4, 0)
    cache.check_integrity()


def test_radix_keeps_whole_pages_only() -> None:
    """Page size 4: an insert keeps whole pages only (8 of 10 tokens); a 7-token query hits one
    page; a second page that differs in one token is not hit; less than a page hits nothing. Two
    first pages that start alike (4 5) but differ as pages are siblings, both under [0 1 2 3]."""
    cache = radix(4)
    tokens = list(range(10))
    result = cache.insert_prefix(ids(*tokens), ids(*range(100, 110)))
    assert result.cached_len == 0 and result.handle.cached_len == 8  # 2 of the 10 are dropped
    assert slots_of(result.handle) == list(range(100, 108))
    assert cache.size_info == SizeInfo(8, 0)
    assert cache.match_prefix(ids(*tokens)).cached_len == 8
    assert cache.match_prefix(ids(*tokens[:7])).cached_len == 4  # 7 tokens: one whole page
    assert cache.match_prefix(ids(0, 1, 2, 3, 4, 5, 99, 7)).cached_len == 4  # differs in page 2
    assert cache.match_prefix(ids(0, 1, 2)).cached_len == 0  # less than a page
    assert cache.match_prefix(ids(0, 1, 2, 9, 4, 5, 6, 7)).cached_len == 0  # differs in page 1
    # a sibling whose first page starts with the same token as another child's: kept apart
    other = cache.insert_prefix(ids(0, 1, 2, 3, 4, 5, 9, 9, 1), ids(*range(200, 209)))
    assert other.cached_len == 4 and other.handle.cached_len == 8
    assert slots_of(cache.match_prefix(ids(0, 1, 2, 3, 4, 5, 9, 9, 1))) == [
        100, 101, 102, 103, 204, 205, 206, 207]
    assert slots_of(cache.match_prefix(ids(*tokens))) == list(range(100, 108))
    assert cache.size_info == SizeInfo(12, 0)
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_split_inside_an_edge(page_size: int) -> None:
    """A match that ends inside an edge cuts it there (page sizes 1 and 4). The root's only child
    is the new head, the handle's node, holding the first two pages; its only child is the old node
    object (`tail is edge`) holding the last two, so the old handle `whole` still points at it with
    all its slots. Had _split kept the old object as the head, `whole` would lose slots. A second
    insert cuts the tail again; all three handles keep their slots."""
    cache = radix(page_size)
    pages = [[1] * page_size, [2] * page_size, [3] * page_size, [4] * page_size]
    tokens = sum(pages, [])
    slots = list(range(50, 50 + len(tokens)))
    whole = cache.insert_prefix(ids(*tokens), ids(*slots)).handle
    [edge] = cache.root.children.values()
    assert edge.key.tolist() == tokens and not edge.children
    cut = 2 * page_size
    query = tokens[:cut] + [9] * page_size
    handle = cache.match_prefix(ids(*query))
    assert handle.cached_len == cut and slots_of(handle) == slots[:cut]
    [head] = cache.root.children.values()
    assert head is handle.node and head.key.tolist() == tokens[:cut]
    assert head.value.tolist() == slots[:cut]
    [tail] = head.children.values()
    assert tail is edge and tail.parent is head  # the old node keeps the rest
    assert tail.key.tolist() == tokens[cut:] and tail.value.tolist() == slots[cut:]
    assert slots_of(whole) == slots and whole.node is tail
    assert cache.size_info == SizeInfo(len(tokens), 0)  # a split moves no sizes
    cache.check_integrity()
    # a second split of the tail, through an insert that shares three pages
    third = 3 * page_size
    new_slots = list(range(90, 90 + 4 * page_size))
    new = cache.insert_prefix(ids(*tokens[:third], *[7] * page_size), ids(*new_slots))
    assert new.cached_len == third
    assert slots_of(new.handle) == slots[:third] + new_slots[third:]
    assert slots_of(whole) == slots and slots_of(handle) == slots[:cut]
    assert cache.size_info == SizeInfo(len(tokens) + page_size, 0)
    cache.check_integrity()


def test_radix_split_keeps_the_ref_count() -> None:
    """Splitting a locked node: the new head inherits its count, and the protected size does not
    change."""
    cache = radix(1)
    cache.insert_prefix(ids(1, 2, 3, 4), ids(10, 11, 12, 13))
    whole = cache.match_prefix(ids(1, 2, 3, 4))
    cache.lock_handle(whole)
    assert cache.size_info == SizeInfo(0, 4)
    half = cache.match_prefix(ids(1, 2, 9))  # splits a locked node
    assert half.node.ref_count == whole.node.ref_count == 1
    assert cache.size_info == SizeInfo(0, 4)
    cache.check_integrity()
    cache.lock_handle(whole, unlock=True)
    assert cache.size_info == SizeInfo(4, 0)
    cache.check_integrity()


# --- the radix cache: locking ------------------------------------------------------------------

def test_radix_lock_unlock_moves_sizes() -> None:
    """The tree root -> [1 2] -> {[3 4], [7]}. Locking 1 2 3 (which first cuts [3 4] into [3] ->
    [4]) protects 3 tokens and leaves 2 evictable; locking 1 2 7 adds only [7]; unlocking the first
    frees [3] while [1 2] stays held by the second; one unlock too many raises."""
    cache = radix(1)
    cache.insert_prefix(ids(1, 2, 3, 4), ids(10, 11, 12, 13))
    cache.insert_prefix(ids(1, 2, 7), ids(20, 21, 22))  # root -> [1 2] -> {[3 4], [7]}
    assert cache.size_info == SizeInfo(5, 0)
    a = cache.match_prefix(ids(1, 2, 3))  # splits [3 4] into [3] -> [4]
    assert a.cached_len == 3 and slots_of(a) == [10, 11, 12]
    cache.lock_handle(a)  # [1 2] and [3]
    assert cache.size_info == SizeInfo(2, 3)
    cache.check_integrity()
    b = cache.match_prefix(ids(1, 2, 7))
    cache.lock_handle(b)  # [7] now, [1 2] was already protected
    assert cache.size_info == SizeInfo(1, 4)
    cache.lock_handle(a, unlock=True)  # [3] is free again, [1 2] still held by b
    assert cache.size_info == SizeInfo(2, 3)
    cache.check_integrity()
    cache.lock_handle(b, unlock=True)
    assert cache.size_info == SizeInfo(5, 0)
    cache.check_integrity()
    with pytest.raises(RuntimeError, match="unlocked more often than locked"):
        cache.lock_handle(b, unlock=True)


def test_radix_lock_twice_needs_unlock_twice() -> None:
    """One handle locked twice (two requests hitting one prefix) stays protected until it is
    unlocked twice."""
    cache = radix(2)
    cache.insert_prefix(ids(1, 2, 3, 4), ids(10, 11, 12, 13))
    h = cache.match_prefix(ids(1, 2, 3, 4, 5))
    cache.lock_handle(h)
    cache.lock_handle(h)
    assert cache.size_info == SizeInfo(0, 4)
    cache.lock_handle(h, unlock=True)
    assert cache.size_info == SizeInfo(0, 4)  # one lock is left
    cache.lock_handle(h, unlock=True)
    assert cache.size_info == SizeInfo(4, 0)
    with pytest.raises(RuntimeError, match="unlocked more often"):
        cache.lock_handle(h, unlock=True)


def test_radix_check_integrity_accepts_a_prefix_locked_twice() -> None:
    """Two running requests sharing a cached prefix lock the same nodes: a good tree."""
    cache = radix(1)
    cache.insert_prefix(ids(1, 2, 3), ids(10, 11, 12))
    a = cache.match_prefix(ids(1, 2, 3))
    b = cache.match_prefix(ids(1, 2, 3))
    cache.lock_handle(a)
    cache.lock_handle(b)
    assert cache.size_info == SizeInfo(0, 3)
    cache.check_integrity()


# --- the radix cache: eviction -----------------------------------------------------------------

def test_radix_evicts_least_recently_used_first() -> None:
    """The leaf matched most recently goes last; asking for 1 token still takes a whole leaf."""
    cache = radix(1)
    cache.insert_prefix(ids(1, 1), ids(10, 11))
    cache.insert_prefix(ids(2, 2), ids(20, 21))
    cache.insert_prefix(ids(3, 3), ids(30, 31))
    assert cache.match_prefix(ids(1, 1)).cached_len == 2  # [1 1] is now the most recent
    assert cache.evict(2).tolist() == [20, 21]
    assert cache.evict(1).tolist() == [30, 31]  # at least 1: a whole leaf goes
    assert cache.size_info == SizeInfo(2, 0)
    assert cache.match_prefix(ids(1, 1)).cached_len == 2
    assert cache.match_prefix(ids(2, 2)).cached_len == cache.match_prefix(ids(3)).cached_len == 0
    assert cache.evict(0).tolist() == []
    cache.check_integrity()


def test_radix_never_evicts_a_locked_node() -> None:
    """A locked node stays even when it is the oldest; asking for more than the unlocked part
    raises."""
    cache = radix(1)
    old = cache.insert_prefix(ids(1, 1), ids(10, 11)).handle  # the oldest
    cache.insert_prefix(ids(2, 2), ids(20, 21))
    cache.lock_handle(old)
    assert cache.size_info == SizeInfo(2, 2)
    assert cache.evict(1).tolist() == [20, 21]
    assert cache.size_info == SizeInfo(0, 2)
    with pytest.raises(RuntimeError, match="only 0 are unreferenced"):
        cache.evict(1)
    assert slots_of(cache.match_prefix(ids(1, 1))) == [10, 11]
    cache.lock_handle(old, unlock=True)
    assert cache.evict(2).tolist() == [10, 11]
    assert cache.size_info == SizeInfo(0, 0) and not cache.root.children
    cache.check_integrity()


def test_radix_parent_left_bare_is_evicted_in_the_same_call() -> None:
    """The logical clock: [3] is 1, [4] and the split-off [1 2] are 2, [5] is 3. Evicting 3 tokens
    takes [3], then [4]; [1 2] is now an unreferenced leaf, joins the heap and, older than [5],
    goes next. Without pushing the bare parent, [5] would go instead; with wall-clock timestamps
    the order would not be fixed."""
    cache = radix(1)
    cache.insert_prefix(ids(1, 2, 3), ids(10, 11, 12))  # tick 1
    cache.insert_prefix(ids(1, 2, 4), ids(0, 0, 14))  # tick 2: [1 2] -> {[3], [4]}
    cache.insert_prefix(ids(5), ids(50))  # tick 3
    assert cache.size_info == SizeInfo(5, 0)
    # [3] (tick 1), then [4] (tick 2), then their parent [1 2] (tick 2) before [5] (tick 3)
    assert cache.evict(3).tolist() == [12, 14, 10, 11]
    assert cache.size_info == SizeInfo(1, 0)
    assert list(cache.root.children) == [(5,)]
    cache.check_integrity()


def test_radix_locked_child_keeps_its_parent() -> None:
    """A locked child keeps its parent: only the other, unlocked leaf can go."""
    cache = radix(2)
    cache.insert_prefix(ids(1, 1, 2, 2), ids(10, 11, 12, 13))
    cache.insert_prefix(ids(1, 1, 3, 3), ids(0, 0, 22, 23))
    held = cache.match_prefix(ids(1, 1, 3, 3, 0))
    cache.lock_handle(held)
    assert cache.size_info == SizeInfo(2, 4)
    assert cache.evict(2).tolist() == [12, 13]
    with pytest.raises(RuntimeError, match="cannot evict 1 tokens"):
        cache.evict(1)
    assert slots_of(held) == [10, 11, 22, 23]
    cache.check_integrity()


def test_radix_evict_more_than_evictable_changes_nothing() -> None:
    """Asking for more than is evictable raises and leaves the tree as it was."""
    cache = radix(2)
    cache.insert_prefix(ids(1, 2, 3, 4), ids(10, 11, 12, 13))
    with pytest.raises(RuntimeError, match="cannot evict 5 tokens, only 4"):
        cache.evict(5)
    assert cache.size_info == SizeInfo(4, 0)
    assert cache.match_prefix(ids(1, 2, 3, 4)).cached_len == 4
    cache.check_integrity()


# --- the radix cache: check_integrity --------------------------------------------------------

def _corrupt_evictable(cache: RadixPrefixCache, node: RadixNode) -> None:
    cache.evictable_size += 1


def _corrupt_protected(cache: RadixPrefixCache, node: RadixNode) -> None:
    cache.protected_size -= 1


def _corrupt_ref_count(cache: RadixPrefixCache, node: RadixNode) -> None:
    node.ref_count = -1


def _corrupt_child_ref_count(cache: RadixPrefixCache, node: RadixNode) -> None:
    [child] = node.children.values()
    child.ref_count = node.ref_count + 1  # more than its parent: impossible by locking


def _corrupt_value(cache: RadixPrefixCache, node: RadixNode) -> None:
    node.value = node.value[:-1]


def _corrupt_key(cache: RadixPrefixCache, node: RadixNode) -> None:
    node.key = node.key.flip(0)  # no longer found under its first page


@pytest.mark.parametrize("corrupt", [_corrupt_evictable, _corrupt_protected, _corrupt_ref_count,
                                     _corrupt_child_ref_count, _corrupt_value, _corrupt_key])
def test_radix_check_integrity_catches_corruption(corrupt) -> None:
    """A good tree passes; then each of six corruptions (evictable total +1, protected total -1, a
    negative count, a child counting more than its parent, one slot missing, a key reversed so that
    its parent no longer finds it) must make check_integrity raise, so the check the state machines
    call after every step is not for show."""
    cache = radix(2)
    cache.insert_prefix(ids(1, 2, 3, 4, 5, 6), ids(10, 11, 12, 13, 14, 15))
    held = cache.match_prefix(ids(1, 2, 3, 4))  # root -> [1 2 3 4] (locked) -> [5 6]
    cache.lock_handle(held)
    cache.check_integrity()
    corrupt(cache, held.node)
    with pytest.raises(RuntimeError, match="radix cache"):
        cache.check_integrity()


# --- the radix cache under random use, against a model -----------------------------------------

class RadixMachine(RuleBasedStateMachine):
    """Random inserts (maybe locked), matches (maybe locked), unlocks of a held handle, evictions
    of a random amount, and evictions of too much, with tokens 0..3 and sequences often derived
    from earlier ones so that edges are met at every depth. An independent model, kept by hand, is
    a dict from every cached page-aligned prefix (its tokens) to the slots of its last page; every
    rule's result is checked against it (the expected match is found by brute force), and an
    eviction must return distinct whole pages of the model and leave it closed under taking
    prefixes (only leaves go). Slots are handed out fresh from a counter, so each one must end up
    in exactly one place: in the model, evicted, or spare."""

    cache_cls: type[RadixPrefixCache] = RadixPrefixCache
    page_sizes = (1, 2, 4)

    def __init__(self) -> None:
        super().__init__()
        self.ps = 1
        self.cache = self.cache_cls(1, CPU)
        self.model: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.next_slot = 0
        self.evicted: list[int] = []  # slots evict() gave back
        self.spare: list[int] = []  # slots insert did not keep: already cached, or a part page
        self.held: list[tuple[RadixCacheHandle, list[int]]] = []  # locked, with their slots
        self.seen: list[list[int]] = []  # sequences inserted so far, to derive others from

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        page_size = data.draw(st.sampled_from(self.page_sizes), label="page_size")
        self.ps = page_size
        self.cache = self.cache_cls(page_size, CPU)
        for _ in range(data.draw(st.integers(1, 4), label="first inserts")):
            self.insert(data, lock=False)  # start from a tree, whichever rules run after

    def _tokens(self, data: st.DataObject) -> list[int]:
        """0..24 tokens from 0..3, so that prefixes collide; often a prefix of an inserted
        sequence with a new tail, so that matches and inserts meet edges at every depth."""
        n = data.draw(st.integers(0, 24), label="length")
        base: list[int] = []
        if self.seen and data.draw(st.booleans(), label="reuse"):
            base = data.draw(st.sampled_from(self.seen), label="base")[:n]
            base = base[: data.draw(st.integers(0, len(base)), label="cut")]
        tail = data.draw(st.binary(min_size=n - len(base), max_size=n - len(base)), label="tail")
        return base + [byte % 4 for byte in tail]  # tokens 0..3, one draw for all of them

    def _expected_len(self, tokens: list[int]) -> int:
        """Brute force: the longest page-aligned prefix of `tokens` that is a cached prefix."""
        return max((len(k) for k in self.model if tuple(tokens[: len(k)]) == k), default=0)

    def _expected_slots(self, tokens: list[int], n: int) -> list[int]:
        pages = [self.model[tuple(tokens[:end])] for end in range(self.ps, n + 1, self.ps)]
        return [s for page in pages for s in page]

    @rule(data=st.data(), lock=st.booleans())
    def insert(self, data: st.DataObject, lock: bool) -> None:
        tokens = self._tokens(data)
        slots = list(range(self.next_slot, self.next_slot + len(tokens)))
        self.next_slot += len(tokens)
        kept = len(tokens) // self.ps * self.ps
        before = self._expected_len(tokens[:kept])
        result = self.cache.insert_prefix(ids(*tokens), ids(*slots))
        self.seen.append(tokens)
        assert result.cached_len == before, (result.cached_len, before)
        assert result.handle.cached_len == kept
        for end in range(before + self.ps, kept + 1, self.ps):
            self.model[tuple(tokens[:end])] = tuple(slots[end - self.ps : end])
        self.spare += slots[:before] + slots[kept:]
        expected = self._expected_slots(tokens, kept)
        assert slots_of(result.handle) == expected
        if lock:
            self.cache.lock_handle(result.handle)
            self.held.append((result.handle, expected))

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data: st.DataObject, lock: bool) -> None:
        tokens = self._tokens(data)
        handle = self.cache.match_prefix(ids(*tokens))
        n = self._expected_len(tokens)
        assert handle.cached_len == n, (handle.cached_len, n)
        expected = self._expected_slots(tokens, n)
        assert slots_of(handle) == expected
        if lock:
            self.cache.lock_handle(handle)
            self.held.append((handle, expected))

    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        if not self.held:
            return
        i = data.draw(st.integers(0, len(self.held) - 1), label="which")
        handle, _ = self.held.pop(i)
        self.cache.lock_handle(handle, unlock=True)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        evictable = self.cache.size_info.evictable_size
        size = data.draw(st.integers(min(1, evictable), evictable), label="size")  # 0 if none
        out = self.cache.evict(size).tolist()
        assert len(out) >= size
        assert self.cache.size_info.evictable_size == evictable - len(out)
        gone = set(out)
        assert len(gone) == len(out)
        model = {k: v for k, v in self.model.items() if gone.isdisjoint(v)}
        assert sum(map(len, model.values())) == sum(map(len, self.model.values())) - len(out), (
            "evict returned slots it did not hold, or part of a page")
        # only leaves go: what is left is still closed under taking prefixes
        assert all(k[: -self.ps] in model for k in model if len(k) > self.ps)
        self.model = model
        self.evicted += out

    @rule()
    def evict_too_much(self) -> None:
        before = self.cache.size_info
        with pytest.raises(RuntimeError, match="cannot evict"):
            self.cache.evict(before.evictable_size + 1)
        assert self.cache.size_info == before

    @invariant()
    def agrees_with_the_model(self) -> None:
        """After every step: the tree holds exactly the model's prefixes (each with its last
        page's slots) and the sizes agree; every slot handed out is in exactly one place (the
        model, evicted, or spare); each node's ref count is the number of held handles whose
        path passes through it, and the protected size agrees; every held handle still hangs
        from the root with the slots it had when locked; the tree's check_integrity passes."""
        cache = self.cache
        assert tree_contents(cache) == self.model
        info = cache.size_info
        nodes = [n for n in cache._nodes() if n.parent is not None]
        assert info.total_size == len(self.model) * self.ps == sum(n.length for n in nodes)
        # each slot handed out is in exactly one place
        places = [s for page in self.model.values() for s in page] + self.evicted + self.spare
        assert sorted(places) == list(range(self.next_slot))
        # a node's ref count is the number of locked handles whose path passes through it
        paths = [path_of(h) for h, _ in self.held]
        for node in nodes:
            count = sum(any(n is node for n in path) for path in paths)
            assert node.ref_count == count >= 0, (node.ref_count, count)
        assert info.protected_size == sum(n.length for n in nodes if n.ref_count)
        # nothing locked was evicted: each held handle still hangs from the root, same slots
        for handle, expected in self.held:
            node = handle.node
            while node.parent is not None:
                assert node.parent.children.get(cache._child_key(node.key)) is node
                node = node.parent
            assert node is cache.root
            assert slots_of(handle) == expected
        cache.check_integrity()


# No explain phase: on a failure it reruns the machine for minutes to annotate lines.
PHASES = [Phase.explicit, Phase.generate, Phase.shrink]
RADIX_SETTINGS = settings(max_examples=20, stateful_step_count=25, derandomize=True,
                          deadline=None, database=None, phases=PHASES)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_radix_cache_against_a_model(page_size: int) -> None:
    """One run per page size (1, 2, 4), so that each gets its share of the examples: 20 examples of
    up to 25 steps each, derandomized."""

    class Machine(RadixMachine):
        page_sizes = (page_size,)

    run_state_machine_as_test(Machine, settings=RADIX_SETTINGS)


class ForgetfulRadix(RadixPrefixCache):
    """A planted bug: eviction drops a node but forgets to hand back its last slot."""

    def evict(self, size: int) -> torch.Tensor:
        out = super().evict(size)
        return out[:-1]


def test_planted_radix_leak_is_caught() -> None:
    """ForgetfulRadix hands back one slot too few: the machine must fail (its evict rule compares
    the slots returned with the drop in the evictable size)."""
    class ForgetfulMachine(RadixMachine):
        cache_cls = ForgetfulRadix

    with pytest.raises(AssertionError):
        run_state_machine_as_test(ForgetfulMachine, settings=settings(
            RADIX_SETTINGS, phases=[Phase.explicit, Phase.generate]))


# --- the CacheManager -------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def admit(mgr: CacheManager, uid: int, prompt: list[int], row: int,
          output_len: int = 4) -> Req:
    """What PrefillAdder does for one request: match, lock, copy the cached slots into its row."""
    pending = PendingReq(uid, ids(*prompt), SamplingParams(max_tokens=output_len,
                                                           ignore_eos=True))
    handle = mgr.match_req(pending)
    mgr.lock(handle)
    mgr.page_table[row, : handle.cached_len] = handle.get_matched_indices()
    return Req(pending.input_ids, row, handle.cached_len, output_len, uid,
               pending.sampling_params, handle)


def test_match_req_leaves_the_last_token_to_compute() -> None:
    """Prompt 1 2 3 wholly cached: the match is 2 tokens; the last one is left for the prefill."""
    mgr = CacheManager(8, 1, torch.zeros((2, 16), dtype=torch.int32))
    mgr.prefix_cache.insert_prefix(ids(1, 2, 3), ids(5, 6, 7))
    pending = PendingReq(0, ids(1, 2, 3), GREEDY)
    assert mgr.match_req(pending).cached_len == 2
    assert mgr.match_req(PendingReq(1, ids(1), GREEDY)).cached_len == 0


def test_allocate_paged_writes_page_aligned_slots() -> None:
    """Page size 2: each request gets pages only for positions no page of its covers yet, in batch
    order, written into its row as slots."""
    page_table = torch.zeros((3, 12), dtype=torch.int32)
    mgr = CacheManager(6, 2, page_table)
    assert mgr.free_slots.tolist() == [0, 2, 4, 6, 8, 10] and mgr.available_size == 12
    a = admit(mgr, 0, [1, 2, 3], row=0)  # 3 tokens: 2 pages
    b = admit(mgr, 1, [4], row=2)  # 1 token: 1 page
    mgr.allocate_paged([a, b])
    assert page_table[0, :4].tolist() == [0, 1, 2, 3] and page_table[2, :2].tolist() == [4, 5]
    assert mgr.free_slots.tolist() == [6, 8, 10]
    for req in (a, b):
        req.complete_one()
    mgr.allocate_paged([a, b])  # positions 3 and 1: both on pages they already have
    assert mgr.free_slots.tolist() == [6, 8, 10]
    for req in (a, b):
        req.complete_one()
    mgr.allocate_paged([a, b])  # positions 4 and 2: a new page each, in batch order
    assert page_table[0, :6].tolist() == [0, 1, 2, 3, 6, 7]
    assert page_table[2, :4].tolist() == [4, 5, 8, 9]
    assert mgr.free_slots.tolist() == [10]
    mgr.allocate_paged([])
    assert mgr.free_slots.tolist() == [10]


def test_allocate_evicts_when_the_free_list_runs_out() -> None:
    """4 pages of 2. a's 5 tokens get pages 0, 2, 4; after its prefill [1 2 3 4] is cached and
    locked; when it finishes its part page 4 is freed and the cached 4 tokens become evictable. b
    needs 3 pages with 2 free, so a's prefix is evicted: b's row [6 7 4 5 0 1] uses the free list
    first, then the evicted pages. c finds nothing left to evict and fails (in the scheduler,
    admission control stops it first)."""
    page_table = torch.zeros((2, 12), dtype=torch.int32)
    mgr = CacheManager(4, 2, page_table)
    a = admit(mgr, 0, [1, 2, 3, 4, 5], row=0, output_len=1)
    mgr.allocate_paged([a])  # pages 0, 2, 4
    a.complete_one()
    mgr.cache_req(a, finished=False)  # [1 2 3 4] now in the cache, locked
    assert mgr.prefix_cache.size_info == SizeInfo(0, 4)
    a.append_host(torch.tensor(9))
    mgr.cache_req(a, finished=True)  # its part page 4 is freed, the cache's become evictable
    assert mgr.free_slots.tolist() == [6, 4]
    assert mgr.prefix_cache.size_info == SizeInfo(4, 0) and mgr.available_size == 8
    mgr.check_integrity()
    b = admit(mgr, 1, [9, 9, 9, 9, 9], row=1)
    assert b.cached_len == 0
    mgr.allocate_paged([b])  # 3 pages, 2 free: the cached [1 2 3 4] (pages 0, 2) is evicted
    assert page_table[1, :6].tolist() == [6, 7, 4, 5, 0, 1]
    assert mgr.free_slots.tolist() == [2] and mgr.prefix_cache.size_info == SizeInfo(0, 0)
    c = admit(mgr, 2, [7, 7, 7, 7, 7], row=0)
    with pytest.raises(RuntimeError, match="cannot evict"):
        mgr.allocate_paged([c])  # admission control would have refused it


def test_duplicate_prefix_computed_twice_is_freed_once_cached() -> None:
    """Page size 4; a and b share a prompt of two pages and a token and are both admitted before
    either is cached, so both compute it. a is cached first. For b, in_cache = 8: its copies (pages
    12, 16) are freed, its first 8 columns are pointed at the tree's slots 0..7, its third page
    (20) stays its own, and its new handle is a's node. The 8 tokens stay protected until both
    finish; no page is lost. Without the repointing in cache_req, b's row would still hold 12..19.
    """
    page_table = torch.zeros((2, 16), dtype=torch.int32)
    mgr = CacheManager(8, 4, page_table)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # two whole pages and one token
    a, b = admit(mgr, 0, prompt, row=0), admit(mgr, 1, prompt, row=1)
    assert a.cached_len == b.cached_len == 0
    mgr.allocate_paged([a, b])
    assert page_table[0, :12].tolist() == list(range(0, 12))  # pages 0, 4, 8
    assert page_table[1, :12].tolist() == list(range(12, 24))  # pages 12, 16, 20
    assert mgr.free_slots.tolist() == [24, 28]
    for req in (a, b):
        req.complete_one()
    mgr.cache_req(a, finished=False)
    assert a.cache_handle.cached_len == 8 and slots_of(a.cache_handle) == list(range(8))
    assert mgr.prefix_cache.size_info == SizeInfo(0, 8)
    mgr.cache_req(b, finished=False)
    assert mgr.free_slots.tolist() == [24, 28, 12, 16]  # b's copy of the two pages
    assert page_table[1, :8].tolist() == list(range(8))  # now the cache's slots
    assert page_table[1, 8:12].tolist() == list(range(20, 24))  # its part page is still its own
    assert b.cache_handle.cached_len == 8 and b.cache_handle.node is a.cache_handle.node
    assert mgr.prefix_cache.size_info == SizeInfo(0, 8)
    for req in (a, b):
        req.append_host(torch.tensor(7))
    mgr.cache_req(a, finished=True)
    assert mgr.prefix_cache.size_info == SizeInfo(0, 8)  # b still holds it
    mgr.cache_req(b, finished=True)
    assert mgr.prefix_cache.size_info == SizeInfo(8, 0)
    assert sorted(mgr.free_slots.tolist()) == [8, 12, 16, 20, 24, 28]
    mgr.check_integrity()
    assert len(mgr.free_slots) + mgr.prefix_cache.size_info.total_size // 4 == 8


MANAGER_SETTINGS = settings(max_examples=15, stateful_step_count=30, derandomize=True,
                            deadline=None, database=None, phases=PHASES)


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_manager_pages_are_conserved(page_size: int, cache_type: str) -> None:
    """Page sizes 1 and 4, radix and naive: four runs of 15 examples of up to 30 steps,
    derandomized."""
    class Machine(ManagerMachine):
        page_sizes, cache_types = (page_size,), (cache_type,)

    run_state_machine_as_test(Machine, settings=MANAGER_SETTINGS)


class LeakyManager(CacheManager):
    """A planted bug: freeing forgets the last page of every run it is given."""

    def _free(self, slots: torch.Tensor) -> None:
        super()._free(slots[: -self.page_size])


def test_planted_page_leak_is_caught() -> None:
    """LeakyManager forgets a page on every free: the machine must fail (page conservation)."""
    class LeakyMachine(ManagerMachine):
        manager_cls = LeakyManager

    with pytest.raises(AssertionError):
        run_state_machine_as_test(LeakyMachine, settings=settings(
            MANAGER_SETTINGS, phases=[Phase.explicit, Phase.generate]))
