"""Chapter 15: the cache salt. A request reuses cached K/V only of requests with the same salt
(the default "" is one tenant, as before); pinned down in the engine (hits with the same salt,
none across salts, same greedy outputs, no deferral across salts, eviction across salts), in the
radix cache and in the CacheManager (random use over several salts against models that track
which salt each slot and page belongs to), with planted salt-blind caches that must be caught."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

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
from minisgl.kvcache import BaseCacheHandle, InsertResult, SizeInfo, create_prefix_cache
from minisgl.kvcache.radix_cache import RadixCacheHandle, RadixNode, RadixPrefixCache
from minisgl.llm import LLM
from minisgl.scheduler.utils import PendingReq

from machines import ManagerMachine, ids, slots_of
from reference import hf_greedy
from serving import Server

CPU = torch.device("cpu")
SALTS = ("", "a", "b")
# No explain phase: on a failure it reruns the machine for minutes to annotate lines.
PHASES = [Phase.explicit, Phase.generate, Phase.shrink]


# --- the engine ---------------------------------------------------------------------------------

class SaltedLLM(LLM):
    """The offline engine with a salt per prompt of the next generate call (LLM.generate takes
    none): each queued request gets its salt as the scheduler receives it."""

    salts: list[str] = []

    def receive_reqs(self, blocking: bool) -> list[PendingReq]:
        reqs = super().receive_reqs(blocking)
        for req in reqs:
            req.cache_salt = self.salts[req.uid]
        return reqs


@pytest.fixture
def make_salted(model_dir: Callable[[str], Path]) -> Iterator[Callable[..., SaltedLLM]]:
    """`make_salted(**config)` -> a SaltedLLM on tiny-qwen3, float32, 512 pages unless `config`
    says otherwise; shut down after the test."""
    made: list[SaltedLLM] = []

    def make(**config) -> SaltedLLM:
        config.setdefault("num_page_override", 512)
        made.append(SaltedLLM(str(model_dir("tiny-qwen3")), dtype=torch.float32, **config))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm: SaltedLLM, prompts: list[list[int]], salts: list[str],
             max_tokens: int = 6) -> tuple[list[list[int]], int, int]:
    """The outputs, and the prompt tokens this call computed and took from the cache."""
    llm.salts = salts
    computed, cached = llm.stats.prefill_tokens, llm.stats.cached_tokens
    out = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return ([o["token_ids"] for o in out], llm.stats.prefill_tokens - computed,
            llm.stats.cached_tokens - cached)


@pytest.mark.parametrize("salt", ["", "a"])
def test_same_salt_hits_the_cache(salt: str, make_salted, model_dir) -> None:
    """Page size 1: a 30-token prompt twice with the same salt (the default one, then "a"). The
    second call takes 29 tokens from the cache and computes only the last one, and both equal
    HF."""
    llm = make_salted(page_size=1)
    prompt = random_prompt(30, seed=0)
    first, computed, cached = generate(llm, [prompt], [salt])
    assert (computed, cached) == (30, 0)
    again, computed, cached = generate(llm, [prompt], [salt])
    assert (computed, cached) == (1, 29)
    assert first == again == [hf_greedy(model_dir("tiny-qwen3"), prompt, 6)[0]]
    assert set(llm.cache_manager.prefix_cache.roots) == {"", salt}


def test_other_salt_reuses_nothing(make_salted) -> None:
    """Page size 1: the same 30-token prompt under salts "a", "b", "" and "a" again, one call
    each. "b" and "" find nothing of "a"'s (0 cached tokens: all 30 computed) and give the same
    greedy tokens; "a" again still finds its own 29. Had matching ignored the salt (the planted
    SaltBlindRadix below), "b" would report 29 cached tokens here and fail the first check."""
    llm = make_salted(page_size=1)
    prompt = random_prompt(30, seed=1)
    outputs = []
    for salt, expected in [("a", (30, 0)), ("b", (30, 0)), ("", (30, 0)), ("a", (1, 29))]:
        out, computed, cached = generate(llm, [prompt], [salt])
        assert (computed, cached) == expected, salt
        outputs.append(out)
    assert all(o == outputs[0] for o in outputs)
    info = llm.cache_manager.prefix_cache.size_info
    # three copies (a, b, ""), each the prompt and the 5 outputs fed back; nothing locked
    assert info == SizeInfo(3 * 35, 0)


def test_no_deferral_across_salts(make_salted, caplog) -> None:
    """Two identical 40-token prompts in one call (a new prompt for each call, so that nothing
    is cached yet). With one salt the second waits a step (it shares 39 >= 32 tokens with the
    first, DEFER_MIN_SHARED) and then finds them cached; with salts "a" and "b" waiting would
    gain nothing, so both are prefilled in the first step, each computing all 40, and their
    outputs are the same."""
    llm = make_salted(page_size=1)
    runs = {}
    for seed, salts in [(2, ["a", "a"]), (5, ["a", "b"])]:
        prompt = random_prompt(40, seed=seed)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
            runs[salts[1]] = generate(llm, [prompt, prompt], salts)
        steps = [r.getMessage().split() for r in caplog.records
                 if r.name.startswith("minisgl") and r.getMessage().startswith("prefill")]
        if salts[1] == "a":
            assert steps == [["prefill", "0+40"], ["prefill", "1+1"]]
        else:
            assert steps == [["prefill", "0+40", "1+40"]]
    assert runs["a"][1:] == (41, 39) and runs["b"][1:] == (80, 0)
    for out, _, _ in runs.values():
        assert out[0] == out[1]


def test_eviction_across_salts_keeps_outputs_right(make_salted, model_dir) -> None:
    """A pool of 24 pages of 4 (96 slots): four rounds of the same two 24-token prompts, each
    round under a new salt, so that every round computes everything and evicts the older salts'
    copies. Every round equals HF, no page is lost, and the emptied salts' trees are dropped."""
    llm = make_salted(page_size=4, num_page_override=24)
    prompts = [random_prompt(24, seed=3), random_prompt(24, seed=4)]
    ref = [hf_greedy(model_dir("tiny-qwen3"), p, 6)[0] for p in prompts]
    for salt in ["s0", "s1", "s2", "s3"]:
        out, computed, cached = generate(llm, prompts, [salt, salt])
        assert out == ref and (computed, cached) == (48, 0)
        mgr = llm.cache_manager
        assert len(mgr.free_slots) * 4 + mgr.prefix_cache.size_info.total_size == 96
    roots = llm.cache_manager.prefix_cache.roots
    assert "s3" in roots and "s0" not in roots  # the oldest salt's tree was emptied, dropped


