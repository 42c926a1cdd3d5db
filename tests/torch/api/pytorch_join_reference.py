"""PyTorch's own DDP + Join on gloo, for join_test.cc to compare ddp against.

Usage: pytorch_join_reference.py WORLD BASE_STEPS DIVIDE(0|1) PORT
Rank r trains BASE_STEPS + r steps (uneven inputs) inside
torch.distributed.algorithms.join.Join with divide_by_initial_world_size=DIVIDE. Parameters,
data and targets come from formulas that join_test.cc evaluates the same way. Prints rank 0's
final parameters, one line per parameter: "name v0 v1 ..." with repr-exact floats.
"""
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

# The helper shared by the reference scripts lives with the tests' support code.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "support", "torch"))
from reference_ranks import run_ranks_and_print  # noqa: E402

IN, HIDDEN, OUT, BATCH = 6, 8, 3, 5


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            n = p.numel()
            values = [0.3 * math.sin(0.37 * (j + 1) + k) for j in range(n)]
            p.copy_(torch.tensor(values, dtype=torch.float64).view_as(p).float())
    return model


def batch(rank, step):
    x = [
        math.sin(0.011 * (rank * 1000 + step * 50 + s * IN + f) + 0.5 * f)
        for s in range(BATCH)
        for f in range(IN)
    ]
    y = [
        math.cos(0.017 * (rank * 1000 + step * 50 + s * OUT + o))
        for s in range(BATCH)
        for o in range(OUT)
    ]
    return (
        torch.tensor(x, dtype=torch.float64).view(BATCH, IN).float(),
        torch.tensor(y, dtype=torch.float64).view(BATCH, OUT).float(),
    )


def run(rank, world, base_steps, divide, port, queue):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Join([model], divide_by_initial_world_size=divide):
        for step in range(base_steps + rank):
            x, y = batch(rank, step)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    if rank == 0:
        lines = []
        for name, p in model.module.named_parameters():
            values = " ".join(repr(v) for v in p.detach().flatten().tolist())
            lines.append(f"{name} {values}")
        queue.put("\n".join(lines))
        queue.close()
        queue.join_thread()  # the result is in the pipe before this process leaves
    # Every collective of the run is done once Join's context has exited on all ranks. Leave
    # without gloo's teardown: under load, 1.13's destroy_process_group / interpreter exit has
    # hung past the 120 s join below (seen in CI), after the result had been delivered.
    os._exit(0)


def main():
    world, base_steps, divide, port = (int(a) for a in sys.argv[1:5])
    run_ranks_and_print(run, world, (world, base_steps, bool(divide), port))


if __name__ == "__main__":
    main()
