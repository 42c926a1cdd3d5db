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

  python3 bench/scale.py --worlds 8,16,32,64,128,256 --before /tmp/before/build
  python3 bench/scale.py --quick           # world 4 (CTest bench.scale.quick)
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402

COLUMNS = ("startup_s", "fds_mean", "fds_max", "sockets_mean", "sockets_max", "rss_mib_mean",
           "sockets_after_alltoall_max")


def run_once(build, world, args):
    env = bench_common.clean_environment(DDP_QUIET="1", DDP_TIMEOUT=str(args.timeout))
    if args.transport != "auto":
        env["DDP_TRANSPORT"] = args.transport
    argv = [str(Path(build) / "bin" / "ddprun"), "--standalone", "--nproc-per-node", str(world),
            "--no-prefix", str(Path(build) / "bin" / "mesh-scale-probe"), "--sizes", args.sizes]
    if args.alltoall:
        argv.append("--alltoall")
    launched = time.time()
    code, output = bench_common.run(argv, env, args.timeout + 60)
    rows = [r for r in bench_common.json_rows(output) if r.get("world") == world]
    if code != 0 or not rows:
        return None, f"exit {code}: {bench_common.tail(output, 6)}"
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
    }, ""


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
    parser.add_argument("--quick", action="store_true", help="world 4, small sizes: seconds")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.sizes, args.alltoall, args.timeout = "4", "1,1000,100000", True, 60
    worlds = [int(w) for w in args.worlds.split(",")]
    builds = [("after", args.build)] + ([("before", args.before)] if args.before else [])

    print(f"# bench/scale.py: {time.strftime('%Y-%m-%d %H:%M')}, {bench_common.cpu_model()}, "
          f"load {bench_common.load_average()}, transport {args.transport}", flush=True)
    results = {}
    failed = False
    for world in worlds:
        for _ in range(args.rounds):
            for label, build in (builds if world % 2 == 0 else builds[::-1]):
                row, error = run_once(build, world, args)
                if row is None:
                    failed = True
                    print(f"# {label} world {world}: FAILED ({error})", flush=True)
                    continue
                results.setdefault((label, world), []).append(row)
                print(f"# {label} world {world}: start-up {row['startup_s']:.2f} s, sockets "
                      f"{row['sockets_mean']:.1f} mean / {row['sockets_max']:.0f} max", flush=True)

    header = ["world", "build"] + list(COLUMNS)
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    table = []
    for world in worlds:
        for label, _ in builds:
            rows = results.get((label, world))
            if not rows:
                print(f"| {world} | {label} | " + " | ".join("failed" for _ in COLUMNS) + " |")
                continue
            med = {c: statistics.median(r[c] for r in rows) for c in COLUMNS}
            table.append(dict(world=world, build=label, **med))
            cells = [f"{med['startup_s']:.2f}"] + [
                f"{med[c]:.1f}" if c.endswith("mean") else f"{med[c]:.0f}" for c in COLUMNS[1:]]
            print(f"| {world} | {label} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