# --- the radix cache: exact examples -----------------------------------------------------------

def radix(page_size: int) -> RadixPrefixCache:
    cache = create_prefix_cache("radix", page_size, CPU)
    assert isinstance(cache, RadixPrefixCache)
    return cache


def test_radix_trees_per_salt() -> None:
    """Page size 2. [1 2 3 4] under "a" is found only under "a"; the same tokens under "b" get a
    tree of their own (nothing already cached: cached_len 0, its own slots kept); handles carry
    their salt; an unknown salt matches nothing and makes no tree. Evicting everything drops the
    salted trees and keeps the default one."""
    cache = radix(2)
    a = cache.insert_prefix(ids(1, 2, 3, 4), ids(10, 11, 12, 13), "a")
    assert a.cached_len == 0 and a.handle.salt == "a"
    for salt, n in [("a", 4), ("", 0), ("b", 0), ("zz", 0)]:
        handle = cache.match_prefix(ids(1, 2, 3, 4, 5), salt)
        assert handle.cached_len == n and handle.salt == salt
    assert slots_of(cache.match_prefix(ids(1, 2, 3), "a")) == [10, 11]
    b = cache.insert_prefix(ids(1, 2, 3, 4, 5), ids(20, 21, 22, 23, 24), "b")
    assert b.cached_len == 0 and slots_of(b.handle) == [20, 21, 22, 23]
    assert slots_of(cache.match_prefix(ids(1, 2, 3, 4), "a")) == [10, 11, 12, 13]
    assert set(cache.roots) == {"", "a", "b"} and cache.size_info == SizeInfo(8, 0)
    cache.lock_handle(b.handle)
    assert cache.size_info == SizeInfo(4, 4)
    assert sorted(cache.evict(4).tolist()) == [10, 11, 12, 13]  # only "a"'s was unlocked
    assert set(cache.roots) == {"", "b"}
    cache.lock_handle(b.handle, unlock=True)
    cache.check_integrity()
    assert sorted(cache.evict(4).tolist()) == [20, 21, 22, 23]
    assert set(cache.roots) == {""} and cache.root is cache.roots[""]
    cache.check_integrity()


