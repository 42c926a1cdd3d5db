#!/usr/bin/env python3
"""What one rank of a PyTorch gloo job costs at start-up: mesh-scale-probe's peer
(bench/probes/scale.py --peer gloo2 runs it under PyTorch 2.x's launcher at growing worlds).

One process per rank, started by torch.distributed.run (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment):

  scripts/pytorch-python -m torch.distributed.run --standalone --nproc-per-node 4 \\
      bench/probes/gloo_scale_probe.py --alltoall

Joins the job (init_process_group("gloo")), runs one allreduce (its end, time.time(), is this
rank's start-up), then measures this process (descriptors open, of them sockets, resident and
private memory) and reduces the numbers over the ranks (allreduces of float64 tensors). Then it
checks allreduces of several sizes (--sizes) and, with --alltoall, an all_to_all_single, and
counts the descriptors again. Rank 0 prints one JSON line with mesh-scale-probe's keys (plus
private_kib_mean, private_kib_max). One torch thread per rank. Exit 0 when every element is
right, 1 otherwise.
"""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def count_fds():
    """Open descriptors of this process, and how many of them are sockets."""
    fds = sockets = 0
    for name in os.listdir("/proc/self/fd"):  # listdir's own, closed by now, fails readlink
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return fds, sockets


def memory_kib():
    """VmRSS, and private memory (Private_Clean + Private_Dirty of smaps_rollup), in KiB."""
    rss = private = 0.0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = float(line.split()[1])
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    private += float(line.split()[1])
    except OSError:
        private = -1
    return rss, private


def reduce(values):
    """Sum and max of values over the ranks."""
    total = torch.tensor(values, dtype=torch.float64)
    top = total.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return total.tolist(), top.tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,1000,100000",
                        help="float32 counts of the allreduces checked after the measurement")
    parser.add_argument("--alltoall", action="store_true",
                        help="also run an all_to_all_single and count sockets after it")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per collective")
    args = parser.parse_args()
    torch.set_num_threads(1)

    # After import torch. init_s: from the last rank's call of init_process_group to the first
    # allreduce done on every rank (the rendezvous, gloo's full mesh and one call; not the import).
    joining = time.time()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    one = torch.ones(1)
    dist.all_reduce(one)
    done = time.time()
    if one.item() != world:
        raise RuntimeError(f"first allreduce is wrong: {one.item()} != {world}")
    fds, sockets = count_fds()
    rss, private = memory_kib()
    s_sum, s_max = reduce([done, fds, sockets, rss, private, joining])

    # Correctness of allreduces of several sizes: rank % 7 + i % 5 on every rank, summed.
    wrong = 0
    ranks = sum(r % 7 for r in range(world))
    for count in (int(word) for word in args.sizes.split(",")):
        pattern = (torch.arange(count) % 5).to(torch.float32)
        data = pattern + rank % 7
        dist.all_reduce(data)
        wrong += int((data != ranks + world * pattern).sum())
    fds_a2a = sockets_a2a = -1
    if args.alltoall:
        send = torch.arange(world, dtype=torch.int32) + rank * 1000
        recv = torch.full((world,), -1, dtype=torch.int32)
        dist.all_to_all_single(recv, send)
        wrong += int((recv != torch.arange(world, dtype=torch.int32) * 1000 + rank).sum())
        fds_a2a, sockets_a2a = count_fds()
    a_sum, a_max = reduce([wrong, fds_a2a, sockets_a2a])

    if rank == 0:
        print(json.dumps({
            "world": world, "first_collective_done": s_max[0],
            "fds_mean": s_sum[1] / world, "fds_max": s_max[1],
            "sockets_mean": s_sum[2] / world, "sockets_max": s_max[2],
            "rss_kib_mean": s_sum[3] / world, "rss_kib_max": s_max[3],
            "private_kib_mean": s_sum[4] / world, "private_kib_max": s_max[4],
            "init_s": s_max[0] - s_max[5],
            "wrong": a_sum[0], "fds_after_alltoall_max": a_max[1],
            "sockets_after_alltoall_max": a_max[2]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if a_sum[0] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
