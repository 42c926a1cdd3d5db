#!/usr/bin/env python3
"""What a launcher costs its workers on a loaded machine (issue 24).

The kernel's autogroup scheduler (/proc/sys/kernel/sched_autogroup_enabled) shares the CPU between
process sessions, not between processes: workers that share their launcher's session share one
session's slice against every other session. This driver loads the machine itself with busy loops
in another process session (one per usable CPU, or --loaders), then runs the same CPU-bound
2-worker job, alternating the launchers in mirrored order (ABC CBA ...):

  before    ddprun with DDP_LAUNCHER_SAME_SESSION=1: the workers stay in ddprun's session (what
            ddprun did before issue 24; the variable is a measurement aid)
  after     ddprun as it is: each worker leads its own session
  torchrun  PyTorch's torchrun --no-python (each worker in its own session)

Each worker counts loop iterations of a pure-Python loop for --seconds and writes its rate; a
run's throughput is the sum of both workers' rates. Prints every run, then the median per
launcher and the ratios to torchrun.

  python3 bench/probes/launcher_under_load.py --build build --rounds 5
  python3 bench/probes/launcher_under_load.py --build build --quick   # the CTest form: does it run?

Exit code: 0 when every run succeeded (the numbers are not judged), 1 when a run failed, 2 for bad
arguments. Standard library only.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_TORCHRUN = "/opt/ddp/pytorch-2.15.0-venv/bin/torchrun"
PYTHON = sys.executable or "/usr/bin/python3"

WORKER = r"""
import os, sys, time
out_dir, seconds = sys.argv[1], float(sys.argv[2])
rank = os.environ["RANK"]
n = 0
start = time.perf_counter()
deadline = start + seconds
while True:
    for _ in range(10000):
        n += 1
    if time.perf_counter() >= deadline:
        break
rate = n / (time.perf_counter() - start)
with open(os.path.join(out_dir, "rate." + rank), "w") as f:
    f.write(repr(rate))
"""


def start_load(count):
    """`count` busy loops in one new process session (setsid), away from the launchers'."""
    code = "import os, sys\n" + "\n".join(
        ["for _ in range(%d):" % (count - 1), "    if os.fork() == 0: break",
         "while True: pass"])
    return subprocess.Popen([PYTHON, "-c", code], start_new_session=True,
                            stdin=subprocess.DEVNULL)


def stop_load(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def launch_command(mode, args, worker_path, out_dir):
    worker = [PYTHON, worker_path, out_dir, str(args.seconds)]
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "DDP_LAUNCHER_SAME_SESSION"):
        env.pop(name, None)
    if mode == "torchrun":
        return [args.torchrun, "--standalone", "--nproc-per-node", "2", "--no-python"] + worker, env
    if mode == "before":
        env["DDP_LAUNCHER_SAME_SESSION"] = "1"
    return [args.ddprun, "--standalone", "--nproc-per-node", "2"] + worker, env


def run_once(mode, args, worker_path):
    with tempfile.TemporaryDirectory(prefix="launcher_under_load.") as out_dir:
        argv, env = launch_command(mode, args, worker_path, out_dir)
        try:
            proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=args.seconds + args.timeout)
        except subprocess.TimeoutExpired:
            return None, f"{mode}: no result within {args.seconds + args.timeout:.0f} s"
        rates = []
        for rank in (0, 1):
            path = Path(out_dir) / f"rate.{rank}"
            if proc.returncode != 0 or not path.exists():
                return None, (f"{mode}: exit code {proc.returncode}, rank {rank} wrote no rate; "
                              f"output:\n{proc.stdout[-2000:]}")
            rates.append(float(path.read_text()))
        return sum(rates), None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default="build", help="build folder holding bin/ddprun")
    parser.add_argument("--torchrun", default=DEFAULT_TORCHRUN)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0, help="each worker's measurement")
    parser.add_argument("--loaders", type=int, default=0,
                        help="busy loops loading the machine (default: one per usable CPU)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a run may take beyond --seconds")
    parser.add_argument("--quick", action="store_true",
                        help="one round of 0.5 s runs: checks the driver, not the numbers")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 0.5
    if args.rounds < 1 or args.seconds <= 0 or args.loaders < 0:
        parser.error("--rounds and --seconds must be positive and --loaders at least 0")
    args.ddprun = str(Path(args.build) / "bin" / "ddprun")
    if not os.access(args.ddprun, os.X_OK):
        parser.error(f"{args.ddprun} is not an executable: build ddprun or give --build")
    modes = ["before", "after"]
    if os.access(args.torchrun, os.X_OK):
        modes.append("torchrun")
    else:
        print(f"launcher_under_load: {args.torchrun} is missing: torchrun is left out")
    loaders = args.loaders or len(os.sched_getaffinity(0))
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    print(f"launcher_under_load: {loaders} busy loop(s) in another session; autogroup "
          f"{autogroup.read_text().strip() if autogroup.exists() else 'unknown'}; "
          f"{len(os.sched_getaffinity(0))} CPU(s); {args.rounds} round(s) of {args.seconds} s")

    results = {mode: [] for mode in modes}
    failures = []
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER)
        worker_path = f.name
    load = start_load(loaders)
    try:
        time.sleep(0.5)  # the loops are spinning before the first run
        for round_index in range(args.rounds):
            order = modes if round_index % 2 == 0 else list(reversed(modes))
            for mode in order:
                rate, error = run_once(mode, args, worker_path)
                if error:
                    failures.append(error)
                    print(f"round {round_index}: {error}")
                    continue
                results[mode].append(rate)
                print(f"round {round_index}: {mode:8s} {rate / 1e6:8.2f} M iterations/s")
    finally:
        stop_load(load)
        os.unlink(worker_path)

    print("\nmedian job throughput (both workers), M iterations/s:")
    medians = {m: statistics.median(r) for m, r in results.items() if r}
    for mode, median in medians.items():
        print(f"  {mode:8s} {median / 1e6:8.2f}  (runs: "
              f"{', '.join(f'{r / 1e6:.2f}' for r in results[mode])})")
    if "torchrun" in medians:
        for mode in ("before", "after"):
            if mode in medians:
                print(f"  {mode} / torchrun = {medians[mode] / medians['torchrun']:.3f}")
    if "before" in medians and "after" in medians:
        print(f"  after / before = {medians['after'] / medians['before']:.3f}")
    if failures:
        print(f"launcher_under_load: {len(failures)} run(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
