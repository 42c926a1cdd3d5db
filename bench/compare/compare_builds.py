#!/usr/bin/python3
"""Before and after: allreduce and DDP training-step times of two builds of ddp, alternated.

    bench/compare/compare_builds.py --before DIR --after DIR [--rounds 5] [--sizes 1K,64K,1M,16M]
                                    [--models mlp,cnn] [--steps 20] [--warmup-steps 3] [--iters 200]
                                    [--warmup 20] [--transports shm,tcp]
                                    [--benchmarks allreduce,train] [--cases NAME,...] [--no-mpi]
                                    [--timeout 600] [--quick] [--json-out FILE]

DIR is a CMake build tree with bin/ddprun, bin/ddp-bench and bin/ddp-train-bench, e.g. a change
against the commit before it:

    git worktree add --detach ../wt-base <commit>
    cmake -S ../wt-base -B ../wt-base/build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \\
          -DDDP_BUILD_TESTS=OFF
    cmake --build ../wt-base/build --target ddp-bench ddp-train-bench ddprun
    bench/compare/compare_builds.py --before ../wt-base/build --after build

Measures, at world size 2 with both ranks on this host, each build under its own bin/ddprun:
  allreduce ring-shm   ddp-bench --backend ring under ddprun, DDP_TRANSPORT=auto (shared memory)
  allreduce ring-tcp   the same with DDP_TRANSPORT=tcp (loopback TCP)
  allreduce mpi        ddp-bench --backend mpi under mpirun -np 2 --bind-to none, as
                       bench/compare/compare_allreduce.py runs its ddp-mpi peer (left out, with a
                       note, when mpirun is missing or a build has no mpi backend)
  train MODEL-shm      ddp-train-bench --model MODEL under ddprun, DDP_TRANSPORT=auto, as
                       bench/compare/compare_ddp.py runs it (batch 64 per rank)
  train MODEL-tcp      the same with DDP_TRANSPORT=tcp
(--cases picks some of these by name, e.g. --cases mpi,cnn-tcp.)
The allreduce is float32 sum with blocking calls; a run's time for a size is ddp-bench's time_us:
the median over --iters iterations (after --warmup), each started after a barrier, of the slowest
rank's time. A training run's time is ddp-train-bench's step_ms: the slowest rank's median step
over --steps steps (after --warmup-steps). OMP_NUM_THREADS=1; the variables of an enclosing
launcher (RANK, DDP_TRANSPORT, ...) are left out, and each run gets its own DDP_TRANSPORT.

Every round runs every case on both builds back to back, the before build first in odd rounds
and the after build first in even ones (ABBA), so that a drift of the machine (another job, the
CPU's clock, the page cache) falls on both alike. Per case the tables give each build's median
over the rounds, its spread (the largest minus the smallest round, in % of its median) and the
ratio after/before of the medians (> 1: the after build is slower). A ratio is noise when it
differs from 1 by no more than the larger of the two spreads; the last line names the cases
slower beyond that, or says that every ratio is within it. Five rounds or more give spreads
worth judging by; --quick (1 round, sizes 1K,64K, 20 iterations, 3 steps after 1 warm-up step)
only shows that both builds and this driver run (CI), and has no spread to judge by. Run on a
quiet machine: the load average before and after is printed.

Prints Markdown. Exit 0 when every run succeeded, whatever the times; 1 when a run failed (the
table marks it, and the case is not run again); 2 for bad arguments.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # bench_common
from bench_common import (clean_environment, cpu_model, human, json_rows, load_average,
                          parse_size, run, tail, tool_version)
from compare_allreduce import MPIRUN, free_port  # noqa: E402

# As bench/compare/compare_ddp.py reads it.
STEP_LINE = re.compile(r"step_ms=([0-9.]+) samples_per_s=([0-9.]+)")
TRANSPORTS = {"shm": "auto", "tcp": "tcp"}  # --transports -> DDP_TRANSPORT
BENCHMARKS = ("allreduce", "train")
PROGRAMS = ("ddprun", "ddp-bench", "ddp-train-bench")


class Build:
    """One build tree: its programs, and what it was built from (for the report)."""

    def __init__(self, label, path):
        self.label = label
        self.dir = Path(path).resolve()
        self.bin = self.dir / "bin"
        self.cache = {}
        try:
            for line in (self.dir / "CMakeCache.txt").read_text().splitlines():
                if "=" in line and ":" in line.split("=", 1)[0] and not line.startswith("//"):
                    key, value = line.split("=", 1)
                    self.cache[key.split(":", 1)[0]] = value
        except OSError:
            pass

    def missing(self):
        return [p for p in PROGRAMS if not (self.bin / p).exists()]

    def build_type(self):
        return self.cache.get("CMAKE_BUILD_TYPE") or "unknown"

    def source(self):
        """'<dir> <commit>[ + uncommitted changes]' of the source tree the build was made from."""
        src = self.cache.get("CMAKE_HOME_DIRECTORY")
        if not src:
            return "source unknown"
        commit = tool_version(["git", "-C", src, "rev-parse", "--short", "HEAD"])
        try:
            # --no-optional-locks: never take the index lock of a tree someone is working in.
            changes = subprocess.run(
                ["git", "--no-optional-locks", "-C", src, "status", "--porcelain",
                 "--untracked-files=no"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            changes = ""
        return f"{src} at {commit}" + (" + uncommitted changes" if changes.strip() else "")

    def describe(self):
        return f"{self.dir} ({self.build_type()}; from {self.source()})"

    def foreign_libraries(self, env):
        """The libddp_* libraries that this build's programs would load from outside its tree
        (e.g. through LD_LIBRARY_PATH, which overrides their RUNPATH), as ldd resolves them."""
        foreign = set()
        for program in PROGRAMS:
            try:
                out = subprocess.run(["ldd", str(self.bin / program)], env=env,
                                     capture_output=True, text=True, timeout=60).stdout
            except (OSError, subprocess.TimeoutExpired):
                return []
            for match in re.finditer(r"(libddp_\S+) => (\S+)", out):
                if not Path(match.group(2)).resolve().is_relative_to(self.dir):
                    foreign.add(f"{match.group(1)} => {match.group(2)}")
        return sorted(foreign)


class Case:
    """One thing measured on both builds: an allreduce (a row per size) or a training step."""

    def __init__(self, benchmark, name, **params):
        self.benchmark = benchmark
        self.name = name
        self.params = params
        self.values = {"before": [], "after": []}  # per round: {key: time} (key: bytes or None)
        self.raw = {"before": [], "after": []}  # per round: rows or step line (--json-out)
        self.error = None  # the first failure; the case is then not run again
        self.skipped = None  # why it is not measured at all (not an error)


class Runner:
    def __init__(self, args):
        self.args = args
        self.env = clean_environment(OMP_NUM_THREADS="1")
        # Each build's programs find their own libddp_comm/libddp_torch by RUNPATH; a directory
        # of LD_LIBRARY_PATH holding another copy would win over it, on both sides alike.
        paths = self.env.get("LD_LIBRARY_PATH", "").split(":")
        self.dropped = [p for p in paths if p and any(Path(p).glob("libddp_*.so*"))]
        if self.dropped:
            self.env["LD_LIBRARY_PATH"] = ":".join(p for p in paths if p not in self.dropped)
        self.mpirun = [*MPIRUN, "--bind-to", "none"]
        self.sizes = ",".join(str(s) for s in args.sizes)
        self.commands = []  # every distinct command line, for the report

    def note(self, argv, env):
        text = f"DDP_TRANSPORT={env['DDP_TRANSPORT']} " if "DDP_TRANSPORT" in env else ""
        text += " ".join(argv)
        if text not in self.commands:
            self.commands.append(text)

    def ddprun(self, build):
        return [str(build.bin / "ddprun"), "--standalone", "--nproc-per-node", "2"]

    def allreduce(self, build, case):
        """{bytes: row} of one ddp-bench run, or raises RunError."""
        bench_args = ["--backend", case.params["backend"], "--op", "allreduce", "--dtype",
                      "float32", "--reduce-op", "sum", "--sizes", self.sizes, "--iters",
                      str(self.args.iters), "--warmup", str(self.args.warmup), "--json"]
        bench = str(build.bin / "ddp-bench")
        if case.params["backend"] == "ring":
            argv = [*self.ddprun(build), bench, *bench_args]
            env = dict(self.env, DDP_TRANSPORT=case.params["transport"])
        else:
            # The rendezvous store still needs a port; a free one, not the default 29500.
            env = dict(self.env, DDP_TRANSPORT="auto", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()))
            argv = [*self.mpirun, "-np", "2", "-x", "OMP_NUM_THREADS", "-x", "DDP_TRANSPORT",
                    "-x", "MASTER_ADDR", "-x", "MASTER_PORT", bench, *bench_args]
        self.note(argv, env)
        code, output = run(argv, env, self.args.timeout)
        if case.params["backend"] == "mpi" and code == 2 and "not available" in output:
            raise NotBuilt(f"{build.label} has no mpi backend")
        rows = json_rows(output)
        if code != 0 or sorted(r.get("bytes") for r in rows) != sorted(self.args.sizes):
            raise RunError(f"exit {code}, {len(rows)} of {len(self.args.sizes)} rows: "
                           f"{tail(output)}")
        return {r["bytes"]: r["time_us"] for r in rows}, rows

    def train(self, build, case):
        """{None: step_ms} of one ddp-train-bench run, or raises RunError."""
        argv = [*self.ddprun(build), str(build.bin / "ddp-train-bench"), "--model",
                case.params["model"], "--steps", str(self.args.steps), "--warmup",
                str(self.args.warmup_steps), "--batch-size", str(self.args.batch_size)]
        env = dict(self.env, DDP_TRANSPORT=case.params["transport"])
        self.note(argv, env)
        code, output = run(argv, env, self.args.timeout)
        lines = [m for m in map(STEP_LINE.search, output.splitlines()) if m]
        if code != 0 or not lines:
            raise RunError(f"exit {code}, {'a' if lines else 'no'} step_ms line: {tail(output)}")
        step_ms, samples = float(lines[-1].group(1)), float(lines[-1].group(2))
        return {None: step_ms}, {"step_ms": step_ms, "samples_per_s": samples}

    def measure(self, build, case):
        if case.benchmark == "allreduce":
            return self.allreduce(build, case)
        return self.train(build, case)


class RunError(Exception):
    pass


class NotBuilt(Exception):
    pass


def make_cases(args):
    cases = []
    if "allreduce" in args.benchmarks:
        for transport in args.transports:
            cases.append(Case("allreduce", f"ring-{transport}", backend="ring",
                              transport=TRANSPORTS[transport]))
        if not args.no_mpi:
            case = Case("allreduce", "mpi", backend="mpi")
            if not shutil.which(MPIRUN[0]):
                case.skipped = f"{MPIRUN[0]} not found"
            cases.append(case)
    if "train" in args.benchmarks:
        for model in args.models:
            for transport in args.transports:
                cases.append(Case("train", f"{model}-{transport}", model=model,
                                  transport=TRANSPORTS[transport]))
    return cases


def summary(values):
    """(median, spread in % of it, min, max) of one build's per-round times; None if none."""
    if not values:
        return None
    med = statistics.median(values)
    return med, 100 * (max(values) - min(values)) / med if med else 0.0, min(values), max(values)


