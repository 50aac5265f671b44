"""第 9 章示例：页大小 4 时，基数树怎样匹配、分裂、插入和按 LRU 淘汰。

    python examples/ch09_radix_walkthrough.py

不加载模型，只用调度器的 CacheManager（空闲列表 + RadixPrefixCache）和一张 page table，
照 PrefillAdder 和 Scheduler 的顺序走一遍：匹配、加锁、分页、prefill 之后 cache_req、
采样出一个 token 后结束。池子只有 8 页：第四个请求 D 到来时空闲页不够，淘汰最久未用的
叶子；D 还在运行时，第五个请求 E 又要页，D 锁着的节点不能动，只能淘汰剩下的。
页用它的第一个槽位命名（页 8 就是槽位 8..11），与 CacheManager.free_slots 相同。
"""

import torch

from minisgl.core import Req, SamplingParams
from minisgl.kvcache.radix_cache import RadixNode
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.utils import PendingReq

PAGE = 4


def pages(tokens: list[int]) -> str:
    """Tokens in groups of one page: [1 2 3 4 | 5 6 7 8]."""
    groups = [tokens[i : i + PAGE] for i in range(0, len(tokens), PAGE)]
    return "[" + " | ".join(" ".join(str(t) for t in g) for g in groups) + "]"


def show_tree(mgr: CacheManager) -> None:
    def walk(node: RadixNode, depth: int) -> None:
        for child in sorted(node.children.values(), key=lambda n: n.key.tolist()):
            slots = child.value.tolist()
            print(f"{'  ' * depth}  tree {pages(child.key.tolist())}  pages {slots[::PAGE]}  "
                  f"ref {child.ref_count}  last_access {child.last_access}")
            walk(child, depth + 1)

    walk(mgr.prefix_cache.root, 0)
    info = mgr.prefix_cache.size_info
    print(f"  cache: {info.evictable_size} tokens evictable, {info.protected_size} locked")


def admit(mgr: CacheManager, name: str, uid: int, prompt: list[int], row: int) -> Req:
    """Match, lock, copy the matched slots into the row, allocate the rest, 'prefill'."""
    pending = PendingReq(uid, torch.tensor(prompt, dtype=torch.int32),
                         SamplingParams(max_tokens=1, ignore_eos=True))
    handle = mgr.match_req(pending)
    mgr.lock(handle)
    mgr.page_table[row, : handle.cached_len] = handle.get_matched_indices()
    req = Req(pending.input_ids, row, handle.cached_len, 1, uid, pending.sampling_params,
              handle)
    print(f"{name}: prompt {pages(prompt)} ({len(prompt)} tokens)")
    print(f"  match the first {len(prompt) - 1} tokens: {handle.cached_len} cached, "
          f"compute {req.extend_len}")
    free_before = mgr.free_slots.tolist()
    mgr.allocate_paged([req])
    row_pages = mgr.page_table[row, : req.device_len].tolist()[::PAGE]
    print(f"  free pages {free_before} -> row pages {row_pages}")
    req.complete_one()  # the prefill ran
    mgr.cache_req(req, finished=False)  # the scheduler inserts the prompt right away
    return req


def finish(mgr: CacheManager, name: str, req: Req) -> None:
    req.append_host(torch.tensor(0))  # the one sampled token; it never ran through the model
    mgr.cache_req(req, finished=True)
    print(f"{name} finishes; free pages {mgr.free_slots.tolist()}")


def main() -> None:
    mgr = CacheManager(8, PAGE, torch.zeros((2, 32), dtype=torch.int32))
    print(f"page size {PAGE}, 8 pages; free pages {mgr.free_slots.tolist()}")
    system = [1, 2, 3, 4, 5, 6, 7, 8]  # two pages every request starts with

    a = admit(mgr, "A", 0, system + [11, 12, 13, 14, 15], row=0)
    finish(mgr, "A", a)
    show_tree(mgr)

    b = admit(mgr, "B", 1, system + [21, 22, 23, 24, 25, 26], row=0)
    finish(mgr, "B", b)
    show_tree(mgr)

    c = admit(mgr, "C", 2, system + [11, 12, 13, 14, 31, 32], row=0)
    finish(mgr, "C", c)
    show_tree(mgr)

    d = admit(mgr, "D", 3, list(range(40, 58)), row=1)  # 18 tokens: 5 pages, 4 free
    show_tree(mgr)
    e = admit(mgr, "E", 4, list(range(60, 70)), row=0)  # 10 tokens: 3 pages, none free
    show_tree(mgr)
    finish(mgr, "D", d)
    finish(mgr, "E", e)
    mgr.check_integrity()


if __name__ == "__main__":
    main()
