#!/usr/bin/env python3
"""Start-up at scale: what a job of N ranks on this machine costs before its first collective.

For each world size, launches `ddprun --standalone --nproc-per-node N mesh-scale-probe` (one
process per rank, oversubscribed on a small machine) and reports, from rank 0's JSON line:
start-up (launch of ddprun to the first allreduce done on the last rank), descriptors and sockets
open per rank after it (mean and max; rank 0 also holds the store's connections), resident memory
per rank, and after an alltoall (--alltoall: every peer connected, also a lazily connected mesh).
The probe then checks allreduces of several sizes; a wrong element fails the run.

With --before DIR (another build tree with bin/ddprun and bin/mesh-scale-probe, e.g. of an older
commit), each world runs on both builds, alternated over --rounds, and the table puts the medians
side by side.

With --peer gloo2, each world also runs PyTorch's own: `torch.distributed.run --standalone
--nproc-per-node N bench/probes/gloo_scale_probe.py` (init_process_group("gloo"), the same
measurements) under PyTorch 2.x (scripts/pytorch-python), alternated with the ddp runs; its
start-up counts from the launch of torch.distributed.run too (so it includes `import torch` in
every rank). Its medians
and the ratio of the start-ups are extra columns. A world it cannot reach (time-out, a rank
killed, exit status not 0) shows "did not start" and the reason, and does not fail the table
(except under --quick, where the peer's tiny form is under test). Every PyTorch rank holds about
300 MiB of private memory (import torch: ~290 MiB anonymous with 2.15), so gloo is not attempted
above --peer-max-world, nor where the ranks and the launcher would not fit in the memory available
now. Without PyTorch 2.x it is left out with a note (exit status unchanged).

  python3 bench/probes/scale.py --worlds 8,16,32,64,128,256 --before /tmp/before/build
  python3 bench/probes/scale.py --worlds 8,16,32,64 --peer gloo2
  python3 bench/probes/scale.py --quick    # world 4, and gloo2 where PyTorch 2.x is (CTest
                                           # bench.scale.quick)
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # bench_common
import bench_common  # noqa: E402

COLUMNS = ("startup_s", "fds_mean", "fds_max", "sockets_mean", "sockets_max", "rss_mib_mean",
           "sockets_after_alltoall_max")
# The peer's columns: (key, heading, format).
PEER_COLUMNS = (("startup_s", "gloo2 start-up s", "{:.2f}"),
                ("init_s", "gloo2 init s", "{:.2f}"),
                ("sockets_mean", "gloo2 sockets/rank", "{:.1f}"),
                ("fds_mean", "gloo2 fds/rank", "{:.1f}"),
                ("rss_mib_mean", "gloo2 RSS MiB/rank", "{:.0f}"),
                ("private_mib_mean", "gloo2 private MiB/rank", "{:.0f}"))
PEER = "gloo2"
PEER_RANK_MIB = 300  # private memory of one PyTorch 2.15 rank here, until a run measures it
PROBE = Path(__file__).resolve().parent / "gloo_scale_probe.py"


def measure(argv, env, world, timeout, describe):
    """Runs one job; (row, "") from rank 0's JSON line, or (None, describe(exit code, output))."""
    launched = time.time()
    code, output = bench_common.run(argv, env, timeout + 60)
    rows = [r for r in bench_common.json_rows(output) if r.get("world") == world]
    if code != 0 or not rows:
        return None, describe(code, output)
    r = rows[0]
    if r["wrong"] != 0:
        return None, f"{r['wrong']:.0f} wrong elements"
    return {
        "startup_s": r["first_collective_done"] - launched,
        "fds_mean": r["fds_mean"],
        "fds_max": r["fds_max"],
        "sockets_mean": r["sockets_mean"],
        "sockets_max": r["sockets_max"],
        "rss_mib_mean": r["rss_kib_mean"] / 1024,
        "sockets_after_alltoall_max": r["sockets_after_alltoall_max"],
        "private_mib_mean": r.get("private_kib_mean", -1024) / 1024,
        "init_s": r.get("init_s", -1),
        "private_mib_max": r.get("private_kib_max", -1024) / 1024,
    }, ""