def fmt_time(t):
    return f"{t:.2f}" if t < 10 else f"{t:.1f}"


def judge(before, after, rounds):
    """(ratio, noise %, verdict) for one row, from the two summaries."""
    ratio = after[0] / before[0]
    noise = max(before[1], after[1])
    if rounds < 2:
        return ratio, noise, "–"
    delta = 100 * (ratio - 1)
    if delta > noise:
        return ratio, noise, f"slower: +{delta:.1f}% > {noise:.1f}%"
    if -delta > noise:
        return ratio, noise, f"faster: {delta:.1f}% beyond {noise:.1f}%"
    return ratio, noise, "noise"


def table(cases, benchmark, rounds, unit, keys_of, label_of, header):
    """Markdown lines of one benchmark's table; returns (lines, slower, faster, failed)."""
    lines = ["| " + " | ".join(header + [f"before {unit}", "spread", f"after {unit}", "spread",
                                          "after/before", "verdict"]) + " |",
             "|" + "|".join([":---"] * len(header) + ["---:"] * 5 + [":---"]) + "|"]
    slower, faster, failed = [], [], []
    for case in (c for c in cases if c.benchmark == benchmark):
        if case.skipped:
            lines.append("| " + " | ".join(label_of(case, None) + ["–"] * 5 +
                                           [f"not measured: {case.skipped}"]) + " |")
            continue
        for key in keys_of(case):
            b = summary([r[key] for r in case.values["before"] if key in r])
            a = summary([r[key] for r in case.values["after"] if key in r])
            cells = label_of(case, key)
            if not a or not b:
                failed.append(" ".join(label_of(case, key)))
                lines.append("| " + " | ".join(
                    cells + [fmt_time(b[0]) if b else "–", f"{b[1]:.1f}%" if b else "–",
                             fmt_time(a[0]) if a else "–", f"{a[1]:.1f}%" if a else "–", "–",
                             "failed"]) + " |")
                continue
            ratio, noise, verdict = judge(b, a, rounds)
            spread_b, spread_a = (f"{b[1]:.1f}%", f"{a[1]:.1f}%") if rounds > 1 else ("–", "–")
            what = f"{benchmark} {' '.join(cells)} {ratio:.3f}× (spread {noise:.1f}%)"
            if verdict.startswith("slower"):
                slower.append(what)
            elif verdict.startswith("faster"):
                faster.append(what)
            lines.append("| " + " | ".join(cells + [fmt_time(b[0]), spread_b, fmt_time(a[0]),
                                                    spread_a, f"{ratio:.3f}", verdict]) + " |")
    return lines, slower, faster, failed


