#!/usr/bin/python3
"""Side-by-side RPC round trips of ddp::rpc and PyTorch's TensorPipe RPC on this host, in one run.

    bench/compare/compare_rpc.py [--build-dir build] [--rounds 3] [--calls 2000]
                                 [--echo-calls 200] [--echo-bytes 1048576] [--warmup 100]

Each round runs, one after the other, rpc-latency under ddprun (bench/micro/rpc_latency.cc, two
workers) and bench/compare/pytorch_rpc_bench.py under PyTorch 2.x (scripts/pytorch-python, two
workers by torch.multiprocessing): an empty rpc_sync round trip and a float32 tensor echo, each
call timed alone, the median over the calls; and bench/micro/tcp_roundtrip_bound.cc, the same
round trips over loopback TCP with nothing else (one buffer each way), twice: with blocking recv
(two threads that sleep between messages) and with --spin (recv that never sleeps: the floor for
a round trip whose threads spin, which no RPC over TCP on this host can beat). The table shows,
per measurement, the median over rounds of each side's medians and their ratio (ddp / PyTorch;
issue 51's targets: at most 0.1 for the empty call, 0.5 for the 1 MiB echo). Prints the machine, its load and the date first.
Exit 0 when every run succeeded, 1 otherwise.
"""

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LINE = re.compile(r"(?:rpc-latency|tcp-bound|tcp-bound-spin) (empty|echo)_us (?:bytes=\d+ )?"
                  r"median=([\d.]+)")


def run(command, env=None):
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    found = {m.group(1): float(m.group(2)) for m in LINE.finditer(done.stdout)}
    if done.returncode != 0 or len(found) != 2:
        sys.stderr.write(f"FAILED ({done.returncode}): {' '.join(command)}\n{done.stdout}\n"
                         f"{done.stderr[-3000:]}\n")
        return None
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--echo-calls", type=int, default=200)
    p.add_argument("--echo-bytes", type=int, default=1 << 20)
    p.add_argument("--warmup", type=int, default=100)
    args = p.parse_args()
    common = ["--calls", str(args.calls), "--echo-calls", str(args.echo_calls), "--echo-bytes",
              str(args.echo_bytes), "--warmup", str(args.warmup)]
    bin_dir = os.path.join(os.path.abspath(args.build_dir), "bin")
    ddp = [os.path.join(bin_dir, "ddprun"), "--standalone", "--nproc-per-node", "2",
           os.path.join(bin_dir, "rpc-latency")] + common
    pytorch = [os.path.join(REPO, "scripts", "pytorch-python"),
               os.path.join(HERE, "pytorch_rpc_bench.py")] + common
    bound = [os.path.join(bin_dir, "tcp_roundtrip_bound")] + common
    results = {"ddp": [], "pytorch": [], "tcp": [], "tcp_spin": []}
    ok = True
    for _ in range(args.rounds):
        for side, command in (("ddp", ddp), ("pytorch", pytorch), ("tcp", bound),
                              ("tcp_spin", bound + ["--spin"])):
            found = run(command)
            ok = ok and found is not None
            if found:
                results[side].append(found)
    load = os.getloadavg()
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')}, {os.cpu_count()} CPUs, "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.rounds} rounds, medians of "
          f"{args.calls} empty calls and {args.echo_calls} echoes of {args.echo_bytes} bytes\n")
    print("| round trip | ddp::rpc (µs) | PyTorch TensorPipe (µs) | ddp / PyTorch | target "
          "| raw TCP, sleeping (µs) | raw TCP, spinning (µs) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, label, target in (("empty", "empty rpc_sync", "≤ 0.1"),
                               ("echo", f"{args.echo_bytes} B tensor echo", "≤ 0.5")):
        d = [r[key] for r in results["ddp"]]
        t = [r[key] for r in results["pytorch"]]
        dm = statistics.median_low(d) if d else float("nan")
        tm = statistics.median_low(t) if t else float("nan")
        ratio = dm / tm if d and t else float("nan")
        bounds = []
        for side in ("tcp", "tcp_spin"):
            b = [r[key] for r in results[side]]
            bounds.append(statistics.median_low(b) if b else float("nan"))
        print(f"| {label} | {dm:.1f} | {tm:.1f} | {ratio:.3f} | {target} | {bounds[0]:.1f} "
              f"| {bounds[1]:.1f} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
