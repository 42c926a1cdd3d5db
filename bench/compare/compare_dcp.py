#!/usr/bin/python3
"""ddp's distributed checkpoint against PyTorch 2.15's dcp, side by side in one run (issue 53).

The same model on both sides: --params float32 parameters in 8 layers with their two Adam
moments (three times --params in all), sharded by rows over the saving world (FSDP's layout,
DTensor Shard(0)), plus a step value. Each round runs, alternating the two sides:
  save at --world (sync, async: the stall and the total, and the copy bound);
  save of a replicated model at --world (DDP's layout, --params / world parameters on every
  rank; ddp with and without its replica check);
  load at --world (the same layout), and at each of --reshard-worlds (resharding);
every side reading its own checkpoint (the crossings are tested in CI, not timed here).
The table gives medians over the rounds, the ratios and the issue's targets:
  save and load each <= 1.0x PyTorch's; a resharding load <= 1.2x a same-layout load; the
  asynchronous stall <= 0.2x the synchronous save; the peak memory a load adds <= one chunk.

  python3 bench/compare/compare_dcp.py --build-dir build --params 268435456 --rounds 3
  python3 bench/compare/compare_dcp.py --build-dir build --quick     # CI's tiny form

Exit 0 with the table (the numbers are not judged); 1 when a run fails.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def parse(line):
    return {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", line)}


def last_line(command, what, timeout):
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [l for l in done.stdout.splitlines() if "phase=" in l]
    if done.returncode != 0 or not lines:
        sys.exit(f"compare_dcp: {what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                 f"{done.stderr[-3000:]}")
    return parse(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    parser.add_argument("--python", default=os.path.join(REPO, "scripts", "pytorch-python"))
    parser.add_argument("--params", type=int, default=1 << 26)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reshard-worlds", default="2,3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: /tmp)")
    parser.add_argument("--quick", action="store_true",
                        help="CI: 65536 parameters, one round, saved at world 2 and resharded "
                             "to world 3 only")
    parser.add_argument("--timeout", type=int, default=1800)
    args = parser.parse_args()
    reshard = [int(w) for w in args.reshard_worlds.split(",") if w]
    if args.quick:  # the two sides' programs and every phase, at the smallest size (world 2:
        # each PyTorch rank is a Python process that imports torch, seconds apiece on CI)
        args.params, args.rounds, args.world, reshard = 1 << 16, 1, 2, [3]
    probe = subprocess.run([args.python, "-c", "import torch.distributed.checkpoint.state_dict_saver"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"SKIPPED: {args.python} has no torch.distributed.checkpoint (run "
              f"scripts/install-deps.sh): {probe.stderr.strip()[-300:]}")
        return 77
    bin_dir = os.path.join(args.build_dir, "bin")
    work = tempfile.mkdtemp(prefix="compare-dcp-", dir=args.dir)
    results = {}  # (side, what) -> [values]

    def record(side, what, values):
        for key, value in values.items():
            results.setdefault((side, what, key), []).append(value)

    try:
        for _ in range(args.rounds):
            for side in ("ddp", "pytorch"):
                folder = os.path.join(work, side)
                shutil.rmtree(folder, ignore_errors=True)
                common = ["--dir", folder, "--params", str(args.params)]
                for phase, world in [("save", args.world), ("load", args.world)] + \
                        [("load", w) for w in reshard] + [("replicas", args.world)]:
                    # The replicated save alternates checked and unchecked saves in one
                    # process: three of each, whose median skips the first save's outlier.
                    inner = common + ["--rounds", "3" if phase == "replicas" else "1"]
                    if side == "ddp":
                        command = [os.path.join(bin_dir, "ddprun"), "--standalone",
                                   "--nproc-per-node", str(world),
                                   os.path.join(bin_dir, "dcp-bench"), "--phase", phase] + inner
                    else:
                        command = [args.python, os.path.join(HERE, "pytorch_dcp_bench.py"),
                                   "--phase", phase, "--world", str(world)] + inner
                    record(side, f"{phase}@{world}",
                           last_line(command, f"{side} {phase} at world {world}", args.timeout))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def m(side, what, key):
        values = results.get((side, what, key))
        if not values:
            sys.exit(f"compare_dcp: the {side} run of {what} printed no {key}")
        return statistics.median(values)

    w = args.world
    gib = m("ddp", f"save@{w}", "bytes") / (1 << 30)
    print(f"compare_dcp: {args.params} parameters + Adam = {gib:.3f} GiB at world {w}, "
          f"medians of {args.rounds} rounds (ms)")
    print("| measure | ddp | PyTorch 2.15 | ddp / PyTorch | target |")
    print("|---|---:|---:|---:|---|")
    rows = [("save (sync)", f"save@{w}", "save_ms", "<= 1.0x"),
            ("async save: stall", f"save@{w}", "async_stall_ms", ""),
            ("async save: to the commit", f"save@{w}", "async_total_ms", ""),
            ("copy bound (the rank's tensors into touched buffers)", f"save@{w}", "copy_ms", ""),
            (f"load at world {w} (same layout)", f"load@{w}", "load_ms", "<= 1.0x")]
    rows += [(f"load at world {r} (resharding)", f"load@{r}", "load_ms", "") for r in reshard]
    rows += [(f"save of a replicated model (DDP's layout: {m('ddp', f'replicas@{w}', 'bytes') / (1 << 20):.1f} MiB on each rank; ddp compares the replicas)",
              f"replicas@{w}", "save_ms", "")]
    for label, what, key, target in rows:
        d, p = m("ddp", what, key), m("pytorch", what, key)
        print(f"| {label} | {d:.1f} | {p:.1f} | {d / p if p else float('nan'):.2f}x | {target} |")
    raw = m("ddp", f"save@{w}", "raw_write_ms")
    print(f"raw write of the same bytes (each rank one file, synced, all ranks at once): "
          f"{raw:.1f} ms; ddp's sync save / raw write = {m('ddp', f'save@{w}', 'save_ms') / raw:.2f}")
    checked = m("ddp", f"replicas@{w}", "save_ms")
    print(f"ddp replica check: replicated save {checked:.1f} ms checked, "
          f"{m('ddp', f'replicas@{w}', 'unchecked_save_ms'):.1f} ms with check_replicas = false "
          f"({checked / m('ddp', f'replicas@{w}', 'unchecked_save_ms'):.2f}x)")
    same = m("ddp", f"load@{w}", "load_ms")
    sync = m("ddp", f"save@{w}", "save_ms")
    print(f"ddp async stall / ddp sync save: {m('ddp', f'save@{w}', 'async_stall_ms') / sync:.3f} "
          f"(target <= 0.2)")
    for r in reshard:
        print(f"ddp load at world {r} / at world {w}: {m('ddp', f'load@{r}', 'load_ms') / same:.2f}"
              f" (target <= 1.2)")
        print(f"ddp peak added by a load at world {r}: "
              f"{m('ddp', f'load@{r}', 'peak_added_mb'):.1f} MiB, largest chunk "
              f"{m('ddp', f'load@{r}', 'largest_chunk_mb'):.1f} MiB (target: at most one chunk); "
              f"PyTorch {m('pytorch', f'load@{r}', 'peak_added_mb'):.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
