#!/usr/bin/python3
"""Side by side: ddp's DistributedDataParallel against PyTorch's DDP (gloo), in one run.

For each model and world size, runs ddp-train-bench and bench/compare/pytorch_ddp_bench.py, both
under ddprun (so both get the same environment, including ddprun's environment tuning: glibc
malloc keeps freed memory, and OpenBLAS gets its AVX kernels on CPUs it does not know;
docs/ddprun.md), alternating the two `--repeats` times, and prints the median samples/s of each
and their ratio. `--no-env-tuning` runs both without that tuning. One torch thread per rank on
both sides (OMP_NUM_THREADS=1).

The PyTorch side runs twice: Debian's 1.13 (/usr/bin/python3) and PyTorch's current release
from the virtual environment that scripts/install-deps.sh makes (scripts/pytorch-python; left
out with a note where it is absent). `--bound` adds the no-communication bound: two independent
single-process ddp-train-bench runs at once (their samples/s added up), what world 2 would reach
if communication and synchronisation cost nothing on this machine.

  bench/compare/compare_ddp.py --build build --models mlp cnn --worlds 1 2
"""
import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LAST_LINE = re.compile(r"step_ms=([0-9.]+) samples_per_s=([0-9.]+)")


def parse(output, what):
    for line in reversed(output.splitlines()):
        match = LAST_LINE.search(line)
        if match:
            return float(match.group(1)), float(match.group(2))
    raise SystemExit(f"{what} printed no step_ms line:\n{output}")


def view_flag(args):
    return ["--gradient-as-bucket-view"] if args.gradient_as_bucket_view else []


def ddprun(build, world, args):
    tuning = ["--no-env-tuning"] if args.no_env_tuning else []
    return [os.path.join(build, "bin", "ddprun"), "--standalone", "--nproc-per-node",
            str(world)] + tuning


def run_ddp(build, model, world, args):
    cmd = ddprun(build, world, args) + [
           os.path.join(build, "bin", "ddp-train-bench"), "--model", model,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch-size", str(args.batch_size)] + view_flag(args) + args.ddp_args
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"ddp-train-bench failed:\n{out.stdout}\n{out.stderr}")
    return parse(out.stdout, "ddp-train-bench")


PYTORCH_PYTHON = os.path.join(HERE, "..", "..", "scripts", "pytorch-python")


def pytorch2_available():
    out = subprocess.run([PYTORCH_PYTHON, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def run_bound(build, model, args):
    """Two single-process runs at once: world 2 without any communication."""
    cmd = ddprun(build, 1, args) + [
           os.path.join(build, "bin", "ddp-train-bench"), "--model", model,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch-size", str(args.batch_size)] + view_flag(args) + args.ddp_args
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd + [], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    total = 0.0
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"ddp-train-bench (bound) failed:\n{stdout}\n{stderr}")
        total += parse(stdout, "ddp-train-bench (bound)")[1]
    return total


def run_pytorch(build, model, world, args, python="/usr/bin/python3"):
    cmd = ddprun(build, world, args) + [
        python, os.path.join(HERE, "pytorch_ddp_bench.py"), "--model", model,
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--batch-size", str(args.batch_size)] + view_flag(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        # PyTorch 2.15's gloo now and then aborts a rank at exit ("terminate called without an
        # active exception", after destroy_process_group; seen once in CI's tiny form): the peer
        # gets one more run, said on stderr, before its failure fails the comparison.
        first = (out.stdout + out.stderr).strip().splitlines()
        print(f"compare_ddp: pytorch_ddp_bench (torch at {python}) failed once "
              f"({first[-1] if first else f'exit {out.returncode}'}); running it again",
              file=sys.stderr)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"pytorch_ddp_bench failed:\n{out.stdout}\n{out.stderr}")
    return parse(out.stdout, "pytorch_ddp_bench")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(HERE, "..", "..", "build"))
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gradient-as-bucket-view", action="store_true",
                        help="pass gradient_as_bucket_view to both sides")
    parser.add_argument("--no-env-tuning", action="store_true",
                        help="run both sides with ddprun --no-env-tuning")
    parser.add_argument("--bound", action="store_true",
                        help="add the no-communication bound (two single-process runs at once)")
    parser.add_argument("--ddp-args", nargs=argparse.REMAINDER, default=[],
                        help="extra options for ddp-train-bench (last)")
    args = parser.parse_args()

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  nproc={os.cpu_count()}  cpu={cpu}")
    print(f"# batch {args.batch_size}/rank, {args.steps} timed steps after {args.warmup} warm-up, "
          f"median of each run, median of {args.repeats} alternating runs, 1 thread per rank, "
          f"gradient_as_bucket_view={args.gradient_as_bucket_view}, "
          f"env tuning {'off' if args.no_env_tuning else 'on'} (both sides); "
          f"load average at start {os.getloadavg()[0]:.2f}")
    torch2 = pytorch2_available()
    print(f"# peers: torch 1.13 = Debian's python3-torch; torch 2 = "
          + (f"PyTorch {torch2} (scripts/pytorch-python)" if torch2 else
             "absent (no PyTorch 2.x environment: run scripts/install-deps.sh)"))
    header = (f"{'model':5} {'world':>5} {'ddp step ms':>12} {'ddp samples/s':>14} "
              f"{'1.13 samples/s':>15} {'ddp/1.13':>9}")
    if torch2:
        header += f" {'2.x samples/s':>14} {'ddp/2.x':>8}"
    if args.bound:
        header += f" {'bound samples/s':>16}"
    print(header)
    print("-" * len(header))
    results = {}
    for model in args.models:
        for world in args.worlds:
            ours, theirs, theirs2, bound = [], [], [], []
            for _ in range(args.repeats):
                ours.append(run_ddp(args.build, model, world, args))
                theirs.append(run_pytorch(args.build, model, world, args))
                if torch2:
                    theirs2.append(run_pytorch(args.build, model, world, args, PYTORCH_PYTHON))
                if args.bound and world == 2:
                    bound.append(run_bound(args.build, model, args))
            ours_ms = statistics.median(o[0] for o in ours)
            ours_sps = statistics.median(o[1] for o in ours)
            theirs_sps = statistics.median(t[1] for t in theirs)
            results[(model, world)] = (ours_sps, theirs_sps)
            line = (f"{model:5} {world:>5} {ours_ms:>12.1f} {ours_sps:>14.1f} "
                    f"{theirs_sps:>15.1f} {ours_sps / theirs_sps:>8.2f}x")
            if torch2:
                theirs2_sps = statistics.median(t[1] for t in theirs2)
                line += f" {theirs2_sps:>14.1f} {ours_sps / theirs2_sps:>7.2f}x"
            if args.bound:
                line += f" {statistics.median(bound):>16.1f}" if bound else f" {'':>16}"
            print(line, flush=True)
            print(f"#   runs: ddp {[round(o[1]) for o in ours]}, 1.13 "
                  f"{[round(t[1]) for t in theirs]}"
                  + (f", 2.x {[round(t[1]) for t in theirs2]}" if torch2 else "")
                  + (f", bound {[round(b) for b in bound]}" if bound else ""), flush=True)
    for model in args.models:
        if (model, 1) in results and (model, 2) in results:
            o1, t1 = results[(model, 1)]
            o2, t2 = results[(model, 2)]
            print(f"# {model}: world 2 / world 1 scaling: ddp {o2 / o1:.2f}x, torch 1.13 "
                  f"{t2 / t1:.2f}x")
    print(f"# load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
