"""Chapter 16 on one GPU: a tensor-parallel group of one over NCCL (the GPU collectives) with its
gloo half (the host's), the communicator's calls through both, and the offline LLM joining that
group: the same tokens as HF (float32, on the CPU: tests/reference.py). Two ranks need two GPUs
(NCCL refuses two ranks on one device): that run is tools/gpu_tp.py's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from gpu_common import MODELS, PROMPTS

from minisgl.core import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA (none on this machine)")]


@pytest.fixture
def group_of_one(tmp_path: Path) -> Iterator[str]:
    """A group of one rank on cuda:0 joined through a file rendezvous, which it yields; left
    after the test (an LLM's shutdown leaves it too)."""
    from minisgl.distributed import DistributedInfo, comm, init_distributed

    rendezvous = f"file://{tmp_path}/rendezvous"
    init_distributed(DistributedInfo(0, 1), torch.device("cuda", 0), rendezvous)
    yield rendezvous
    comm.destroy_distributed()


def test_collectives_in_a_group_of_one(group_of_one: str) -> None:
    import torch.distributed as dist

    from minisgl.distributed import all_gather, all_reduce, broadcast, comm

    assert dist.get_backend() == "nccl", dist.get_backend()
    assert dist.get_backend(comm._HOST_GROUP) == "gloo", dist.get_backend(comm._HOST_GROUP)
    x = torch.arange(6, dtype=torch.bfloat16, device="cuda").view(2, 3)
    assert torch.equal(all_reduce(x.clone()), x)
    assert all_gather(x).shape == (1, 2, 3)
    assert torch.equal(broadcast(x.clone()), x)
    host = torch.tensor([5, -5])
    assert all_reduce(host, dist.ReduceOp.MIN).tolist() == [5, -5]


@pytest.mark.parametrize("name", MODELS)
def test_llm_in_the_nccl_group_equals_hf(name: str, group_of_one: str,
                                         tiny: Callable[[str], Path]) -> None:
    """The LLM (float32, the default backend) joins the group; 12 greedy tokens per prompt."""
    from minisgl.distributed import DistributedInfo
    from minisgl.llm import LLM

    from reference import hf_greedy

    path = tiny(name)
    llm = LLM(str(path), dtype=torch.float32, num_page_override=512,
              tp_info=DistributedInfo(0, 1), dist_init=group_of_one)
    try:
        out = [o["token_ids"] for o in llm.generate(
            PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    finally:
        llm.shutdown()  # leaves the group
    refs = [hf_greedy(path, p, 12)[0] for p in PROMPTS]
    differ = [f"prompt {i}: ours {o}, HF {r}" for i, (o, r) in enumerate(zip(out, refs))
              if o != r]
    assert not differ, (f"{len(PROMPTS) - len(differ)}/{len(PROMPTS)} equal HF:\n"
                        + "\n".join(differ))
