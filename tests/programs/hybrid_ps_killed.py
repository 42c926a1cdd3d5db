#!/usr/bin/python3
"""train-hybrid's parameter server killed mid-run (issue 51's bad input): every trainer must end
with a named error and a non-zero exit within the timeout, never a hang.

    hybrid_ps_killed.py BIN_DIR [--trainers 2] [--deadline 60]

Starts the job's processes itself, with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...)
and no launcher, so that nobody but the trainers themselves notices the loss: a launcher would
stop them on its own (ddprun does, after its grace period). The parameter server (rank 0, which
also serves the rendezvous store) is killed with SIGKILL once every trainer is stepping; then each
trainer must exit non-zero within --deadline seconds, its last line an error from train-hybrid
that names what was lost ('ps', the parameter server, or the peer or store that went with it).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("bin_dir")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--deadline", type=float, default=60.0)
    args = p.parse_args()
    job = os.path.join(os.path.abspath(args.bin_dir), "train-hybrid")
    world = args.trainers + 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="hybrid_killed_") as d:
        procs, logs = [], []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            log = open(os.path.join(d, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen([job, "--steps", "100000000"], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        # Stepping: the parameter server's embedding has taken calls for a while. There is no
        # progress output to wait on (the contract fixes train-hybrid's output), so give the
        # job a few seconds and check that nobody ended early.
        time.sleep(4.0)
        early = [r for r, q in enumerate(procs) if q.poll() is not None]
        if early:
            for r in early:
                logs[r].seek(0)
                print(f"rank {r} ended before the kill (exit {procs[r].returncode}):\n"
                      f"{logs[r].read()[-2000:]}")
            for q in procs:
                q.kill()
            return 1
        procs[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        failed = False
        for rank in range(1, world):
            left = args.deadline - (time.monotonic() - killed_at)
            try:
                code = procs[rank].wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                print(f"FAILED: trainer{rank} still runs {args.deadline:.0f} s after the "
                      "parameter server was killed (a hang)")
                procs[rank].kill()
                procs[rank].wait()
                failed = True
                continue
            took = time.monotonic() - killed_at
            logs[rank].seek(0)
            lines = [line for line in logs[rank].read().splitlines() if line.strip()]
            last = lines[-1] if lines else ""
            named = last.startswith("train-hybrid: ") and any(
                word in last for word in ("'ps'", "parameter server", "rank 0", "store",
                                          "trainer"))
            print(f"trainer{rank}: exit {code} after {took:.1f} s: {last}")
            if code == 0 or code < 0 or not named:
                print(f"FAILED: trainer{rank} did not end with a named error and a non-zero exit")
                failed = True
        procs[0].wait()
        for log in logs:
            log.close()
        if failed:
            return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
