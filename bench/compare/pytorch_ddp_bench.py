#!/usr/bin/python3
"""PyTorch DDP step-time benchmark: the peer of ddp-train-bench.

Runs one rank of a data-parallel training step loop with PyTorch's own DistributedDataParallel on
the gloo backend, with the same models, batch and synthetic data as ddp-train-bench. Start it once
per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (bench/compare/compare_ddp.py does;
Debian's torchrun does not start under Python 3.11). Rank 0's last line is
`step_ms=<median> samples_per_s=<world*batch/median>`.

--comm-hook fp16|powersgd|batched-powersgd registers PyTorch's own hooks (fp16_compress_hook,
powerSGD_hook, batched_powerSGD_hook from torch.distributed.algorithms.ddp_comm_hooks) with
PowerSGDState(matrix_approximation_rank=--powersgd-rank, start_powerSGD_iter=
--powersgd-start-iter), as ddp-train-bench does for ddp's. Use PyTorch 2.x (scripts/pytorch-python)
for PowerSGD: Debian's 1.13 hook crashes on gloo (docs/ddp.md, comm hooks). 2.x's does too when
the model has more than one bucket (`enforce fail at gloo/transport/tcp/pair.cc:464
op.preamble.length <= op.nbytes`): the hook's second allreduce is issued from a future's callback
and races with the next bucket's allreduce, so the ranks pair different collectives. With one
bucket (--bucket-cap-mb larger than the model's gradients) it runs. --comm-hook noop registers
PyTorch's noop_hook (debugging_hooks): DDP's whole step with no communication at all, the ceiling
any backend can reach under PyTorch's DDP (its gradients are not averaged: a bound, not training).

--device cuda puts the model and the batch on cuda:(LOCAL_RANK % device count) and synchronises
the device before each step's clock is read; --backend gloo (the default; with CUDA tensors too:
gloo stages them through host memory, and two ranks may share one GPU) or nccl (one GPU per rank:
NCCL refuses two ranks on one GPU) or ddp (ddp's engine as a torch.distributed backend: torch_ddp,
docs/pytorch-backend.md; CPU tensors). --always-ddp wraps the model in DDP also with one process
(DDP's own cost). These are ddp-train-bench's options of the same names (docs/gpu.md).
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


def register_comm_hook(model, args):
    if args.comm_hook == "none":
        return
    if args.comm_hook == "noop":
        from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
        model.register_comm_hook(None, debugging_hooks.noop_hook)
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    if args.comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return
    state = powersgd.PowerSGDState(process_group=None,
                                   matrix_approximation_rank=args.powersgd_rank,
                                   start_powerSGD_iter=args.powersgd_start_iter)
    hook = powersgd.powerSGD_hook if args.comm_hook == "powersgd" else \
        powersgd.batched_powerSGD_hook
    model.register_comm_hook(state, hook)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="mlp", choices=["cnn", "mlp"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "ddp"])
    parser.add_argument("--always-ddp", action="store_true",
                        help="wrap the model in DDP also with one process")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default: PyTorch's, 25 with a 1 MiB first "
                             "bucket); a value also sets the first bucket's cap")
    parser.add_argument("--comm-hook", default="none",
                        choices=["none", "fp16", "powersgd", "batched-powersgd", "noop"])
    parser.add_argument("--powersgd-rank", type=int, default=1,
                        help="PowerSGDState's matrix_approximation_rank")
    parser.add_argument("--powersgd-start-iter", type=int, default=2,
                        help="PowerSGDState's start_powerSGD_iter (>= 2; keep it <= --warmup)")
    args = parser.parse_args()
    if args.powersgd_rank < 1:
        parser.error(f"--powersgd-rank must be at least 1, got {args.powersgd_rank}")
    if args.powersgd_start_iter < 2:
        parser.error(f"--powersgd-start-iter must be at least 2, got {args.powersgd_start_iter}")

    torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1 or args.always_ddp
    if args.backend == "ddp" and args.device != "cpu":
        parser.error("--backend ddp takes CPU tensors: use --device cpu")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"pytorch_ddp_bench: --device cuda, but torch {torch.__version__} "
                             "sees no CUDA device (torch.cuda.is_available() is False)")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if distributed and "MASTER_ADDR" not in os.environ:
        # --always-ddp with one process started without a launcher: a store of its own.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.manual_seed(1234)
    model = make_model(args.model).to(device)
    if distributed:
        if args.backend == "ddp":
            import torch_ddp  # noqa: F401  (registers the backend "ddp")
        dist.init_process_group(args.backend, rank=rank, world_size=world)
        # bucket_cap_mb only when asked for: PyTorch 1.13's DDP rejects None (2.x reads it as
        # "the default"), and this script runs on both.
        caps = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
        ids = {"device_ids": [device.index]} if device.type == "cuda" else {}
        model = nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=args.gradient_as_bucket_view, **ids, **caps)
        register_comm_hook(model, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(100 + rank)
    x = torch.randn(args.batch_size, 1, 28, 28).to(device)
    y = torch.randint(0, 10, (args.batch_size,)).to(device)
    sync()

    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sync()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
    if distributed:
        # Every rank's median, so the slowest rank decides (as in ddp-train-bench).
        # nccl reduces device tensors only; gloo takes either.
        median = torch.tensor([statistics.median(times)],
                              device=device if args.backend == "nccl" else "cpu")
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        step_s = median.item()
        dist.barrier()
        dist.destroy_process_group()
    else:
        step_s = statistics.median(times)
    if rank == 0:
        print(f"model={args.model} world_size={world} batch_size={args.batch_size} "
              f"device={args.device} backend={args.backend if distributed else 'none'} "
              f"ddp={'on' if distributed else 'off'} torch={torch.__version__}")
        print(f"step_ms={step_s * 1e3:.3f} samples_per_s={world * args.batch_size / step_s:.1f}")


if __name__ == "__main__":
    main()
