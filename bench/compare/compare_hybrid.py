#!/usr/bin/python3
"""Side-by-side step time of train-hybrid and PyTorch's own tutorial code (DDP with distributed
RPC, tests/programs/hybrid_reference.py) on this host, in one run, on the same files.

    bench/compare/compare_hybrid.py [--build-dir build] [--rounds 3] [--trainers 2] [--steps 60]

Each round writes the tutorial's initial parameters and --steps batches per trainer (PyTorch's
code does, under scripts/pytorch-python), runs the tutorial on them (TensorPipe RPC, gloo DDP) and
then train-hybrid under ddprun on the same files. Both time every step on the first trainer, from
the trainers' barrier after the previous step to the one after this step (forward through the
remote embedding, the distributed backward, the DistributedOptimizer's step, the loss report, the
barrier): the median over steps 2..N of a round, then the median over rounds. The table shows
both and the speed-up (PyTorch's step / ddp's; issue 51's target: at least 2 at 2 trainers).
Prints the machine, its load and the date first. Exit 0 when every run succeeded, 1 otherwise.
"""

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
REFERENCE = os.path.join(REPO, "tests", "programs", "hybrid_reference.py")


def run(command, what):
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        sys.stderr.write(f"FAILED ({done.returncode}): {what}: {' '.join(command)}\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}\n")
        return False
    return True


def median_step_ms(path):
    with open(path) as f:
        seconds = [float(line) for line in f if line.strip()]
    if len(seconds) < 2:
        return None
    return 1e3 * statistics.median(seconds[1:])  # the first step warms caches and connections


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    bin_dir = os.path.join(os.path.abspath(args.build_dir), "bin")
    python = os.path.join(REPO, "scripts", "pytorch-python")
    results = {"ddp": [], "pytorch": []}
    ok = True
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="compare_hybrid_") as d:
            pytorch = [python, REFERENCE, bin_dir, python, "--trainers", str(args.trainers),
                       "--steps", str(args.steps), "--in-child",
                       "--dir", d]
            if not run(pytorch, "PyTorch's tutorial"):
                ok = False
                continue
            results["pytorch"].append(median_step_ms(os.path.join(d, "pytorch_step_seconds.txt")))
            times = os.path.join(d, "ddp_step_seconds.txt")
            ddp = [os.path.join(bin_dir, "ddprun"), "--standalone", "--nproc-per-node",
                   str(args.trainers + 1), os.path.join(bin_dir, "train-hybrid"), "--steps",
                   str(args.steps), "--init-state-dict", os.path.join(d, "init.pt"), "--data",
                   os.path.join(d, "data.pt"), "--step-seconds", times]
            if not run(ddp, "train-hybrid"):
                ok = False
                continue
            results["ddp"].append(median_step_ms(times))
    if any(x is None for side in results.values() for x in side):
        sys.stderr.write("FAILED: a run recorded fewer than 2 steps\n")
        return 1
    load = os.getloadavg()
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')}, {os.cpu_count()} CPUs, "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.rounds} rounds of "
          f"{args.steps} steps at {args.trainers} trainers, medians of steps 2..{args.steps}\n")
    print("| trainers | train-hybrid step (ms) | PyTorch tutorial step (ms) | speed-up | target |")
    print("| --- | --- | --- | --- | --- |")
    d, t = results["ddp"], results["pytorch"]
    dm = statistics.median_low(d) if d else float("nan")
    tm = statistics.median_low(t) if t else float("nan")
    speedup = tm / dm if d and t else float("nan")
    print(f"| {args.trainers} | {dm:.2f} | {tm:.2f} | {speedup:.1f}x | ≥ 2x |")
    print(f"rounds: ddp {', '.join(f'{x:.2f}' for x in d)} ms; "
          f"pytorch {', '.join(f'{x:.2f}' for x in t)} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
