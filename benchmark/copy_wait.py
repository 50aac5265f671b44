"""Does a prompt's copy to the GPU make the host wait for the GPU? (chapter 21)

The scheduler copies each new prompt's token ids into the device's token pool while the batch
before it still runs on the GPU, on its own stream that was told to wait for the engine's
(`stream.wait_stream`). This keeps the engine's stream busy for ~50 ms with torch.cuda._sleep,
then times on the host the same copy from pageable memory and from pinned memory. Needs a GPU.

    python benchmark/copy_wait.py
"""

from __future__ import annotations

import statistics
import time

import torch


def host_ms(copy, busy: torch.cuda.Stream, own: torch.cuda.Stream) -> float:
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(100_000_000)  # the batch in flight
    own.wait_stream(busy)
    with torch.cuda.stream(own):
        t = time.perf_counter()
        copy()
        elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e3 * elapsed


def main() -> None:
    device = torch.device("cuda")
    pool = torch.zeros(4, 100_000, dtype=torch.int32, device=device)
    ids = torch.arange(700, dtype=torch.int32)  # a prompt, as the scheduler receives it
    busy, own = torch.cuda.Stream(), torch.cuda.Stream()
    cases = {
        "pageable: ids.to(device, non_blocking=True)":
            lambda: pool[1, :700].copy_(ids.to(device, non_blocking=True)),
        "pinned: ids.pin_memory().to(device, non_blocking=True)":
            lambda: pool[1, :700].copy_(ids.pin_memory().to(device, non_blocking=True)),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; the GPU is busy ~50 ms")
    for name, copy in cases.items():
        runs = [host_ms(copy, busy, own) for _ in range(7)]
        print(f"  {name:56} host {statistics.median(runs):7.3f} ms "
              f"(min {min(runs):.3f}, max {max(runs):.3f})")


if __name__ == "__main__":
    main()
