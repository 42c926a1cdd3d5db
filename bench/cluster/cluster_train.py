#!/usr/bin/python3
"""DDP training-step time with each comm hook on a simulated cluster, ddp beside PyTorch 2.x.

    bench/cluster/cluster_train.py [--hosts 4] [--rates 100mbit,1gbit,10gbit] [--model mlp]
                                   [--configs ddp-none,ddp-fp16,...] [--powersgd-rank 4] [--steps 8]
                                   [--warmup 3] [--rounds 2] [--json FILE]

For every rate, brings up --hosts network-namespace hosts with scripts/cluster.sh (every link
shaped with tbf to the rate), runs one training-step benchmark per configuration on it, 1 rank
per host, and takes the cluster down again (also after a failure or Ctrl-C):
  ddp-none              ddp-train-bench --comm-hook none: DDP's allreduce of fp32 gradients
  ddp-fp16              --comm-hook fp16 (half the bytes)
  ddp-int8              --comm-hook int8 (an allgather of int8 values and a scale per rank)
  ddp-powersgd          --comm-hook powersgd --powersgd-rank R
  ddp-batched-powersgd  --comm-hook batched-powersgd --powersgd-rank R
  pytorch-none          bench/compare/pytorch_ddp_bench.py under PyTorch 2.x
                        (scripts/pytorch-python), gloo, no hook
  pytorch-fp16          the same with PyTorch's fp16_compress_hook
  pytorch-powersgd      the same with PyTorch's powerSGD_hook (PowerSGDState(rank R,
                        start_powerSGD_iter 2)) and --bucket-cap-mb 1000: PyTorch's hook fails
                        on gloo with more than one bucket (bench/compare/pytorch_ddp_bench.py
                        says why)
PowerSGD starts compressing at iteration 2 on both sides (inside the warm-up). The
configurations run one after the other, --rounds times, interleaved; each run reports the
slowest rank's median step time over --steps steps after --warmup; the table shows the median
over the rounds (the lower middle one for an even count: the faster of two). Finally, without
any network: the compute-only bound, --hosts single-process ddp-train-bench runs at once on this
machine (the same ranks-on-cores layout as the cluster run, with no communication at all), which
no hook can beat.

Prints the machine, the commands and a Markdown table per rate and the targets at 1gbit
(ddp-powersgd >= 3x faster than ddp-none, and faster than pytorch-powersgd); writes every
measurement to --json FILE (bench/cluster/plot_cluster.py draws it). Needs root (network
namespaces): exit 77 with the reason without it; 0 when every run worked, 1 when one failed (the
table marks it), 2 for bad arguments.
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # bench_common
from bench_common import (PYTORCH2_PYTHON, REPO, SKIPPED, Cluster, clean_environment, cpu_model,
                          load_average, parse_rate, tail, tool_version)

CONFIGS = ["ddp-none", "ddp-fp16", "ddp-int8", "ddp-powersgd", "ddp-batched-powersgd",
           "pytorch-none", "pytorch-fp16", "pytorch-powersgd"]
STEP_LINE = re.compile(r"step_ms=([0-9.]+) samples_per_s=([0-9.]+)(?:.*bytes_per_step=([0-9.]+))?")
POWERSGD_START_ITER = 2


def step_result(output):
    """(step_ms, bytes_per_step or None) from rank 0's last step_ms line, or None."""
    for line in reversed(output.splitlines()):
        match = STEP_LINE.search(line)
        if match:
            return float(match.group(1)), (float(match.group(3)) if match.group(3) else None)
    return None