def test_eviction_is_lru_across_salts() -> None:
    """One clock for all the trees: the least recently used leaf goes first, whatever its salt."""
    cache = radix(1)
    cache.insert_prefix(ids(1), ids(10), "a")
    cache.insert_prefix(ids(1), ids(20), "b")
    cache.insert_prefix(ids(1), ids(30), "")
    cache.match_prefix(ids(1), "a")  # "a" is now the most recent, "b" the oldest
    assert cache.evict(1).tolist() == [20]
    assert cache.evict(1).tolist() == [30]
    assert cache.evict(1).tolist() == [10]


def test_default_salt_and_naive_handle() -> None:
    """PendingReq's salt defaults to "" and the old positional fields still come first; the naive
    cache still matches nothing, with the salt on its handle."""
    params = SamplingParams(max_tokens=1)
    assert PendingReq(0, ids(1), params).cache_salt == ""
    assert PendingReq(0, ids(1), params, None, "t").cache_salt == "t"
    naive = create_prefix_cache("naive", 1, CPU)
    for salt in SALTS:
        handle = naive.match_prefix(ids(1, 2), salt)
        assert handle.cached_len == 0 and handle.salt == salt and slots_of(handle) == []
    assert naive.insert_prefix(ids(1, 2), ids(5, 6), "a").cached_len == 0


# --- the radix cache: random use over several salts ---------------------------------------------

