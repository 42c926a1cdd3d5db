"""Runs a PyTorch reference script's ranks as spawned processes and prints rank 0's result.

    from reference_ranks import run_ranks_and_print
    run_ranks_and_print(run, world, (world, steps, port))  # calls run(rank, *args, queue)

`target(rank, *args, queue)` runs one rank; rank 0 puts its result text on the queue. Exits
non-zero (naming the exit code) when a rank fails; every wait has a 120 s deadline.
"""

import sys

import torch.multiprocessing as mp


def run_ranks_and_print(target, world, args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            sys.exit(f"rank process exited with {p.exitcode}")
    print(result)
