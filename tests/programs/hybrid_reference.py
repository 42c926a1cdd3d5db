#!/usr/bin/python3
"""train-hybrid against PyTorch's own tutorial code ("Combining Distributed DataParallel with
Distributed RPC Framework"), on the same initial parameters and data (docs/rpc.md).

    hybrid_reference.py BIN_DIR PYTHON --trainers T [--steps 12] [--seed 0]

Writes init.pt (an EmbeddingBag(100, 16, mode sum) and a Linear(16, 8) from --seed) and data.pt
(every trainer's batches: 8 to 16 bags of 1 to 10 indices, targets 0..7), runs the tutorial's
HybridModel under PYTHON's torch.distributed.rpc (TensorPipe) and gloo with rank 0 as the
parameter server and ranks 1..T as trainers, a barrier among the trainers after every step (so
the run is deterministic), and train-hybrid under ddprun on the same files; every exported
parameter must agree to 1e-5. Exit 77 (skipped) where PYTHON's torch has no RPC.
"""

import argparse
import os
import subprocess
import sys
import tempfile

ROWS, DIM, CLASSES = 100, 16, 8


def make_files(torch, seed, trainers, steps, directory):
    torch.manual_seed(seed)
    bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum")
    fc = torch.nn.Linear(DIM, CLASSES)
    init = {"embedding.weight": bag.weight.detach().clone(), "fc.weight": fc.weight.detach().clone(),
            "fc.bias": fc.bias.detach().clone()}
    torch.save(init, os.path.join(directory, "init.pt"))
    g = torch.Generator().manual_seed(seed + 1)
    data = {}
    for t in range(trainers):
        for s in range(steps):
            bags = int(torch.randint(8, 17, (1,), generator=g))
            lengths = torch.randint(1, 11, (bags,), generator=g)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
            data[f"indices.{t}.{s}"] = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
            data[f"offsets.{t}.{s}"] = offsets
            data[f"target.{t}.{s}"] = torch.randint(0, CLASSES, (bags,), generator=g)
    torch.save(data, os.path.join(directory, "data.pt"))


# --- PyTorch's tutorial, as written there but for the file-given parameters and data ---

class InitialisedBag:
    """The tutorial's EmbeddingBag, made on the parameter server with init.pt's weights."""

    def __new__(cls, init_path):
        import torch
        bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum")
        with torch.no_grad():
            bag.weight.copy_(torch.load(init_path)["embedding.weight"])
        return bag


def run_trainer(remote_emb_module, rank, trainers, steps, directory):
    import torch
    import torch.distributed as dist
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
    from torch.nn.parallel import DistributedDataParallel as DDP

    class HybridModel(torch.nn.Module):
        def __init__(self, remote_emb_module):
            super().__init__()
            self.remote_emb_module = remote_emb_module
            fc = torch.nn.Linear(DIM, CLASSES)
            init = torch.load(os.path.join(directory, "init.pt"))
            with torch.no_grad():
                fc.weight.copy_(init["fc.weight"])
                fc.bias.copy_(init["fc.bias"])
            self.fc = DDP(fc)

        def forward(self, indices, offsets):
            emb_lookup = self.remote_emb_module.forward(indices, offsets)
            return self.fc(emb_lookup)

    model = HybridModel(remote_emb_module)
    model_parameter_rrefs = list(model.remote_emb_module.remote_parameters())
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(torch.optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    data = torch.load(os.path.join(directory, "data.pt"))
    t = rank - 1
    losses = []
    import time
    step_seconds = []  # each step's wall time, barrier to barrier (bench/compare/compare_hybrid.py)
    dist.barrier()
    last = time.perf_counter()
    for s in range(steps):
        with dist_autograd.context() as context_id:
            output = model(data[f"indices.{t}.{s}"], data[f"offsets.{t}.{s}"])
            loss = criterion(output, data[f"target.{t}.{s}"])
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(float(loss))
        dist.barrier()
        now = time.perf_counter()
        step_seconds.append(now - last)
        last = now
    return (losses, model.fc.module.weight.detach().clone(), model.fc.module.bias.detach().clone(),
            step_seconds)


def worker(rank, world, steps, directory, port):
    import torch
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    from torch.distributed.nn import RemoteModule

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    trainers = world - 1
    if rank > 0:
        dist.init_process_group("gloo", rank=rank - 1, world_size=trainers,
                                init_method=f"tcp://127.0.0.1:{port + 1}")
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rank=rank, world_size=world)
    if rank == 0:
        remote_emb_module = RemoteModule("ps/cpu", InitialisedBag,
                                         args=(os.path.join(directory, "init.pt"),))
        futures = [rpc.rpc_async(f"trainer{r}", run_trainer,
                                 args=(remote_emb_module, r, trainers, steps, directory))
                   for r in range(1, world)]
        results = [f.wait() for f in futures]
        weight = remote_emb_module.module_rref.local_value().weight.detach().clone()
        for losses, w, b, _ in results[1:]:
            assert torch.equal(w, results[0][1]) and torch.equal(b, results[0][2])
        with open(os.path.join(directory, "pytorch_step_seconds.txt"), "w") as f:
            f.write("".join(f"{x:.9f}\n" for x in results[0][3]))
        torch.save({"embedding.weight": weight, "fc.weight": results[0][1],
                    "fc.bias": results[0][2]}, os.path.join(directory, "pytorch.pt"))
    rpc.shutdown()


