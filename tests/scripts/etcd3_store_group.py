"""One rank of a gloo world whose store is the etcd3 store, for tests/rendezvous/test_store.py.

Usage: etcd3_store_group.py ENDPOINT RUN_ID RANK WORLD_SIZE
Checks init_process_group over the store, dist.new_group, and a gloo group
built on a PrefixStore over a clone of the store; prints one result line.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from service.rendezvous.options import parse_options
from service.rendezvous.parts import Etcd3Parts


def main() -> int:
    endpoint, run_id, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    parts = Etcd3Parts(parse_options(endpoint, run_id, {}))
    parts.connect()
    store = dist.PrefixStore("pg", parts.store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)

    sub = dist.new_group(list(range(world)))
    in_sub = torch.tensor([10.0])
    dist.all_reduce(in_sub, group=sub)

    clone = dist.PrefixStore("cloned", parts.store.clone())
    cloned_pg = dist.ProcessGroupGloo(clone, rank, world, timedelta(seconds=60))
    in_clone = torch.tensor([100.0])
    cloned_pg.allreduce([in_clone]).wait()
    clone.set(f"seen-{rank}", str(rank))
    clone.wait([f"seen-{r}" for r in range(world)], timedelta(seconds=30))
    # The clone writes the same keys as the original: the original reads what the clone wrote.
    through_original = dist.PrefixStore("cloned", parts.store).get(f"seen-{(rank + 1) % world}").decode()

    dist.barrier()
    dist.destroy_process_group()
    print(
        f"etcd3-group rank={rank} world={value.item():g} sub={in_sub.item():g} clone={in_clone.item():g} "
        f"peer={through_original}",
        flush=True,
    )
    parts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