def tree_contents(root: RadixNode, ps: int) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Every cached page-aligned prefix of one tree -> the slots of its last page."""
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            keys, values = child.key.tolist(), child.value.tolist()
            for end in range(ps, len(keys) + 1, ps):
                out[prefix + tuple(keys[:end])] = tuple(values[end - ps : end])
            stack.append((child, prefix + tuple(keys)))
    return out


def path_of(handle: BaseCacheHandle) -> list[RadixNode]:
    assert isinstance(handle, RadixCacheHandle)
    nodes, node = [], handle.node
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    return nodes


class SaltMachine(RuleBasedStateMachine):
    """Inserts, matches (locked or not), unlocks and evictions over three salts, on token
    sequences that often repeat across salts, checked against a model: per salt, the cached
    prefixes with the slots of their last page. Every slot handed out is in exactly one place
    (cached, evicted, or spare) and is remembered with the salt it was inserted under: a match
    under salt s must return exactly the model's slots for s, all inserted under s."""

    cache_cls: type[RadixPrefixCache] = RadixPrefixCache
    page_sizes = (1, 2)

    def __init__(self) -> None:
        super().__init__()
        self.ps = 1
        self.cache = self.cache_cls(1, CPU)
        self.model: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {s: {} for s in SALTS}
        self.owner: dict[int, str] = {}  # cached slot -> the salt it was inserted under
        self.next_slot = 0
        self.evicted: list[int] = []
        self.spare: list[int] = []
        self.held: list[tuple[BaseCacheHandle, list[int]]] = []
        self.seen: list[list[int]] = []

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.ps = data.draw(st.sampled_from(self.page_sizes), label="page_size")
        self.cache = self.cache_cls(self.ps, CPU)
        for _ in range(data.draw(st.integers(1, 4), label="first inserts")):
            self.insert(data, data.draw(st.sampled_from(SALTS), label="salt"), lock=False)

    def _tokens(self, data: st.DataObject) -> list[int]:
        """0..16 tokens from 0..3, often a cut of a sequence already inserted (under any salt)
        with a new tail."""
        n = data.draw(st.integers(0, 16), label="length")
        base: list[int] = []
        if self.seen and data.draw(st.booleans(), label="reuse"):
            base = data.draw(st.sampled_from(self.seen), label="base")[:n]
            base = base[: data.draw(st.integers(0, len(base)), label="cut")]
        tail = data.draw(st.binary(min_size=n - len(base), max_size=n - len(base)), label="tail")
        return base + [byte % 4 for byte in tail]

    def _expected(self, salt: str, tokens: list[int]) -> tuple[int, list[int]]:
        model = self.model[salt]
        n = max((len(k) for k in model if tuple(tokens[: len(k)]) == k), default=0)
        pages = [model[tuple(tokens[:end])] for end in range(self.ps, n + 1, self.ps)]
        return n, [s for page in pages for s in page]

    @rule(data=st.data(), salt=st.sampled_from(SALTS), lock=st.booleans())
    def insert(self, data: st.DataObject, salt: str, lock: bool) -> None:
        tokens = self._tokens(data)
        slots = list(range(self.next_slot, self.next_slot + len(tokens)))
        self.next_slot += len(tokens)
        kept = len(tokens) // self.ps * self.ps
        before, _ = self._expected(salt, tokens[:kept])
        result = self.cache.insert_prefix(ids(*tokens), ids(*slots), salt)
        self.seen.append(tokens)
        assert (result.cached_len, result.handle.cached_len) == (before, kept)
        assert result.handle.salt == salt
        for end in range(before + self.ps, kept + 1, self.ps):
            self.model[salt][tuple(tokens[:end])] = tuple(slots[end - self.ps : end])
        self.owner.update((s, salt) for s in slots[before:kept])
        self.spare += slots[:before] + slots[kept:]
        expected = self._expected(salt, tokens[:kept])[1]
        assert slots_of(result.handle) == expected
        if lock:
            self.cache.lock_handle(result.handle)
            self.held.append((result.handle, expected))

    @rule(data=st.data(), salt=st.sampled_from(SALTS), lock=st.booleans())
    def match(self, data: st.DataObject, salt: str, lock: bool) -> None:
        tokens = self._tokens(data)
        handle = self.cache.match_prefix(ids(*tokens), salt)
        n, expected = self._expected(salt, tokens)
        assert (handle.cached_len, handle.salt) == (n, salt)
        got = slots_of(handle)
        assert all(self.owner[s] == salt for s in got), "a match crossed salts"
        assert got == expected
        if lock:
            self.cache.lock_handle(handle)
            self.held.append((handle, expected))

    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        if self.held:
            handle, _ = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
            self.cache.lock_handle(handle, unlock=True)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        evictable = self.cache.size_info.evictable_size
        size = data.draw(st.integers(min(1, evictable), evictable), label="size")
        out = self.cache.evict(size).tolist()
        assert len(out) >= size and len(set(out)) == len(out)
        assert self.cache.size_info.evictable_size == evictable - len(out)
        gone = set(out)
        for salt in SALTS:
            self.model[salt] = {k: v for k, v in self.model[salt].items() if gone.isdisjoint(v)}
        for s in out:
            del self.owner[s]  # a KeyError: a slot evicted that was not cached, or twice
        self.evicted += out
        # an emptied salted tree is dropped
        assert all(r.children or s == "" for s, r in self.cache.roots.items())

    @invariant()
    def agrees_with_the_model(self) -> None:
        """Each salt's tree holds exactly its model; the sizes add up over the trees; every slot
        is in exactly one place; ref counts are the held handles through each node; held
        handles keep their slots; check_integrity passes."""
        cache = self.cache
        for salt in SALTS:
            root = cache.roots.get(salt)
            assert (tree_contents(root, self.ps) if root else {}) == self.model[salt], salt
        cached = [s for model in self.model.values() for page in model.values() for s in page]
        assert sorted(cached) == sorted(self.owner)
        assert sorted(cached + self.evicted + self.spare) == list(range(self.next_slot))
        nodes = [n for n in cache._nodes() if n.parent is not None]
        assert cache.size_info.total_size == len(cached) == sum(n.length for n in nodes)
        paths = [path_of(h) for h, _ in self.held]
        for node in nodes:
            assert node.ref_count == sum(any(n is node for n in p) for p in paths)
        assert cache.size_info.protected_size == sum(n.length for n in nodes if n.ref_count)
        for handle, expected in self.held:
            assert slots_of(handle) == expected
        cache.check_integrity()


RADIX_SETTINGS = settings(max_examples=30, stateful_step_count=30, derandomize=True,
                          deadline=None, database=None, phases=PHASES)


def test_radix_salts_against_a_model() -> None:
    """30 examples of up to 30 steps, page sizes 1 and 2, derandomized."""
    run_state_machine_as_test(SaltMachine, settings=RADIX_SETTINGS)


class SaltBlindRadix(RadixPrefixCache):
    """A planted bug: the salt is dropped, all requests share one tree (the cache before salts)."""

    def match_prefix(self, input_ids: torch.Tensor, salt: str = "") -> BaseCacheHandle:
        return super().match_prefix(input_ids)

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor,
                      salt: str = "") -> InsertResult:
        return super().insert_prefix(input_ids, indices)


class BlindMatchRadix(RadixPrefixCache):
    """A planted bug: insertions keep their salts, but a match always looks in the default tree,
    so a salted request reads the unsalted tenant's K/V."""

    def match_prefix(self, input_ids: torch.Tensor, salt: str = "") -> BaseCacheHandle:
        handle = super().match_prefix(input_ids)
        assert isinstance(handle, RadixCacheHandle)
        return RadixCacheHandle(handle.cached_len, handle.node, salt=salt)


