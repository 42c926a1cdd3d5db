"""PyTorch's own DDP + ZeroRedundancyOptimizer on gloo, for zero_redundancy_optimizer_test.cc to
compare ddp::ZeroRedundancyOptimizer against.

Usage: pytorch_zero_reference.py WORLD STEPS OPTIMIZERS PORT
OPTIMIZERS is a comma-separated list of sgd, adam, adamw; for each, from the same start, each of
WORLD ranks trains STEPS steps on its slice of a global batch of 12 samples, with DDP and
torch.distributed.optim.ZeroRedundancyOptimizer. Model parameters, data and targets come from
formulas that zero_redundancy_optimizer_test.cc evaluates the same way. Prints rank 0's final
parameters, one line per optimizer and parameter: "optimizer name v0 v1 ..." with repr-exact
floats.
"""
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

# The helper shared by the reference scripts lives with the tests' support code.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "support", "torch"))
from reference_ranks import run_ranks_and_print  # noqa: E402

IN, GLOBAL_BATCH = 6, 12


def make_model():
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4), torch.nn.Tanh(),
        torch.nn.Linear(4, 2),
    )
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            values = [0.3 * math.sin(0.37 * (j + 1) + k) for j in range(p.numel())]
            p.copy_(torch.tensor(values, dtype=torch.float64).view_as(p).float())
    return model


def batch(rank, world, step):
    x = [
        math.sin(0.011 * (step * 100 + s * IN + f) + 0.5 * f)
        for s in range(GLOBAL_BATCH)
        for f in range(IN)
    ]
    y = [math.cos(0.017 * (step * 100 + s * 2 + o)) for s in range(GLOBAL_BATCH) for o in range(2)]
    xs = torch.tensor(x, dtype=torch.float64).view(GLOBAL_BATCH, IN).float()
    ys = torch.tensor(y, dtype=torch.float64).view(GLOBAL_BATCH, 2).float()
    per = GLOBAL_BATCH // world
    return xs[rank * per:(rank + 1) * per], ys[rank * per:(rank + 1) * per]


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05)),
}


def run(rank, world, steps, optimizers, port, queue):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lines = []
    for optimizer in optimizers:
        model = DDP(make_model())
        optimizer_class, defaults = OPTIMIZERS[optimizer]
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=optimizer_class, **defaults
        )
        for step in range(steps):
            x, y = batch(rank, world, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        for name, p in model.module.named_parameters():
            values = " ".join(repr(v) for v in p.detach().flatten().tolist())
            lines.append(f"{optimizer} {name} {values}")
    # Every rank's broadcasts of the last step are done before rank 0 reports.
    dist.barrier()
    if rank == 0:
        queue.put("\n".join(lines))
        queue.close()
        queue.join_thread()  # the result is in the pipe before this process leaves
    # Leave without gloo's teardown: under load, 1.13's destroy_process_group / interpreter exit
    # has hung after the result was delivered (see pytorch_join_reference.py).
    os._exit(0)


def main():
    world, steps = int(sys.argv[1]), int(sys.argv[2])
    optimizers, port = sys.argv[3].split(","), int(sys.argv[4])
    run_ranks_and_print(run, world, (world, steps, optimizers, port))


if __name__ == "__main__":
    main()