def split_list(values):
    return [w for v in values for w in v.split(",") if w]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--before", required=True, help="build tree of the baseline")
    parser.add_argument("--after", required=True, help="build tree of the change")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds (default 5; each runs every case on both)")
    parser.add_argument("--sizes", default="1K,64K,1M,16M",
                        help="allreduce sizes, K/M/G suffixes (default 1K,64K,1M,16M)")
    parser.add_argument("--models", nargs="+", default=["mlp,cnn"],
                        help="ddp-train-bench models, comma- or space-separated (default mlp,cnn)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps (default 20)")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="untimed training steps first (default 3)")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank (default 64)")
    parser.add_argument("--iters", type=int, default=200,
                        help="timed allreduce iterations per size (default 200)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed allreduce iterations per size first (default 20)")
    parser.add_argument("--transports", default="shm,tcp",
                        help="comma-separated subset of shm,tcp (default both)")
    parser.add_argument("--benchmarks", default="allreduce,train",
                        help="comma-separated subset of allreduce,train (default both)")
    parser.add_argument("--no-mpi", action="store_true", help="leave out the mpi allreduce")
    parser.add_argument("--cases",
                        help="only these cases, comma-separated, of ring-shm, ring-tcp, mpi and "
                             "MODEL-shm, MODEL-tcp (e.g. mpi,cnn-tcp)")
    parser.add_argument("--timeout", type=int, default=600,
                        help="seconds per program run (default 600)")
    parser.add_argument("--quick", action="store_true",
                        help="1 round, sizes 1K,64K, 20 iterations after 5, 3 steps after 1: "
                             "that it runs, not what it measures (CI)")
    parser.add_argument("--json-out", help="also write every round's measurements to this file")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.sizes, args.iters, args.warmup = 1, "1K,64K", 20, 5
        args.steps, args.warmup_steps = 3, 1
    try:
        args.sizes = [parse_size(w) for w in args.sizes.split(",")]
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    args.sizes = sorted({max(1, s // 4) * 4 for s in args.sizes})  # what float32 moves
    args.models = split_list(args.models)
    args.transports = args.transports.split(",")
    args.benchmarks = args.benchmarks.split(",")
    for value, name, low in ((args.rounds, "--rounds", 1), (args.steps, "--steps", 1),
                             (args.warmup_steps, "--warmup-steps", 0), (args.iters, "--iters", 1),
                             (args.warmup, "--warmup", 0), (args.batch_size, "--batch-size", 1),
                             (args.timeout, "--timeout", 1)):
        if value < low:
            parser.error(f"{name} must be at least {low}, got {value}")
    if bad := [t for t in args.transports if t not in TRANSPORTS]:
        parser.error(f"unknown transport(s) {', '.join(bad)}; choose from shm, tcp")
    if bad := [b for b in args.benchmarks if b not in BENCHMARKS]:
        parser.error(f"unknown benchmark(s) {', '.join(bad)}; choose from allreduce, train")
    builds = {"before": Build("before", args.before), "after": Build("after", args.after)}
    for build in builds.values():
        if missing := build.missing():
            parser.error(f"{build.bin} lacks {', '.join(missing)}: build them first (cmake "
                         f"--build {build.dir} --target ddp-bench ddp-train-bench ddprun)")

    cases = make_cases(args)
    if args.cases:
        names = args.cases.split(",")
        if unknown := [n for n in names if n not in [c.name for c in cases]]:
            parser.error(f"--cases: no case {', '.join(unknown)} among "
                         f"{', '.join(c.name for c in cases)}")
        cases = [c for c in cases if c.name in names]
    runner = Runner(args)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = load_average()
    for index in range(args.rounds):
        order = ("before", "after") if index % 2 == 0 else ("after", "before")
        for case in cases:
            for side in order:
                if case.error or case.skipped:
                    break
                print(f"# round {index + 1}/{args.rounds}: {case.benchmark} {case.name} "
                      f"{side} ...", file=sys.stderr, flush=True)
                try:
                    values, raw = runner.measure(builds[side], case)
                except NotBuilt as e:
                    case.skipped = str(e)
                    # A round that measured one side only is dropped.
                    for s in order:
                        del case.values[s][index:], case.raw[s][index:]
                    break
                except RunError as e:
                    case.error = f"{side}: {e}"
                    print(f"# FAILED: {case.benchmark} {case.name} {case.error}", file=sys.stderr,
                          flush=True)
                    break
                case.values[side].append(values)
                case.raw[side].append(raw)
    load_after = load_average()

    lines = [f"# Before/after: {builds['after'].dir} against {builds['before'].dir}", ""]
    lines.append(f"- date: {started:%Y-%m-%d %H:%M} UTC; host {platform.node()}")
    lines.append(f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), load average "
                 f"{load_before} before, {load_after} after")
    for side, build in builds.items():
        lines.append(f"- {side}: {build.describe()}")
    if runner.dropped:
        lines.append(f"- left out of LD_LIBRARY_PATH (they hold libddp_*): "
                     f"{', '.join(runner.dropped)}")
    for side, build in builds.items():
        if foreign := build.foreign_libraries(runner.env):
            lines.append(f"- WARNING: the {side} build's programs load {', '.join(foreign)}, "
                         "not their own tree's")
    if builds["before"].build_type() != builds["after"].build_type():
        lines.append(f"- WARNING: the builds differ in CMAKE_BUILD_TYPE "
                     f"({builds['before'].build_type()} against "
                     f"{builds['after'].build_type()}): the comparison is not like for like")
    if builds["before"].dir == builds["after"].dir:
        lines.append("- note: --before and --after are the same build (an A/A run: every "
                     "ratio is noise)")
    lines.append(f"- method: world size 2 on this host; {args.rounds} "
                 f"round{'s' if args.rounds > 1 else ''}, each running "
                 "every case on both builds back to back, the before build first in odd rounds "
                 "and the after build first in even ones; per build the median over rounds, "
                 "spread = (max - min) / median over rounds; after/before > 1: the after build "
                 "is slower; noise: |after/before - 1| ≤ the larger spread")
    slower, faster, failed = [], [], []
    if any(c.benchmark == "allreduce" for c in cases):
        lines += ["", f"## Allreduce, float32 sum, blocking: µs (median of {args.iters} "
                      f"iterations after {args.warmup}, slowest rank)", ""]
        t, s, f, x = table(cases, "allreduce", args.rounds, "µs",
                           lambda c: args.sizes,
                           lambda c, key: [c.name, human(key) if key else "–"],
                           ["backend", "size"])
        lines += t
        slower, faster, failed = slower + s, faster + f, failed + x
    if any(c.benchmark == "train" for c in cases):
        lines += ["", f"## DDP training step: ms (ddp-train-bench, median of {args.steps} steps "
                      f"after {args.warmup_steps}, batch {args.batch_size} per rank, slowest "
                      "rank)", ""]
        t, s, f, x = table(cases, "train", args.rounds, "ms", lambda c: [None],
                           lambda c, key: [c.params["model"],
                                           "shm" if c.params["transport"] == "auto" else "tcp"],
                           ["model", "transport"])
        lines += t
        slower, faster, failed = slower + s, faster + f, failed + x
    errors = [c for c in cases if c.error]
    if errors or any(c.skipped for c in cases):
        lines.append("")
    for case in cases:
        if case.error:
            lines.append(f"- FAILED {case.benchmark} {case.name}: {case.error}")
        elif case.skipped:
            lines.append(f"- not measured: {case.benchmark} {case.name}: {case.skipped}")
    lines += ["", "Commands (DIR: each build's tree):", ""]
    for command in runner.commands:
        for build in builds.values():
            command = command.replace(str(build.dir), "DIR")
        if f"    {command}" not in lines:
            lines.append(f"    {command}")
    lines.append("")
    if args.rounds < 2:
        verdict = ("Verdict: none: 1 round has no spread to judge a ratio by (use --rounds 5 or "
                   "more)")
    elif slower:
        verdict = f"Verdict: slower beyond the spread: {'; '.join(slower)}"
    else:
        verdict = ("Verdict: every ratio within the spread (noise): no regression measured"
                   if not failed else "Verdict: every ratio compared is within the spread "
                   "(noise)")
    if args.rounds >= 2 and faster:
        verdict += f". Faster beyond the spread: {'; '.join(faster)}"
    if failed:
        verdict += f". Not compared (a run failed): {'; '.join(failed)}"
    lines.append(verdict)
    print("\n".join(lines), flush=True)

    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "date": started.isoformat(), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "load_before": load_before, "load_after": load_after,
            "builds": {side: {"dir": str(b.dir), "source": b.source(),
                              "build_type": b.build_type()} for side, b in builds.items()},
            "options": {"rounds": args.rounds, "sizes": args.sizes, "iters": args.iters,
                        "warmup": args.warmup, "models": args.models, "steps": args.steps,
                        "warmup_steps": args.warmup_steps, "batch_size": args.batch_size,
                        "transports": args.transports},
            "cases": [{"benchmark": c.benchmark, "name": c.name, "params": c.params,
                       "before": c.raw["before"], "after": c.raw["after"], "error": c.error,
                       "skipped": c.skipped} for c in cases],
            "slower": slower, "faster": faster, "failed": failed}, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
