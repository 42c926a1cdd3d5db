#!/usr/bin/python3
"""PyTorch DDP step-time benchmark: the peer of ddp-train-bench.

Runs one rank of a data-parallel training step loop with PyTorch's own DistributedDataParallel on
the gloo backend, with the same models, batch and synthetic data as ddp-train-bench. Start it once
per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (bench/compare_ddp.sh does;
Debian's torchrun does not start under Python 3.11). Rank 0's last line is
`step_ms=<median> samples_per_s=<world*batch/median>`.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def make_model(name):
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 4096), nn.ReLU(),
                             nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Linear(128, 10))
    raise SystemExit(f"unknown model {name!r}: use cnn or mlp")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="mlp", choices=["cnn", "mlp"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    torch.manual_seed(1234)
    model = make_model(args.model)
    if distributed:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=args.gradient_as_bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(100 + rank)
    x = torch.randn(args.batch_size, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch_size,))

    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
    if distributed:
        # Every rank's median, so the slowest rank decides (as in ddp-train-bench).
        median = torch.tensor([statistics.median(times)])
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        step_s = median.item()
        dist.barrier()
        dist.destroy_process_group()
    else:
        step_s = statistics.median(times)
    if rank == 0:
        print(f"step_ms={step_s * 1e3:.3f} samples_per_s={world * args.batch_size / step_s:.1f}")


if __name__ == "__main__":
    main()