def ddp_failure(code, output):
    return f"exit {code}: {bench_common.tail(output, 6)}"


def gloo_failure(code, output):
    """Why torch.distributed.run failed, in one line for the table: the first exception of a
    rank (the root cause; ChildFailedError is the launcher's summary), a rank killed by a signal
    other than the launcher's SIGTERM (SIGKILL: out of memory), the time-out; else the last lines."""
    lines = [line.strip() for line in output.splitlines()
             if line.strip() and not set(line.strip()) <= set("=-")]
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)
              and "ChildFailedError" not in line]
    signals = [line for line in lines if re.search(r"Signal \d+ \(SIG(?!TERM)", line)]
    timeouts = [line for line in lines if "killed after" in line]
    why = "; ".join(errors[:1] + signals[:1] + timeouts) or "; ".join(lines[-3:])
    return f"exit {code}: {why}".replace("|", "/")


def run_ddp(build, world, args):
    env = bench_common.clean_environment(DDP_QUIET="1", DDP_TIMEOUT=str(args.timeout))
    if args.transport != "auto":
        env["DDP_TRANSPORT"] = args.transport
    argv = [str(Path(build) / "bin" / "ddprun"), "--standalone", "--nproc-per-node", str(world),
            "--no-prefix", str(Path(build) / "bin" / "mesh-scale-probe"), "--sizes", args.sizes]
    if args.alltoall:
        argv.append("--alltoall")
    return measure(argv, env, world, args.timeout, ddp_failure)


def run_gloo(world, args):
    env = bench_common.clean_environment(OMP_NUM_THREADS="1")
    argv = [bench_common.PYTORCH2_PYTHON, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(world), str(PROBE), "--sizes", args.sizes,
            "--timeout", str(args.timeout)]
    if args.alltoall:
        argv.append("--alltoall")
    row, error = measure(argv, env, world, args.timeout, gloo_failure)
    if row is None and args.quick:
        # PyTorch 2.x now and then aborts at exit (see compare_ddp.py): once more before the tiny
        # form calls the probe broken.
        print(f"# {PEER} world {world} failed once ({error}); running it again", flush=True)
        row, error = measure(argv, env, world, args.timeout, gloo_failure)
    return row, error