class TrainBench:
    def __init__(self, args):
        self.args = args
        self.bin = Path(args.build_dir).resolve() / "bin"
        self.cluster = Cluster(self.bin.parent, args.prefix, args.hosts, mtu=args.mtu,
                               timeout=args.timeout)

    def common(self):
        a = self.args
        return ["--model", a.model, "--steps", str(a.steps), "--warmup", str(a.warmup),
                "--batch-size", str(a.batch_size)]

    def command(self, config):
        side, hook = config.split("-", 1)
        rank = ["--powersgd-rank", str(self.args.powersgd_rank), "--powersgd-start-iter",
                str(POWERSGD_START_ITER)]
        if side == "ddp":
            return [str(self.bin / "ddp-train-bench"), *self.common(), "--comm-hook", hook,
                    *(rank if "powersgd" in hook else [])]
        extra = rank + ["--bucket-cap-mb", "1000"] if hook == "powersgd" else []
        return [PYTORCH2_PYTHON, str(REPO / "bench" / "compare" / "pytorch_ddp_bench.py"),
                *self.common(), "--comm-hook", hook, *extra]

    def measure(self, config):
        """{'step_ms', 'bytes_per_step'} or an error text."""
        code, out = self.cluster.host_run(1, self.command(config))
        result = step_result(out)
        if code != 0 or result is None:
            # The whole output, every host's: the table keeps only its tail.
            print(f"# {config} failed (exit {code}); its output:\n{out}", file=sys.stderr,
                  flush=True)
            return None, f"failed (exit {code}): {tail(out)}"
        return {"step_ms": result[0], "bytes_per_step": result[1]}, None

    def compute_bound(self):
        """--hosts single-process runs at once on this machine: step_ms of the slowest."""
        argv = [str(self.bin / "ddprun"), "--standalone", "--nproc-per-node", "1",
                str(self.bin / "ddp-train-bench"), *self.common()]
        self.cluster.note([*argv, f"(x{self.args.hosts} at once)"])
        env = clean_environment(OMP_NUM_THREADS="1")
        procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
                 for _ in range(self.args.hosts)]
        steps, errors = [], []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=self.args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                out, _ = proc.communicate()
            result = step_result(out)
            if proc.returncode != 0 or result is None:
                errors.append(f"failed (exit {proc.returncode}): {tail(out)}")
            else:
                steps.append(result[0])
        if errors:
            return None, "; ".join(errors)
        return {"step_ms": max(steps), "per_process_step_ms": steps}, None


