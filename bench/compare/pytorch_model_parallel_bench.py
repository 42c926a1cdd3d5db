#!/usr/bin/env python3
"""The PyTorch peer of `train-gpt --time` (examples/gpt): the same character-level GPT (sizes,
batch, AdamW) trained with PyTorch's own model parallelism on CPU (gloo), for
bench/compare/compare_model_parallel.py.

  scripts/pytorch-python -m torch.distributed.run --nproc-per-node 4 \
      bench/compare/pytorch_model_parallel_bench.py --dp 2 --tp 2 --steps 20

Tensor parallelism: torch.distributed.tensor.parallel.parallelize_module on a DeviceMesh
(ColwiseParallel q, k, v and MLP up-projection, RowwiseParallel attention and MLP down-projection,
a RowwiseParallel vocabulary-split embedding, a ColwiseParallel head whose sharded logits go
through loss_parallel's cross-entropy). Pipeline parallelism: torch.distributed.pipelining
(PipelineStage of each rank's layers, ScheduleGPipe or Schedule1F1B; with --schedule interleaved,
--virtual-stages stages per rank under ScheduleInterleaved1F1B). Data parallelism over the
"dp" dimension: gradients averaged once per step after backward / the schedule (one flat
allreduce), as train-gpt does; or, with --fsdp (train-gpt --fsdp's peer), FSDP2's fully_shard
over the "dp" dimension of each child (embeddings, every block, the head) and then of the whole
model, after the tensor-parallel plan (PyTorch's 2-D FSDP x TP). Prints rank 0's
`median_step_ms=<ms> samples_per_s=<n> peak_rss_mb=<the largest rank's peak resident memory>`.
"""
import argparse
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh


class Block(nn.Module):
    """minGPT's block with separate q, k, v projections (so that a column split keeps heads
    whole), `heads` the heads of this rank."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.fc_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln_1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)  # local heads after a column split
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class Embeddings(nn.Module):
    def __init__(self, vocab, hidden, block_size):
        super().__init__()
        self.token = nn.Embedding(vocab, hidden)
        self.position = nn.Parameter(torch.randn(block_size, hidden) * 0.02)

    def forward(self, ids):
        return self.token(ids) + self.position[: ids.shape[1]]


class Head(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


def average_over(group, params):
    grads = [p.grad for p in params if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or interleaved")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="stages per rank of the interleaved schedule")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=88)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true", help="fully_shard over dp (pp 1)")
    args = parser.parse_args()
    if args.tp > 1 and args.pp > 1:
        raise SystemExit("this peer runs tp x dp or pp x dp (not all three)")
    if args.fsdp and args.pp > 1:
        raise SystemExit("--fsdp runs with --pp 1")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(0)
    children = [Embeddings(args.vocab, args.hidden, args.block_size)]
    children += [Block(args.hidden, args.heads // args.tp) for _ in range(args.layers)]
    children.append(Head(args.vocab, args.hidden))

    loss_fn = lambda logits, target: F.cross_entropy(  # noqa: E731
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    if args.tp > 1:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       loss_parallel, parallelize_module)
        tp_mesh = mesh["tp"]
        parallelize_module(children[0], tp_mesh,
                           {"token": RowwiseParallel(input_layouts=Replicate())})
        for block in children[1:-1]:
            parallelize_module(block, tp_mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                                "v": ColwiseParallel(), "proj": RowwiseParallel(),
                                                "fc": ColwiseParallel(),
                                                "fc_proj": RowwiseParallel()})
        parallelize_module(children[-1], tp_mesh,
                           {"proj": ColwiseParallel(output_layouts=Shard(-1),
                                                    use_local_output=False)})
        plain_loss = loss_fn

        def loss_fn(logits, target):  # noqa: F811
            with loss_parallel():
                return plain_loss(logits, target)

    rows = args.batch_size // args.dp
    dp_group = mesh.get_group("dp")
    if args.pp > 1 and args.schedule == "interleaved":
        # train-gpt's chunks: the blocks split evenly over pp x v stages, the embeddings joining
        # the first and the head the last; rank r holds stages r, r + pp, ...
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
        chunks = args.pp * args.virtual_stages
        per = args.layers // chunks
        blocks = children[1:-1]
        parts = [blocks[c * per: (c + 1) * per] for c in range(chunks)]
        parts[0] = [children[0]] + parts[0]
        parts[-1] = parts[-1] + [children[-1]]
        rank_in_pp = mesh.get_local_rank("pp")
        stages, params = [], []
        for index in range(rank_in_pp, chunks, args.pp):
            module = nn.Sequential(*parts[index])
            stages.append(PipelineStage(module, index, chunks, torch.device("cpu"),
                                        group=mesh.get_group("pp")))
            params += list(module.parameters())
        schedule = ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=loss_fn)
        stage = type("Ends", (), {"is_first": rank_in_pp == 0,
                                  "is_last": rank_in_pp == args.pp - 1})()
    elif args.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        stage_index = mesh.get_local_rank("pp")
        per = math.ceil(len(children) / args.pp)
        mine = nn.Sequential(*children[stage_index * per: (stage_index + 1) * per])
        stage = PipelineStage(mine, stage_index, args.pp, torch.device("cpu"),
                              group=mesh.get_group("pp"))
        kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        schedule = kind(stage, args.microbatches, loss_fn=loss_fn)
        params = list(mine.parameters())
    else:
        model = nn.Sequential(*children)
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard
            for child in children:
                fully_shard(child, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-3)

    times = []
    for step in range(args.warmup + args.steps):
        generator = torch.Generator().manual_seed(1000 + step)
        windows = torch.randint(0, args.vocab, (args.batch_size, args.block_size + 1),
                                generator=generator)
        d = mesh.get_local_rank("dp")
        x = windows[d * rows: (d + 1) * rows, :-1].contiguous()
        y = windows[d * rows: (d + 1) * rows, 1:].contiguous()
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        if args.pp > 1:
            if stage.is_first:
                schedule.step(x)
            elif stage.is_last:
                schedule.step(target=y)
            else:
                schedule.step()
        else:
            loss = loss_fn(model(x), y)
            if args.tp > 1:
                with loss_parallel():
                    loss.backward()
            else:
                loss.backward()
        if not args.fsdp:  # FSDP reduce-scattered over dp in backward
            average_over(dp_group, params)
        optimizer.step()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the largest rank's, as train-gpt prints
    if dist.get_rank() == 0:
        print(f"median_step_ms={median * 1e3:.3f} samples_per_s={args.batch_size / median:.1f} "
              f"peak_rss_mb={peak.item():.1f}", flush=True)
    dist.barrier()
    # Leave without gloo's teardown: PyTorch 2.15's gloo now and then aborts a rank in or after
    # destroy_process_group ("terminate called without an active exception", SIGABRT), under
    # load, after every result was checked and printed; seen in CI's runs of this script's
    # caller. Every collective is done (the barrier above); stdout is flushed first.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
