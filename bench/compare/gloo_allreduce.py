#!/usr/bin/python3
"""torch.distributed's gloo allreduce (float32, sum), timed exactly as ddp-bench times ddp's.

--backend ddp times the same calls on ddp's engine registered as a torch.distributed backend
(torch_ddp, PyTorch 2.x: scripts/pytorch-python with torch_ddp installed or on PYTHONPATH);
bench/compare/torch_ddp_compare.py runs the two side by side.

One process per rank; the caller starts them with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
in the environment (bench/compare/compare_allreduce.py does; torchrun is not used because Debian's
python3-torch 1.13 torchrun fails under Python 3.11 before starting any worker). Run it with the
system interpreter, which sees Debian's python3-torch:

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 /usr/bin/python3 gloo_allreduce.py &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 /usr/bin/python3 gloo_allreduce.py

Timing: every iteration starts with dist.barrier() (not timed); each rank times its own
dist.all_reduce; afterwards the per-iteration times are reduced with MAX over ranks and rank 0
prints the median, one JSON object per size with ddp-bench's --json fields. gloo's allreduce works
in place, so the input is copied back into the buffer before every iteration (outside the timed
region). Buffers are allocated once, for the largest size. One thread per rank
(torch.set_num_threads(1); set OMP_NUM_THREADS=1 too). The result of the last iteration of every
size is checked ("wrong"). Exit codes: 0 success, 2 bad arguments.
"""

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time


def parse_size(text):
    match = re.fullmatch(r"(\d+)([kmg]?)(i?b)?", text.strip().lower())
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a byte size (e.g. 8, 64K, 1M)")
    return int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2)]


def parse_sizes(text):
    return [parse_size(word) for word in text.split(",")]


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def non_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1K,64K,1M,16M,64M"))
    parser.add_argument("--iters", type=positive, default=20)
    parser.add_argument("--warmup", type=non_negative, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per collective")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "ddp"],
                        help="torch.distributed backend: gloo, or ddp (needs torch_ddp, "
                             "docs/pytorch-backend.md; PyTorch 2.x)")
    args = parser.parse_args()  # exits 2 on bad arguments

    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [name for name in names if name not in os.environ]
    if missing:
        print(f"gloo_allreduce: error: set {', '.join(missing)} in the environment",
              file=sys.stderr)
        return 2

    import torch
    import torch.distributed as dist

    if args.backend == "ddp":
        import torch_ddp  # noqa: F401  (registers the backend "ddp")

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.timeout))

    max_count = max(max(1, size // 4) for size in args.sizes)
    # Same input as ddp-bench and mpi_allreduce: small whole numbers, so sums are exact. Element
    # i depends on i % 8 only, so both tensors are an 8-element pattern repeated: three float32
    # buffers per rank in all (built from int64 indices, a 256 MiB run needed 5.7 GB per rank).
    def pattern(r):
        return torch.tensor([float((j * 5 + r * 3) % 8) for j in range(8)], dtype=torch.float32)

    repeats = (max_count + 7) // 8
    source = pattern(rank).repeat(repeats)[:max_count].contiguous()
    buffer = torch.empty(max_count, dtype=torch.float32)
    buffer.copy_(source)
    expected_all = sum(pattern(r) for r in range(world_size)).repeat(repeats)[:max_count]

    for size in args.sizes:
        count = max(1, size // 4)
        view, src = buffer[:count], source[:count]
        times = torch.zeros(args.iters, dtype=torch.float64)
        for it in range(args.warmup + args.iters):
            view.copy_(src)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(view, op=dist.ReduceOp.SUM)
            stop = time.perf_counter()
            if it >= args.warmup:
                times[it - args.warmup] = (stop - start) * 1e6
        wrong = torch.tensor([int((view != expected_all[:count]).sum())], dtype=torch.int64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(wrong, op=dist.ReduceOp.SUM)
        if rank == 0:
            median = statistics.median(times.tolist())
            nbytes = count * 4
            algbw = nbytes / (median * 1e-6) / 1e9
            print(json.dumps({
                "op": "allreduce", "bytes": nbytes, "count": count, "dtype": "float32",
                "reduce_op": "sum", "time_us": median, "time_min_us": float(times.min()),
                "time_max_us": float(times.max()), "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (world_size - 1) / world_size,
                "wrong": int(wrong.item()), "iters": args.iters, "warmup": args.warmup,
                "world_size": world_size, "backend": args.backend,
                "torch": torch.__version__}), flush=True)
    dist.barrier()
    if args.backend != "gloo":
        dist.destroy_process_group()
        return 0
    # Leave without gloo's teardown: PyTorch 2.15's gloo now and then aborts a rank in or after
    # destroy_process_group ("terminate called without an active exception", SIGABRT), under
    # load, after every result was checked and printed. Every collective is done (the barrier
    # above); stdout is flushed first.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