def median_round(rows):
    """The round whose step time is the median (the lower middle one for an even count)."""
    rows = sorted(rows, key=lambda r: r["step_ms"])
    return dict(rows[(len(rows) - 1) // 2], rounds_step_ms=[r["step_ms"] for r in rows])


def megabytes(nbytes):
    return "–" if nbytes is None else f"{nbytes / 1e6:.2f}"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--hosts", type=int, default=4, help="hosts, 1 rank each (default 4)")
    parser.add_argument("--rates", default="100mbit,1gbit,10gbit",
                        help="comma-separated link rates, tc syntax (default 100mbit,1gbit,10gbit)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn", "large"],
                        help="ddp-train-bench's model (default mlp, 20 M parameters); the "
                             "PyTorch peer has mlp and cnn")
    parser.add_argument("--powersgd-rank", type=int, default=4,
                        help="PowerSGD's matrix_approximation_rank on both sides (default 4)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=3,
                        help=f"untimed steps first (default 3; >= {POWERSGD_START_ITER}, so that "
                             "PowerSGD compresses every timed step)")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank (default 64)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of every configuration per rate, interleaved (default 2)")
    parser.add_argument("--no-compute-bound", action="store_true",
                        help="skip the compute-only bound")
    parser.add_argument("--mtu", type=int, default=1500, help="link MTU (default 1500)")
    parser.add_argument("--build-dir", default=os.environ.get("DDP_BUILD_DIR", str(REPO / "build")),
                        help="CMake build tree with bin/ddp-train-bench and bin/ddprun")
    parser.add_argument("--prefix", default="ddpct",
                        help="cluster.sh's DDP_CLUSTER_PREFIX for the bench's cluster (ddpct); "
                             "'{pid}' in it becomes this process's id (a cluster of its own)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run (default 600)")
    parser.add_argument("--json", help="also write every measurement to this file")
    args = parser.parse_args()
    args.prefix = args.prefix.replace("{pid}", str(os.getpid()))

    configs = args.configs.split(",")
    if unknown := [c for c in configs if c not in CONFIGS]:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(CONFIGS)}")
    if args.model == "large" and any(c.startswith("pytorch") for c in configs):
        parser.error("--model large: bench/compare/pytorch_ddp_bench.py has only mlp and cnn; pass "
                     "--configs without the pytorch-* ones")
    rates = [r.strip() for r in args.rates.split(",")]
    for r in rates:
        try:
            if parse_rate(r) == 0:
                raise argparse.ArgumentTypeError(f"'{r}': give a rate, not none")
        except argparse.ArgumentTypeError as e:
            parser.error(f"--rates: {e}")
    for value, name, low in ((args.hosts, "--hosts", 2), (args.steps, "--steps", 1),
                             (args.warmup, "--warmup", POWERSGD_START_ITER),
                             (args.rounds, "--rounds", 1), (args.powersgd_rank, "--powersgd-rank", 1),
                             (args.batch_size, "--batch-size", 1)):
        if value < low:
            parser.error(f"{name} must be at least {low}, got {value}")
    for program in ("ddp-train-bench", "ddprun"):
        if not (Path(args.build_dir) / "bin" / program).exists():
            parser.error(f"{args.build_dir}/bin/{program} does not exist: build it first "
                         f"(cmake --build {args.build_dir} --target ddp-train-bench ddprun) or "
                         "pass --build-dir")
    if any(c.startswith("pytorch") for c in configs) and subprocess.run(
            [PYTORCH2_PYTHON, "-c", "import torch"], capture_output=True).returncode != 0:
        parser.error("the pytorch-* configurations need PyTorch 2.x (scripts/pytorch-python): "
                     "run scripts/install-deps.sh, or pass --configs without them")
    if os.geteuid() != 0:
        print("cluster_train: needs root for the cluster's network namespaces; skipped",
              file=sys.stderr)
        return SKIPPED

    bench = TrainBench(args)
    if bench.cluster.status()[0] == 0:
        print(f"cluster_train: a cluster with prefix '{args.prefix}' is already up; take it down "
              f"(DDP_CLUSTER_PREFIX={args.prefix} scripts/cluster.sh down) or pass --prefix",
              file=sys.stderr)
        return 1

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = load_average()
    results = {}  # rate -> config -> row
    errors = {}  # "rate config" -> text
    retried = []  # runs that failed once and were run again: "rate config (round): error"
    interrupted = False
    try:
        for rate in rates:
            code, out = bench.cluster.up(rate)
            if code == SKIPPED:
                print(f"cluster_train: {out.strip()}", file=sys.stderr)
                return SKIPPED
            if code != 0:
                errors[f"{rate} cluster"] = f"up failed: {tail(out)}"
                continue
            try:
                rounds = {c: [] for c in configs}
                for round_index in range(args.rounds):
                    for config in configs:
                        if f"{rate} {config}" in errors:
                            continue
                        print(f"# {rate}: {config} (round {round_index + 1}/{args.rounds}) ...",
                              file=sys.stderr, flush=True)
                        row, err = bench.measure(config)
                        if err:
                            # A run that fails once is tried once more, and the report says so:
                            # PyTorch 2.15's gloo sometimes aborts a rank at exit on this
                            # loaded machine (CI saw it once), which says nothing of the step.
                            print(f"#   {err}; trying it once more", file=sys.stderr, flush=True)
                            retried.append(f"{rate} {config} (round {round_index + 1}): {err}")
                            row, err = bench.measure(config)
                        if err:
                            errors[f"{rate} {config}"] = err
                        else:
                            rounds[config].append(row)
                            print(f"#   step_ms {row['step_ms']:.1f}", file=sys.stderr, flush=True)
                results[rate] = {c: median_round(rows) for c, rows in rounds.items() if rows}
            finally:
                code, out = bench.cluster.down()
                if code != 0:
                    errors[f"{rate} cluster"] = f"down failed: {tail(out)}"
        bound = None
        if not args.no_compute_bound:
            print("# compute-only bound ...", file=sys.stderr, flush=True)
            bound, err = bench.compute_bound()
            if err:
                errors["compute bound"] = err
    except KeyboardInterrupt:
        interrupted = True
        bench.cluster.down()
        bound = None
    load_after = load_average()

    # --- report ---
    k = args.hosts
    commit = tool_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    torch2 = tool_version([PYTORCH2_PYTHON, "-c", "import torch; print(torch.__version__)"])
    lines = [f"# DDP training step with comm hooks on a simulated cluster: {k} hosts × 1 rank", ""]
    lines.append(f"- date: {started:%Y-%m-%d %H:%M} UTC; host {platform.node()}, kernel "
                 f"{platform.release()}")
    lines.append(f"- machine: {os.cpu_count()} CPUs ({cpu_model()}) shared by every host; load "
                 f"average {load_before} before, {load_after} after")
    lines.append(f"- ddp {commit}; peer: PyTorch {torch2} DDP on gloo (scripts/pytorch-python)")
    lines.append(f"- model {args.model}, batch {args.batch_size} per rank, 1 thread per rank, SGD "
                 f"momentum 0.9; {args.steps} timed steps after {args.warmup}; slowest rank's "
                 f"median; median of {args.rounds} interleaved round(s). PowerSGD rank "
                 f"{args.powersgd_rank} from iteration {POWERSGD_START_ITER} on both sides; "
                 "pytorch-powersgd with one bucket (bucket_cap_mb 1000)")
    lines.append(f"- links: tbf at the rate on every host's egress and its bridge port's egress, "
                 f"MTU {args.mtu}")
    lines.append("")
    header = ["config"] + [f"{r} step ms" for r in rates] + ["MB sent/step/rank"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|---|" + "|".join("---:" for _ in header[1:]) + "|")
    for config in configs:
        cells = [config]
        sent = None
        for rate in rates:
            row = results.get(rate, {}).get(config)
            cells.append(f"{row['step_ms']:.1f}" if row else "–")
            if row and row.get("bytes_per_step") is not None:
                sent = row["bytes_per_step"]
        cells.append(megabytes(sent))
        lines.append("| " + " | ".join(cells) + " |")
    if bound:
        lines.append(f"| compute-only bound ({k} processes, no network) | "
                     + " | ".join(f"{bound['step_ms']:.1f}" for _ in rates) + " | 0 |")
    lines.append("")
    # Speed-ups over ddp-none, per rate.
    lines.append("Speed-up over ddp-none (its step time / the config's):")
    for rate in rates:
        res = results.get(rate, {})
        base = res.get("ddp-none")
        if base:
            lines.append(f"- {rate}: " + ", ".join(
                f"{c} {base['step_ms'] / res[c]['step_ms']:.2f}×" for c in configs
                if c in res and c != "ddp-none"))
    lines.append("")
    summary = []
    target_rate = next((r for r in rates if parse_rate(r) == 1e9), None)
    if target_rate:
        res = results.get(target_rate, {})
        psgd, none, peer = (res.get(c) for c in ("ddp-powersgd", "ddp-none", "pytorch-powersgd"))
        if psgd and none:
            x = none["step_ms"] / psgd["step_ms"]
            summary.append(f"{target_rate}: ddp-powersgd (rank {args.powersgd_rank}) "
                           f"{psgd['step_ms']:.1f} ms vs ddp-none {none['step_ms']:.1f} ms = "
                           f"{x:.2f}× faster (target ≥ 3×): {'PASS' if x >= 3 else 'FAIL'}")
            if bound:
                summary.append(f"{target_rate}: the compute-only bound {bound['step_ms']:.1f} ms "
                               f"allows at most {none['step_ms'] / bound['step_ms']:.2f}× over "
                               "ddp-none")
        if psgd and peer:
            x = peer["step_ms"] / psgd["step_ms"]
            summary.append(f"{target_rate}: ddp-powersgd {x:.2f}× faster than pytorch-powersgd "
                           f"({peer['step_ms']:.1f} ms) (target > 1×): "
                           f"{'PASS' if x > 1 else 'FAIL'}")
    if summary:
        lines.append("Targets:")
        lines += [f"- {s}" for s in summary]
        lines.append("")
    for what, text in errors.items():
        lines.append(f"- {what}: {text}")
    for text in retried:
        lines.append(f"- failed once and was run again: {text}")
    if interrupted:
        lines.append("- interrupted (Ctrl-C): the table is partial")
    lines.append("")
    lines.append(f"Commands (DDP_CLUSTER_PREFIX={args.prefix}, OMP_NUM_THREADS=1):")
    lines += [f"- `{c}`" for c in bench.cluster.commands]
    print("\n".join(lines), flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": started.isoformat(), "hosts": k, "cpus": os.cpu_count(),
            "cpu_model": cpu_model(), "kernel": platform.release(), "load_before": load_before,
            "load_after": load_after, "model": args.model, "batch_size": args.batch_size,
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "powersgd_rank": args.powersgd_rank, "torch": torch2, "commit": commit,
            "rates": rates, "rate_bits": {r: parse_rate(r) for r in rates},
            "results": results, "compute_bound": bound, "errors": errors, "retried": retried,
            "commands": bench.cluster.commands}, indent=1))
    return 1 if errors or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
