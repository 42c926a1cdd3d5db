#!/usr/bin/python3
"""Side by side: ddp's DistributedDataParallel against PyTorch's DDP (gloo), in one run.

For each model and world size, runs ddp-train-bench and bench/pytorch_ddp_bench.py, both under
ddprun (so both get the same environment, including ddprun's environment tuning: glibc malloc
keeps freed memory, and OpenBLAS gets its AVX kernels on CPUs it does not know; docs/ddprun.md),
alternating the two `--repeats` times, and prints the median samples/s of each and their ratio.
`--no-env-tuning` runs both without that tuning. One torch thread per rank on both sides
(OMP_NUM_THREADS=1).

  bench/compare_ddp.py --build build --models mlp cnn --worlds 1 2
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


def run_pytorch(build, model, world, args):
    cmd = ddprun(build, world, args) + [
        "/usr/bin/python3", os.path.join(HERE, "pytorch_ddp_bench.py"), "--model", model,
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--batch-size", str(args.batch_size)] + view_flag(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"pytorch_ddp_bench failed:\n{out.stdout}\n{out.stderr}")
    return parse(out.stdout, "pytorch_ddp_bench")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(HERE, "..", "build"))
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
    header = (f"{'model':5} {'world':>5} {'ddp step ms':>12} {'ddp samples/s':>14} "
              f"{'torch step ms':>14} {'torch samples/s':>16} {'ddp/torch':>10}")
    print(header)
    print("-" * len(header))
    results = {}
    for model in args.models:
        for world in args.worlds:
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(run_ddp(args.build, model, world, args))
                theirs.append(run_pytorch(args.build, model, world, args))
            ours_ms = statistics.median(o[0] for o in ours)
            ours_sps = statistics.median(o[1] for o in ours)
            theirs_ms = statistics.median(t[0] for t in theirs)
            theirs_sps = statistics.median(t[1] for t in theirs)
            results[(model, world)] = (ours_sps, theirs_sps)
            print(f"{model:5} {world:>5} {ours_ms:>12.1f} {ours_sps:>14.1f} {theirs_ms:>14.1f} "
                  f"{theirs_sps:>16.1f} {ours_sps / theirs_sps:>9.2f}x", flush=True)
    for model in args.models:
        if (model, 1) in results and (model, 2) in results:
            o1, t1 = results[(model, 1)]
            o2, t2 = results[(model, 2)]
            print(f"# {model}: world 2 / world 1 scaling: ddp {o2 / o1:.2f}x, torch {t2 / t1:.2f}x")
    print(f"# load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
