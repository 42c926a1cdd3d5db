#!/usr/bin/python3
"""PyTorch's RPC round trips (TensorPipe), timed as bench/micro/rpc_latency.cc times ddp's.

    pytorch_rpc_bench.py [--calls N] [--echo-calls M] [--echo-bytes B] [--warmup W] [--port P]

Starts two processes (worker 0 "caller", worker 1 "callee") with torch.distributed.rpc's
default agent on this host; the caller times N rpc_sync calls of a function that takes and
returns nothing, then M of one that returns its argument (a float32 tensor of B bytes), each call
alone, and prints the same lines as rpc-latency:
  rpc-latency empty_us median=.. p10=.. p90=.. calls=N
  rpc-latency echo_us bytes=B median=.. p10=.. p90=.. calls=M
Run it with the Python of the PyTorch to measure (scripts/pytorch-python for PyTorch 2.x).
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


def noop():
    return None


def echo(t):
    return t


def summarise(micros):
    micros = sorted(micros)
    at = lambda q: micros[int(q * (len(micros) - 1))]
    return at(0.5), at(0.1), at(0.9)


def time_calls(warmup, calls, call):
    for _ in range(warmup):
        call()
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1e6)
    return out


def worker(rank, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    rpc.init_rpc("caller" if rank == 0 else "callee", rank=rank, world_size=2,
                 rpc_backend_options=options)
    if rank == 0:
        m, p10, p90 = summarise(time_calls(args.warmup, args.calls,
                                           lambda: rpc.rpc_sync("callee", noop)))
        print(f"rpc-latency empty_us median={m:.1f} p10={p10:.1f} p90={p90:.1f} "
              f"calls={args.calls}", flush=True)
        tensor = torch.rand(args.echo_bytes // 4)
        m, p10, p90 = summarise(time_calls(min(args.warmup, 20), args.echo_calls,
                                           lambda: rpc.rpc_sync("callee", echo, args=(tensor,))))
        print(f"rpc-latency echo_us bytes={args.echo_bytes} median={m:.1f} p10={p10:.1f} "
              f"p90={p90:.1f} calls={args.echo_calls}", flush=True)
    rpc.shutdown()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--echo-calls", type=int, default=200)
    p.add_argument("--echo-bytes", type=int, default=1 << 20)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--port", type=int, default=29611)
    args = p.parse_args()
    mp.spawn(worker, args=(args,), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