def pytorch2():
    """(PyTorch 2.x's version, "") or (None, why it cannot run)."""
    try:
        out = subprocess.run([bench_common.PYTORCH2_PYTHON, "-c",
                              "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    if out.returncode != 0:
        return None, (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
    return out.stdout.strip(), ""


def available_mib():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def not_attempted(world, rank_mib, args):
    """Why gloo is not tried at this world ("" when it is): world ranks and the launcher, each a
    PyTorch process, against --peer-max-world and 90% of the memory available now."""
    need_gib = (world + 1) * rank_mib / 1024
    free_gib = available_mib() / 1024
    if world <= args.peer_max_world and need_gib <= 0.9 * free_gib:
        return ""
    why = (f"above --peer-max-world {args.peer_max_world}" if world > args.peer_max_world else
           f"{free_gib:.1f} GiB available")
    return (f"not attempted: {world + 1} python processes of PyTorch need about {need_gib:.1f} GiB "
            f"here ({rank_mib:.0f} MiB private each; {why})")


def cells(values, columns):
    return [fmt.format(values[key]) for key, _, fmt in columns]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=str(bench_common.REPO / "build"),
                        help="build tree with bin/ddprun and bin/mesh-scale-probe (default build/)")
    parser.add_argument("--before", help="a second build tree to compare with (e.g. an older commit)")
    parser.add_argument("--worlds", default="8,16,32,64,128,256", help="comma-separated world sizes")
    parser.add_argument("--rounds", type=int, default=1, help="runs per world and build (median)")
    parser.add_argument("--sizes", default="1,1000,100000,1000000",
                        help="float32 counts of the allreduces checked after the measurement")
    parser.add_argument("--alltoall", action="store_true",
                        help="also run an alltoall and count sockets after it")
    parser.add_argument("--transport", choices=("auto", "tcp"), default="auto",
                        help="DDP_TRANSPORT of the ranks (auto: shared memory on one host)")
    parser.add_argument("--timeout", type=int, default=300, help="DDP_TIMEOUT and run limit, s")
    parser.add_argument("--peer", choices=("none", PEER),
                        help="also run PyTorch 2.x's gloo (bench/probes/gloo_scale_probe.py) at "
                             "every world (default: gloo2 under --quick, none otherwise)")
    parser.add_argument("--peer-max-world", type=int, default=128,
                        help="largest world the peer is attempted at (default 128)")
    parser.add_argument("--quick", action="store_true",
                        help="world 4, small sizes, and gloo2 where PyTorch 2.x is: seconds")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.sizes, args.alltoall, args.timeout = "4", "1,1000,100000", True, 60
        args.peer = args.peer or PEER
    worlds = [int(w) for w in args.worlds.split(",")]
    runners = [("after", args.build)] + ([("before", args.before)] if args.before else [])

    print(f"# bench/probes/scale.py: {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{bench_common.cpu_model()}, load {bench_common.load_average()}, "
          f"transport {args.transport}", flush=True)
    peer = args.peer == PEER
    if peer:
        version, why = pytorch2()
        if version:
            print(f"# peer {PEER}: PyTorch {version} gloo ({bench_common.PYTORCH2_PYTHON}, "
                  f"torch.distributed.run --standalone, OMP_NUM_THREADS=1)", flush=True)
            runners.append((PEER, None))
        else:
            print(f"# {PEER} not measured: no PyTorch 2.x at {bench_common.PYTORCH2_PYTHON} "
                  f"({why})", flush=True)
            peer = False
    results = {}
    peer_why = {}  # world -> why the peer has no row there
    rank_mib = PEER_RANK_MIB
    failed = False
    for world in worlds:
        if peer:
            peer_why[world] = not_attempted(world, rank_mib, args)
            if peer_why[world]:
                print(f"# {PEER} world {world}: {peer_why[world]}", flush=True)
        for _ in range(args.rounds):
            for label, build in (runners if world % 2 == 0 else runners[::-1]):
                if label == PEER:
                    if peer_why[world]:
                        continue  # not attempted, or did not start in an earlier round
                    row, error = run_gloo(world, args)
                else:
                    row, error = run_ddp(build, world, args)
                if row is None:
                    if label == PEER:
                        peer_why[world] = f"did not start ({error})"
                        failed = failed or args.quick
                    else:
                        failed = True
                    print(f"# {label} world {world}: FAILED ({error})", flush=True)
                    continue
                results.setdefault((label, world), []).append(row)
                if label == PEER:
                    rank_mib = max(rank_mib, row["private_mib_max"])
                print(f"# {label} world {world}: start-up {row['startup_s']:.2f} s, sockets "
                      f"{row['sockets_mean']:.1f} mean / {row['sockets_max']:.0f} max", flush=True)

    builds = [r for r in runners if r[0] != PEER]
    header = ["world", "build"] + list(COLUMNS)
    if peer:
        header += [heading for _, heading, _ in PEER_COLUMNS] + [f"{PEER}/ddp start-up"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    table = []
    for world in worlds:
        peer_med = None
        if peer and results.get((PEER, world)):
            rows = results[(PEER, world)]
            peer_med = {c: statistics.median(r[c] for r in rows)
                        for c in COLUMNS + ("private_mib_mean", "init_s")}
            table.append(dict(world=world, build=PEER, **peer_med))
        for label, _ in builds:
            rows = results.get((label, world))
            if not rows:
                line = ["failed"] * len(COLUMNS)
                med = None
            else:
                med = {c: statistics.median(r[c] for r in rows) for c in COLUMNS}
                table.append(dict(world=world, build=label, **med))
                line = [f"{med['startup_s']:.2f}"] + [
                    f"{med[c]:.1f}" if c.endswith("mean") else f"{med[c]:.0f}" for c in COLUMNS[1:]]
            if peer and peer_med:
                line += cells(peer_med, PEER_COLUMNS)
                line.append(f"{peer_med['startup_s'] / med['startup_s']:.0f}x" if med else "-")
            elif peer:
                line += [peer_why.get(world) or "failed"] + ["-"] * len(PEER_COLUMNS)
            print(f"| {world} | {label} | " + " | ".join(line) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
