"""One rank of torch.distributed's gloo allreduce in a process of its own, for `switchsim bench topo`
(the ring baseline over the same namespaces and links as INA):

    GLOO_SOCKET_IFNAME=IF python topologies/gloo_worker.py MASTER:PORT RANK WORLD SIZE OUT.json

a warm-up allreduce (connections), then one timed allreduce of SIZE float32; OUT.json gets its seconds and
whether every element equals the exact sum (the inputs are small integers, so float32 sums are exact).
"""
import json
import sys
import time

import torch
import torch.distributed as dist


def main(argv):
    master, rank, world, size, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world)
    dist.all_reduce(torch.ones(1024))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-1000, 1000, (size,), generator=g).float()
    expect = sum(torch.randint(-1000, 1000, (size,), generator=torch.Generator().manual_seed(r)).double()
                 for r in range(world))
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    seconds = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "wrong": int((x.double() != expect).sum())}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
