"""A plain torchrun script that knows nothing of ddp-service: init, all_reduce, check, exit.

Run it under any rendezvous, e.g.
    torchrun --rdzv-backend=etcd3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=smoke \
        --nnodes=2 --nproc-per-node=1 tests/scripts/allreduce_smoke.py
"""

import sys

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    ok = value.item() == expected
    print(f"allreduce rank={rank} world={world} sum={value.item():g} expected={expected:g} ok={ok}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
