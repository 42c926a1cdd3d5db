#!/usr/bin/python3
"""Side-by-side allreduce (float32, sum) of ddp and its peers on this machine, in one run.

    bench/compare/compare_allreduce.py [WORLD_SIZE] [--build-dir build] [--sizes 1K,64K,1M,16M,64M]
                                       [--iters 20] [--warmup 5] [--rounds 3] [--json-out FILE]

Measures, for the same sizes and world size (default 2, all ranks on this host):
  ddp-ring         ddp-bench --backend ring under ddprun, loopback TCP (DDP_TRANSPORT=tcp)
  ddp-shm          the same with DDP_TRANSPORT=auto: the ranks share memory (src/comm/ring/shm)
  ddp-shm-shared   ddp-shm in place in a shared buffer (ddp-bench --shared-buffer: the zero-copy
                   allreduce that DDP's gradient_as_bucket_view buckets take; measured only when
                   --peers names it)
  ddp-mpi          ddp-bench --backend mpi under mpirun (when this build has the mpi backend)
  gloo             torch.distributed's gloo (bench/compare/gloo_allreduce.py, Debian's
                   python3-torch, run by /usr/bin/python3; the processes are started here, not
                   by torchrun)
  gloo2            the same with PyTorch's current release (scripts/pytorch-python, the virtual
                   environment of scripts/install-deps.sh; "not installed" where it is absent)
  openmpi-tcp      OpenMPI's MPI_Allreduce (bench/compare/mpi_allreduce.c), --mca pml ob1 --mca btl
                   tcp,self: TCP over loopback only
  openmpi          the same with OpenMPI's default transports (shared memory)
  tcp-bound        bench/micro/tcp_exchange_bound (world 2 only): a world-2 ring allreduce's data
                   movement over one loopback TCP connection, both directions at once, with no
                   reduction and no engine: about the most any TCP allreduce of this pattern can
                   reach on this machine, from 16 MiB on (not in the default --peers)
Every program times the same way: a barrier before each iteration (not timed), each rank times
its own call, the slowest rank's time counts, the median over --iters iterations is reported.
Every call is blocking: ddp-bench's default (CallOptions::blocking), as MPI_Allreduce and
torch.distributed's all_reduce without async_op (--ddp-async times ddp's queued form instead). Small sizes need more iterations than the
default 20 to be steady (e.g. --sizes 1K,4K,64K --iters 2000 --warmup 200): at 4 KiB, past
OpenMPI's eager limit, both MPIs take a few hundred calls to settle.
ddp-bench's timed runs do nothing between iterations but the barrier, like the peers; a separate
short ddp-bench --check run verifies ddp's results first (the peers check their last iteration).
OMP_NUM_THREADS=1 and one compute thread per rank everywhere. mpirun runs with --bind-to none, so
that no peer gets pinned cores the others lack (--mpi-bind-to core restores OpenMPI's default).
The peers run one after the other, --rounds times interleaved; the first table shows, per peer
and size, the median over rounds of those medians (the lower middle one for an even count), the
second the lowest of them (the least disturbed round).
Prints the machine (CPUs, model, load), the date and the tables as Markdown; exit 0 when every
measurement ran, 1 when one failed (the table marks it), 2 for bad arguments.
"""

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # bench_common
from bench_common import (PYTORCH2_PYTHON, REPO, SYSTEM_PYTHON, cpu_model, human, json_rows,
                          load_average, parse_size, run, tool_version)

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
PEERS = ["ddp-ring", "ddp-shm", "ddp-mpi", "gloo", "gloo2", "openmpi-tcp", "openmpi"]
EXTRA_PEERS = ["tcp-bound", "ddp-shm-shared"]  # measured only when --peers names them
GLOOS = ("gloo", "gloo2", "openmpi-tcp")  # the peers that ddp-ring's ratios are taken against


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    def __init__(self, args):
        self.args = args
        self.bin = Path(args.build_dir).resolve() / "bin"
        self.env = dict(os.environ, OMP_NUM_THREADS="1", DDP_TRANSPORT="tcp")
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "DDP_BACKEND"):
            self.env.pop(name, None)
        self.mpirun = [*MPIRUN, "--bind-to", args.mpi_bind_to]
        self.sizes = ",".join(str(s) for s in args.sizes)
        self.common = ["--sizes", self.sizes, "--iters", str(args.iters),
                       "--warmup", str(args.warmup)]

    def ddp_bench(self, backend, check=False, transport="tcp", extra=()):
        bench = str(self.bin / "ddp-bench")
        # Timed runs do nothing between iterations but the barrier, like the peers; correctness
        # is checked in a separate short run (check=True), where every iteration is verified.
        common = ["--sizes", self.sizes, "--iters", "2", "--warmup", "0", "--check"] if check \
            else self.common
        args = ["--backend", backend, "--op", "allreduce", "--dtype", "float32", "--reduce-op",
                "sum", "--json", *common, *(["--async"] if self.args.ddp_async else []), *extra]
        if backend == "ring":
            argv = [str(self.bin / "ddprun"), "--standalone", "--nproc-per-node",
                    str(self.args.world_size), bench, *args]
            env = dict(self.env, DDP_TRANSPORT=transport)
        else:
            # The rendezvous store still needs a port; a free one, not the default 29500.
            env = dict(self.env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            argv = [*self.mpirun, "-np", str(self.args.world_size), "-x", "OMP_NUM_THREADS",
                    "-x", "DDP_TRANSPORT", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", bench, *args]
        code, output = run(argv, env, self.args.timeout)
        if backend == "mpi" and code == 2 and "not available" in output:
            return None, "not built (no mpi backend in this build)"
        return self.finish(code, output)

    def gloo(self, python=SYSTEM_PYTHON):
        if python != SYSTEM_PYTHON and subprocess.run(
                [python, "-c", "import torch"], capture_output=True).returncode != 0:
            return None, "not installed (no PyTorch 2.x environment: run scripts/install-deps.sh)"
        port = free_port()
        procs = []
        for rank in range(self.args.world_size):
            env = dict(self.env, RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(self.args.world_size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            procs.append(subprocess.Popen(
                [python, str(REPO / "bench" / "compare" / "gloo_allreduce.py"), *self.common,
                 "--timeout", str(self.args.timeout)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        outputs, code = [], 0
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=self.args.timeout)
            except subprocess.TimeoutExpired:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                out += f"\n(killed after {self.args.timeout} s)"
            outputs.append(out)
            code = code or proc.returncode
        return self.finish(code, outputs[0] + "".join(outputs[1:]))

    def openmpi(self, tcp_only):
        program = self.bin / "mpi_allreduce"
        if not program.exists():
            return None, f"not built: {program} (needs OpenMPI's libopenmpi-dev)"
        transports = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                      "--mca", "btl_tcp_if_include", "lo"] if tcp_only else []
        argv = [*self.mpirun, "-np", str(self.args.world_size), "-x", "OMP_NUM_THREADS",
                *transports,
                str(program), *self.common, "--label", "openmpi-tcp" if tcp_only else "openmpi"]
        return self.finish(*run(argv, self.env, self.args.timeout))

    def finish(self, code, output):
        rows = json_rows(output)
        if code != 0 or len(rows) != len(self.args.sizes):
            tail = "\n".join(output.strip().splitlines()[-5:])
            return None, f"failed (exit {code}): {tail}"
        return {row["bytes"]: row for row in rows}, None

    def measure(self, peer, check=False):
        if peer == "ddp-ring":
            return self.ddp_bench("ring", check)
        if peer == "ddp-shm":
            return self.ddp_bench("ring", check, transport="auto")
        if peer == "ddp-shm-shared":
            return self.ddp_bench("ring", check, transport="auto", extra=["--shared-buffer"])
        if peer == "ddp-mpi":
            return self.ddp_bench("mpi", check)
        if peer == "gloo":
            return self.gloo()
        if peer == "gloo2":
            return self.gloo(PYTORCH2_PYTHON)
        if peer == "tcp-bound":
            return self.tcp_bound()
        return self.openmpi(tcp_only=peer == "openmpi-tcp")

    def tcp_bound(self):
        program = self.bin / "tcp_exchange_bound"
        if self.args.world_size != 2:
            return None, "world size 2 only"
        if not program.exists():
            return None, f"not built: {program}"
        return self.finish(*run([str(program), *self.common], self.env, self.args.timeout))


def fmt_us(us):
    # Small times with the digits that tell 1.2 from 1.25 µs.
    return f"{us:.2f}" if us < 10 else f"{us:.1f}"


def fmt_time(row):
    return fmt_us(row['time_us']) if row else "–"


def fmt_bw(row):
    return f"{row['busbw_gbps']:.3f}" if row else "–"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("world_size", nargs="?", type=int, default=2,
                        help="ranks, all on this host (default 2)")
    parser.add_argument("--build-dir", default=os.environ.get("DDP_BUILD_DIR", str(REPO / "build")),
                        help="CMake build tree with bin/ddp-bench, bin/ddprun, bin/mpi_allreduce "
                             "(default $DDP_BUILD_DIR, else build/)")
    parser.add_argument("--sizes", default="1K,64K,1M,16M,64M",
                        type=lambda t: [parse_size(w) for w in t.split(",")])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every peer is measured, interleaved (default 3)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per program run")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated subset of {','.join(PEERS + EXTRA_PEERS)}")
    parser.add_argument("--mpi-bind-to", default="none",
                        help="mpirun's --bind-to (default none: ddprun and the gloo processes are "
                             "not pinned either; OpenMPI's own default is core)")
    parser.add_argument("--json-out", help="also write every measurement to this file")
    parser.add_argument("--ddp-async", action="store_true",
                        help="time ddp's calls as collective(...)->wait() (ddp-bench --async) "
                             "instead of blocking calls")
    args = parser.parse_args()
    peers = args.peers.split(",")
    for value, name, low in ((args.world_size, "WORLD_SIZE", 1), (args.iters, "--iters", 1),
                             (args.warmup, "--warmup", 0), (args.rounds, "--rounds", 1)):
        if value < low:
            parser.error(f"{name} must be at least {low}, got {value}")
    if unknown := [p for p in peers if p not in PEERS + EXTRA_PEERS]:
        parser.error(f"unknown peer(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(PEERS + EXTRA_PEERS)}")
    for program in ("ddp-bench", "ddprun"):
        if not (Path(args.build_dir) / "bin" / program).exists():
            parser.error(f"{args.build_dir}/bin/{program} does not exist: build it first "
                         f"(cmake --build {args.build_dir} --target ddp-bench ddprun "
                         f"mpi_allreduce) or pass --build-dir")
    if not os.path.exists(SYSTEM_PYTHON):
        parser.error(f"{SYSTEM_PYTHON} (with Debian's python3-torch) is needed for gloo")
    sizes = [max(1, s // 4) * 4 for s in args.sizes]  # what every program actually moves

    measured = {peer: [] for peer in peers}  # peer -> list of {bytes: row}, one per round
    errors = {}
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = load_average()
    runner = Runner(args)
    checked = {}  # ddp peer -> wrong elements in its checked run
    for peer in [p for p in peers if p.startswith("ddp-")]:
        print(f"# correctness: {peer} --check ...", file=sys.stderr, flush=True)
        rows, error = runner.measure(peer, check=True)
        if error:
            errors[peer] = error
        else:
            checked[peer] = sum(r["wrong"] for r in rows.values())
    for round_index in range(args.rounds):
        for peer in peers:
            if peer in errors:
                continue
            print(f"# round {round_index + 1}/{args.rounds}: {peer} ...", file=sys.stderr,
                  flush=True)
            rows, error = runner.measure(peer)
            if error:
                errors[peer] = error
            else:
                measured[peer].append(rows)
    load_after = load_average()

    # Per peer and size: the median over rounds of each round's median time.
    table = {}
    for peer in peers:
        table[peer] = {}
        for nbytes in sizes:
            rounds = [r[nbytes] for r in measured[peer] if nbytes in r]
            if not rounds:
                continue
            mid = sorted(rounds, key=lambda r: r["time_us"])[(len(rounds) - 1) // 2]
            table[peer][nbytes] = dict(mid, rounds_time_us=[r["time_us"] for r in rounds],
                                       wrong_total=sum(r["wrong"] or 0 for r in rounds))

    lines = []
    lines.append(f"# Allreduce float32 sum, world size {args.world_size}, one host")
    lines.append("")
    lines.append(f"- date: {started:%Y-%m-%d %H:%M} UTC; host {platform.node()}")
    lines.append(f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), "
                 f"load average {load_before} before, {load_after} after")
    torch_version = tool_version([SYSTEM_PYTHON, "-c", "import torch; print(torch.__version__)"])
    commit = tool_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    torch2_version = tool_version([PYTORCH2_PYTHON, "-c", "import torch; print(torch.__version__)"])
    lines.append(f"- peers: gloo from torch {torch_version}, gloo2 from torch {torch2_version}; "
                 f"{tool_version(['mpirun', '--version'])}"
                 f"; ddp {commit} (+ working tree)")
    lines.append(f"- method: median of {args.iters} iterations after {args.warmup} warm-up, each "
                 f"started after a barrier, slowest rank's time; median of {args.rounds} "
                 f"interleaved rounds; mpirun --bind-to {args.mpi_bind_to}; ddp's calls "
                 f"{'collective(...)->wait() (--ddp-async)' if args.ddp_async else 'blocking'}. "
                 "busbw = 2(N-1)/N · bytes / time (GB/s). "
                 "ring vs X = X's time / ddp-ring's time (> 1: ddp-ring is faster); "
                 "mpi ÷ openmpi = ddp-mpi's time / OpenMPI's (target ≤ 1.3).")
    lines.append("")
    header = ["size"]
    for peer in peers:
        header += [f"{peer} µs", f"{peer} busbw"]
    if "ddp-ring" in peers:
        header += [f"ring vs {p}" for p in GLOOS if p in peers]
    both_mpis = "ddp-mpi" in peers and "openmpi" in peers
    if both_mpis:
        header.append("mpi ÷ openmpi")
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---:" for _ in header) + "|")
    ring = table.get("ddp-ring", {})
    for nbytes in sizes:
        cells = [human(nbytes)]
        for peer in peers:
            row = table[peer].get(nbytes)
            cells += [fmt_time(row), fmt_bw(row)]
        if "ddp-ring" in peers:
            for p in GLOOS:
                if p not in peers:
                    continue
                a, b = ring.get(nbytes), table[p].get(nbytes)
                cells.append(f"{b['time_us'] / a['time_us']:.2f}×" if a and b else "–")
        if both_mpis:
            a, b = table["ddp-mpi"].get(nbytes), table["openmpi"].get(nbytes)
            cells.append(f"{a['time_us'] / b['time_us']:.2f}" if a and b else "–")
        lines.append("| " + " | ".join(cells) + " |")
    if args.rounds > 1:
        lines.append("")
        lines.append(f"Least disturbed round (the lowest of the {args.rounds} medians), µs:")
        lines.append("")
        lines.append("| size | " + " | ".join(peers) + " |")
        lines.append("|" + "|".join("---:" for _ in range(len(peers) + 1)) + "|")
        for nbytes in sizes:
            cells = [human(nbytes)]
            for peer in peers:
                row = table[peer].get(nbytes)
                cells.append(fmt_us(min(row['rounds_time_us'])) if row else "–")
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    wrong = {p: sum(r["wrong_total"] for r in table[p].values()) for p in peers if table[p]}
    wrong.update(checked)
    lines.append("- wrong elements: " + ", ".join(f"{p} {w}" for p, w in wrong.items()) +
                 " (ddp: a separate ddp-bench --check run verifying every iteration; the peers: "
                 "the last iteration of every size of every round)")
    for peer, error in errors.items():
        lines.append(f"- {peer}: {error}")

    # The engine's targets (world 2, loopback TCP): (size, peer, minimum speed-up, wording).
    targets = [(1024, "gloo", 20.0, "1 KiB: ddp-ring {x:.1f}× faster than gloo (target ≥ 20×)"),
               (1024, "openmpi-tcp", 1.0,
                "1 KiB: ddp-ring {x:.2f}× OpenMPI-TCP's speed (target ≥ 1×)"),
               (64 << 20, "gloo", 1.5, "64 MiB: ddp-ring busbw {x:.2f}× gloo's (target ≥ 1.5×)"),
               (1024, "gloo2", 20.0,
                "1 KiB: ddp-ring {x:.1f}× faster than PyTorch 2.x's gloo (target ≥ 20×)"),
               (64 << 20, "gloo2", 1.5,
                "64 MiB: ddp-ring busbw {x:.2f}× PyTorch 2.x's gloo's (target ≥ 1.5×)"),
               (64 << 20, "openmpi-tcp", 1.0,
                "64 MiB: ddp-ring busbw {x:.2f}× OpenMPI-TCP's (target ≥ 1×)")]
    checks = []
    if both_mpis:
        # The mpi backend's per-call overhead (issue 10): within 1.3x of OpenMPI at every size.
        ratios = [(table["ddp-mpi"][n]["time_us"] / table["openmpi"][n]["time_us"], n)
                  for n in sizes if n in table["ddp-mpi"] and n in table["openmpi"]]
        if ratios:
            worst, at = max(ratios)
            checks.append(f"ddp-mpi within 1.3× of OpenMPI's MPI_Allreduce at every size: worst "
                          f"{worst:.2f}× at {human(at)}" + (": PASS" if worst <= 1.3 else ": FAIL"))
    for nbytes, peer, minimum, wording in targets:
        if nbytes in ring and nbytes in table.get(peer, {}):
            # Same bytes and factor: the busbw ratio equals the time ratio.
            x = table[peer][nbytes]["time_us"] / ring[nbytes]["time_us"]
            checks.append(wording.format(x=x) + (": PASS" if x >= minimum else ": FAIL"))
    # Against the TCP bound: how much of loopback TCP's capacity ddp-ring uses, and whether the
    # bound itself leaves room for a busbw target of 1.5x a peer.
    bound = table.get("tcp-bound", {})
    for nbytes in sizes:
        # Below 16 MiB the bound program's thread per exchange costs more than the data moves.
        if nbytes in bound and nbytes >= 16 << 20:
            parts = []
            if nbytes in ring:
                share = bound[nbytes]["time_us"] / ring[nbytes]["time_us"]
                parts.append(f"ddp-ring at {100 * share:.0f}% of the TCP bound")
            for p in ("gloo", "gloo2"):
                if nbytes in table.get(p, {}):
                    x = table[p][nbytes]["time_us"] / bound[nbytes]["time_us"]
                    parts.append(f"the bound is {x:.2f}× {p}'s busbw")
            if parts:
                checks.append(f"{human(nbytes)}: " + "; ".join(parts))
    if checks:
        lines.append("")
        scope = "" if args.world_size == 2 else " (defined for world size 2)"
        lines.append(f"Targets{scope}:")
        lines += [f"- {c}" for c in checks]
    # Shared memory against OpenMPI's (world sizes 2 and 4): x = OpenMPI's time / ddp-shm's.
    shm, ompi = table.get("ddp-shm", {}), table.get("openmpi", {})
    shm_checks = []
    for nbytes, minimum, wording in (
            (1024, 1 / 1.5, "1 KiB: ddp-shm latency {t:.2f}× OpenMPI's (target ≤ 1.5×)"),
            (1 << 20, 1.0, "1 MiB: ddp-shm busbw {x:.2f}× OpenMPI's (target ≥ 1×)"),
            (64 << 20, 1.0, "64 MiB: ddp-shm busbw {x:.2f}× OpenMPI's (target ≥ 1×)")):
        if nbytes in shm and nbytes in ompi:
            x = ompi[nbytes]["time_us"] / shm[nbytes]["time_us"]
            shm_checks.append(wording.format(x=x, t=1 / x) + (": PASS" if x >= minimum else
                                                               ": FAIL"))
    if shm_checks:
        lines.append("")
        lines.append("Shared-memory targets (against OpenMPI's default transports):")
        lines += [f"- {c}" for c in shm_checks]
    print("\n".join(lines), flush=True)

    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"date": started.isoformat(), "world_size": args.world_size, "cpus": os.cpu_count(),
             "cpu_model": cpu_model(), "load_before": load_before,
             "load_after": load_after, "measured": measured, "errors": errors}, indent=1))
    real_errors = {p: e for p, e in errors.items()
                   if not e.startswith("not built") and not e.startswith("not installed")}
    return 1 if real_errors else 0


if __name__ == "__main__":
    sys.exit(main())