def free_port():
    """A port free now, below the kernel's ephemeral range where it can (the range outgoing
    connections take their local ports from)."""
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    for _ in range(100):
        port = random.randrange(10000, max(10001, ephemeral_low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("bin_dir")
    p.add_argument("python")
    p.add_argument("--trainers", type=int, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--in-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.in_child:  # under PYTHON: write the files and run the tutorial
        import torch
        import torch.multiprocessing as mp
        make_files(torch, args.seed, args.trainers, args.steps, args.dir)
        # Without --port: a port free now, and the tutorial again on another (twice at most) when
        # it was taken before PyTorch's store listened on it (EADDRINUSE: the store binds seconds
        # later, after `import torch` in every process, and meanwhile a port of the ephemeral
        # range can become the local end of another test's connection).
        for attempt in range(3):
            port = args.port or free_port()
            try:
                mp.spawn(worker, args=(args.trainers + 1, args.steps, args.dir, port),
                         nprocs=args.trainers + 1, join=True)
                return 0
            except Exception as e:  # mp.spawn raises ProcessRaisedException, naming the error
                if args.port or attempt == 2 or "EADDRINUSE" not in str(e):
                    raise
                print(f"port {port} was taken before PyTorch's store listened on it; again on "
                      "another", file=sys.stderr)
        return 1
    probe = subprocess.run([args.python, "-c",
                            "import torch.distributed.rpc as r, sys; "
                            "sys.exit(0 if r.is_available() else 1)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"SKIPPED: {args.python}'s torch has no torch.distributed.rpc")
        return 77
    with tempfile.TemporaryDirectory(prefix="hybrid_") as d:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run([args.python, os.path.abspath(__file__), args.bin_dir, args.python,
                               "--trainers", str(args.trainers), "--steps", str(args.steps),
                               "--seed", str(args.seed), "--in-child",
                               "--dir", d], capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            sys.exit(f"FAILED: PyTorch's tutorial code:\n{done.stdout}\n{done.stderr[-4000:]}")
        ddprun = os.path.join(os.path.abspath(args.bin_dir), "ddprun")
        job = os.path.join(os.path.abspath(args.bin_dir), "train-hybrid")
        ours = subprocess.run([ddprun, "--standalone", "--nproc-per-node", str(args.trainers + 1),
                               job, "--steps", str(args.steps), "--init-state-dict",
                               os.path.join(d, "init.pt"), "--data", os.path.join(d, "data.pt"),
                               "--export-state-dict", os.path.join(d, "ddp.pt")],
                              capture_output=True, text=True, timeout=600, env=env)
        if ours.returncode != 0:
            sys.exit(f"FAILED: train-hybrid:\n{ours.stdout}\n{ours.stderr[-4000:]}")
        compare = subprocess.run([args.python, "-c", f"""
import torch
a = torch.load({os.path.join(d, 'pytorch.pt')!r}); b = torch.load({os.path.join(d, 'ddp.pt')!r})
worst = 0.0
for k in a:
    worst = max(worst, float((a[k] - b[k]).abs().max()))
print(f"largest difference {{worst:.3g}} over {{sum(v.numel() for v in a.values())}} parameters")
raise SystemExit(0 if worst <= 1e-5 and set(a) == set(b) else 1)
"""], capture_output=True, text=True)
        print(ours.stdout.strip().splitlines()[-1] if ours.stdout.strip() else "")
        print(compare.stdout.strip())
        if compare.returncode != 0:
            sys.exit(f"FAILED: train-hybrid differs from PyTorch's tutorial:\n{compare.stderr}")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
