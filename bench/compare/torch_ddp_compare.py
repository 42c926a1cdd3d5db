#!/usr/bin/python3
"""torch.distributed on ddp's engine (torch_ddp) against gloo, side by side in one run.

Under PyTorch 2.x (scripts/pytorch-python runs this), world 2, one thread per rank, each rank in
a process session of its own (as torchrun and ddprun start workers), the two backends alternating
round by round so that both see the same machine:

  allreduce  bench/compare/gloo_allreduce.py --backend gloo|ddp: dist.all_reduce of float32, the
             median over iterations of the slower rank's time; 1 KiB latency and 64 MiB bus
             bandwidth
  ddp        bench/compare/pytorch_ddp_bench.py --backend gloo|ddp: PyTorch's own
             DistributedDataParallel training steps of the mlp and the cnn, samples/s; and the
             ceiling of any backend under PyTorch's DDP, measured in the same rounds: the same
             steps with --comm-hook noop (DDP's whole step, no communication)

Prints one markdown table (medians over rounds, and the ratio ddp/gloo) and, with --json, writes
every measurement. torch_ddp comes from --torch-ddp (a folder holding the package, default the
build folder's python/ when it has one) or from the environment where it was pip-installed.
--tiny runs each measurement once at toy sizes, the mlp only (CI runs it so the driver cannot rot).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))  # bench/compare/ -> the repository


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(command, world, env, timeout):
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(command, env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    outputs = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"torch_ddp_compare: {' '.join(command)} did not finish within "
                             f"{timeout} s")
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"torch_ddp_compare: rank {rank} of {' '.join(command)} exited "
                             f"{p.returncode}:\n{out}\n{err}")
        outputs.append(out)
    return outputs[0]


def allreduce(python, backend, sizes, iters, env, world):
    out = run_world([python, os.path.join(HERE, "gloo_allreduce.py"), "--backend", backend,
                     "--sizes", sizes, "--iters", str(iters), "--warmup", "3"], world, env, 600)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for row in rows:
        if row["wrong"]:
            raise SystemExit(f"torch_ddp_compare: {backend} allreduce of {row['bytes']} bytes gave "
                             f"{row['wrong']} wrong elements")
    return {row["bytes"]: row for row in rows}


def ddp_step(python, backend, model, steps, env, world, hook="none"):
    out = run_world([python, os.path.join(HERE, "pytorch_ddp_bench.py"), "--backend", backend,
                     "--model", model, "--steps", str(steps), "--warmup", "3",
                     "--comm-hook", hook], world, env, 900)
    match = re.search(r"step_ms=([\d.]+) samples_per_s=([\d.]+)", out)
    if not match:
        raise SystemExit(f"torch_ddp_compare: no step_ms line from pytorch_ddp_bench:\n{out}")
    return {"step_ms": float(match.group(1)), "samples_per_s": float(match.group(2))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--torch-ddp", default=None,
                        help="folder holding the torch_ddp package (default: <build>/python)")
    parser.add_argument("--build", default=os.path.join(REPO, "build-pytorch"))
    parser.add_argument("--json", default=None, help="write every measurement here")
    parser.add_argument("--tiny", action="store_true", help="one round at toy sizes")
    args = parser.parse_args()

    env = dict(os.environ)
    package = args.torch_ddp or os.path.join(args.build, "python")
    if os.path.isdir(os.path.join(package, "torch_ddp")):
        env["PYTHONPATH"] = package + os.pathsep + env.get("PYTHONPATH", "")
    python = sys.executable
    check = subprocess.run([python, "-c", "import torch_ddp"], env=env, capture_output=True,
                           text=True)
    if check.returncode != 0:
        raise SystemExit("torch_ddp_compare: cannot import torch_ddp (build it: cmake ... "
                         "-DDDP_BUILD_PYTHON=ON, or pip install ./python):\n" + check.stderr)

    rounds = 1 if args.tiny else args.rounds
    sizes = "1K,64K" if args.tiny else "1K,64M"
    iters = 3 if args.tiny else 30
    steps = 2 if args.tiny else 20
    small, large = (1024, 65536) if args.tiny else (1024, 64 << 20)
    models = ("mlp",) if args.tiny else ("mlp", "cnn")
    results = {b: {"allreduce": [], "mlp": [], "cnn": []} for b in ("gloo", "ddp")}
    ceiling = {"mlp": [], "cnn": []}  # PyTorch's DDP with the noop hook: no backend does better
    for r in range(rounds):
        for backend in (("gloo", "ddp") if r % 2 == 0 else ("ddp", "gloo")):
            results[backend]["allreduce"].append(
                allreduce(python, backend, sizes, iters, env, args.world))
            for model in models:
                results[backend][model].append(ddp_step(python, backend, model, steps, env,
                                                        args.world))
        for model in models:
            ceiling[model].append(ddp_step(python, "gloo", model, steps, env, args.world, "noop"))
        print(f"torch_ddp_compare: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)

    def med(backend, pick):
        return statistics.median(pick(x) for x in results[backend][pick.key])

    def metric(key, fn):
        fn.key = key
        return fn

    lat = metric("allreduce", lambda x: x[small]["time_us"])
    bus = metric("allreduce", lambda x: x[large]["busbw_gbps"])
    mlp = metric("mlp", lambda x: x["samples_per_s"])
    cnn = metric("cnn", lambda x: x["samples_per_s"])
    import torch

    print(f"\nworld {args.world}, one thread per rank, PyTorch {torch.__version__}, "
          f"medians of {rounds} round(s)\n")
    print("| measure | gloo | ddp | ddp vs gloo | ceiling (noop hook) | gloo, ddp: share of it |")
    print("|---|---|---|---|---|---|")
    g, d = med("gloo", lat), med("ddp", lat)
    print(f"| all_reduce {small} B, us (lower is better) | {g:.1f} | {d:.1f} | {g / d:.1f}x faster "
          f"| | |")
    g, d = med("gloo", bus), med("ddp", bus)
    print(f"| all_reduce {large >> 20 if large >= 1 << 20 else large} "
          f"{'MiB' if large >= 1 << 20 else 'B'} busbw, GB/s | {g:.2f} | {d:.2f} | {d / g:.2f}x "
          f"| | |")
    for name, m in (("mlp", mlp), ("cnn", cnn)):
        if name not in models:
            continue
        g, d = med("gloo", m), med("ddp", m)
        c = statistics.median(x["samples_per_s"] for x in ceiling[name])
        print(f"| PyTorch DDP {name}, samples/s | {g:.0f} | {d:.0f} | {d / g:.2f}x | {c:.0f} "
              f"| {g / c:.0%}, {d / c:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "rounds": rounds, "torch": torch.__version__,
                       "results": results, "ceiling_noop_hook": ceiling}, f, indent=1,
                      default=str)


if __name__ == "__main__":
    main()
