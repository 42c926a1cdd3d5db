"""Runs a function in a world of real processes and reports each rank's failure.

    run_world(fn, world_size, backend="ddp", timeout=120, args=())

starts `world_size` processes (multiprocessing's spawn), each initialising torch.distributed with
`backend` over a FileStore in a fresh folder, calling fn(rank, world_size, *args) and destroying
the group. A rank that raises, exits non-zero or outlives `timeout` seconds (it is killed: a hang
is a failure, never a wait) makes run_world raise AssertionError naming the rank and its error.
Returns the ranks' return values in rank order.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import tempfile
import time
import traceback


def _rank_main(fn, rank, world_size, backend, init_file, args, results, pg_timeout):
    try:
        import torch.distributed as dist

        import torch_ddp  # noqa: F401  (registers "ddp" in this process too)

        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, "error", traceback.format_exc()))


def run_world(fn, world_size, backend="ddp", timeout=120.0, args=(), pg_timeout=60.0):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="torch_ddp_test_") as folder:
        init_file = os.path.join(folder, "store")
        # A failing world writes ddp's flight recorder dumps here, not into the source tree.
        os.environ["DDP_DUMP_DIR"] = folder
        processes = [
            context.Process(
                target=_rank_main,
                args=(fn, rank, world_size, backend, init_file, args, results, pg_timeout),
            )
            for rank in range(world_size)
        ]
        for p in processes:
            p.start()
        outcomes = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
                outcomes[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in processes) and results.empty():
                    break
        for p in processes:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if len(outcomes) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    failures = []
    for rank in range(world_size):
        if rank not in outcomes:
            code = processes[rank].exitcode
            failures.append(
                f"rank {rank}: no result within {timeout} s (exit code {code}; killed if None/-9)"
            )
        elif outcomes[rank][0] != "ok":
            failures.append(f"rank {rank} raised:\n{outcomes[rank][1]}")
    if failures:
        raise AssertionError(f"{backend} world of {world_size}:\n" + "\n".join(failures))
    return [outcomes[r][1] for r in range(world_size)]