@pytest.mark.parametrize("planted", [SaltBlindRadix, BlindMatchRadix])
def test_planted_salt_leak_is_caught(planted: type[RadixPrefixCache]) -> None:
    """Either salt-blind cache must make the machine fail."""
    class Machine(SaltMachine):
        cache_cls = planted
    with pytest.raises(AssertionError):
        run_state_machine_as_test(Machine, settings=settings(
            RADIX_SETTINGS, phases=[Phase.explicit, Phase.generate]))


# --- the CacheManager: random use over several salts --------------------------------------------

class SaltedManagerMachine(ManagerMachine):
    """Chapter 9's machine with a random salt per request, often the same prompt under several
    salts in one batch. Each page remembers the salt of the request it was last allocated to: a
    page in salt s's tree, or in the cached part of a running request of salt s, must have been
    computed for salt s."""

    cache_types = ("radix",)
    stems = [[0, 1, 2, 3, 0, 1, 2, 3, 1, 1, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]]
    max_tail, max_out = 3, 6

    def __init__(self) -> None:
        super().__init__()
        self.computed_for: dict[int, str] = {}  # page -> salt of the request it was given to

    def _pending(self, prompt: list[int], params: SamplingParams,
                 data: st.DataObject) -> PendingReq:
        salt = data.draw(st.sampled_from(SALTS), label="salt")
        return PendingReq(self.uid, ids(*prompt), params, cache_salt=salt)

    def _matched(self, pending: PendingReq, handle: BaseCacheHandle) -> None:
        assert handle.salt == pending.cache_salt
        cached = slots_of(handle)[:: self.ps]
        assert all(self.computed_for[s // self.ps] == handle.salt for s in cached), "crossed salts"

    def _allocated(self, req: Req, start: int, end: int) -> None:
        row = self.page_table[req.table_idx, start:end: self.ps].tolist()
        self.computed_for.update((s // self.ps, req.cache_handle.salt) for s in row)

    @invariant()
    def salts_kept(self) -> None:
        """A tree holds only pages computed for its salt; so does a running request's prefix."""
        ps, cache = self.ps, self.mgr.prefix_cache
        assert isinstance(cache, RadixPrefixCache)
        for salt, root in cache.roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                pages = [s // ps for s in node.value.tolist()[::ps]]
                assert all(self.computed_for[p] == salt for p in pages), "a tree crossed salts"
        for req in self.running.values():
            handle = req.cache_handle
            row = self.page_table[req.table_idx, : handle.cached_len : ps].tolist()
            assert all(self.computed_for[s // ps] == handle.salt for s in row)


MANAGER_SETTINGS = settings(max_examples=25, stateful_step_count=30, derandomize=True,
                            deadline=None, database=None, phases=PHASES)


def test_cache_manager_with_salts_conserves_pages() -> None:
    """25 examples of up to 30 steps, page sizes 1 and 4, derandomized."""
    run_state_machine_as_test(SaltedManagerMachine, settings=MANAGER_SETTINGS)


# --- over HTTP: the salt travels from the request body to the radix tree ------------------------

def test_cache_salt_over_http(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """The cache-timing leak, closed: a prompt sent under another salt (or none) reuses nothing
    of it, while the same salt reuses all but the last token."""
    s = Server(model_dir("tiny-qwen3"), tmp_path)
    try:
        s.wait_ready()
        prompt = list(range(100, 140))

        def cached_after(**extra: str) -> int:
            before = s.stats()["cached_tokens"]
            status, raw = s.request("POST", "/v1/completions", {"prompt": prompt,
                                                                "max_tokens": 1, **extra})
            assert status == 200, raw
            return s.stats()["cached_tokens"] - before

        assert cached_after(cache_salt="tenant-a") == 0  # first time: nothing cached
        assert cached_after(cache_salt="tenant-a") == len(prompt) - 1
        assert cached_after(cache_salt="tenant-b") == 0  # the other tenant sees no hit
        assert cached_after() == 0  # nor does an unsalted request
        assert cached_after() == len(prompt) - 1  # unsalted ones share, as before
        status, raw = s.request("POST", "/v1/completions", {"prompt": prompt, "cache_salt": ""})
        assert status == 400 and json.loads(raw)["error"]["param"] == "cache_salt"
    finally:
        s.stop()
