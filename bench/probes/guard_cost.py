#!/usr/bin/env python3
"""What DDP's divergence guard costs a training step: ddp-train-bench under ddprun, world 2, with
the guard off (--divergence-check-every 0) and at its default, alternated run by run (ABBA) in one
run on the same machine; plus, per model, one --check-costs run that times the guard's parts
(the per-forward 4-byte allgather and one full comparison) and prints their share of a step.

    python3 bench/probes/guard_cost.py --build build --rounds 5

Prints per model: the median step_ms of each mode, after/before, the spread over the rounds
((max - min) / median, the noise this run can resolve), and the parts' estimate. Exit 1 when a
run fails. --quick: one round of three steps per mode and model (CI's form; numbers not judged).
"""
import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # bench_common
from bench_common import clean_environment, cpu_model, load_average, run, tail  # noqa: E402

STEP = re.compile(r"step_ms=([0-9.]+) samples_per_s=([0-9.]+)")
COSTS = re.compile(r"check_divergence_ms=([0-9.]+) guard_flag_us=([0-9.]+) guard_every=([0-9.]+) "
                   r"guard_ms_per_step=([0-9.]+) guard_share_of_step=([0-9.]+) step_ms=([0-9.]+)")
MODES = {"off": ["--divergence-check-every", "0"], "default": []}


def train(args, model, extra):
    argv = [str(args.build / "bin" / "ddprun"), "--standalone", "--nproc-per-node", "2",
            str(args.build / "bin" / "ddp-train-bench"), "--model", model, "--steps",
            str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
            *extra]
    env = clean_environment(DDP_TRANSPORT=args.transport)
    env.pop("DDP_DIVERGENCE_CHECK_EVERY", None)
    code, output = run(argv, env, args.timeout)
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {code}: {tail(output)}")
    return output


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, default=Path("build"), help="CMake build tree")
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--transport", default="auto", help="DDP_TRANSPORT (auto: shm)")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.batch_size = 1, 3, 1, 16
    args.build = args.build.resolve()
    print(f"# guard_cost: {cpu_model()}, load average {load_average()} at start; world 2, "
          f"DDP_TRANSPORT={args.transport}, {args.rounds} rounds of {args.steps} steps")
    failed = False
    for model in args.models.split(","):
        times = {mode: [] for mode in MODES}
        try:
            for r in range(args.rounds):
                order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    match = STEP.findall(train(args, model, MODES[mode]))
                    times[mode].append(float(match[-1][0]))
            costs = COSTS.search(train(args, model, ["--check-costs"]))
        except RuntimeError as error:
            print(f"{model}: FAILED: {error}")
            failed = True
            continue
        off, on = statistics.median(times["off"]), statistics.median(times["default"])
        spread = max((max(v) - min(v)) / statistics.median(v) for v in times.values())
        print(f"{model}: step_ms off {off:.2f} default {on:.2f} ratio {on / off:.4f} "
              f"spread {spread:.3f}")
        if costs:
            check_ms, flag_us, every, guard_ms, share, step_ms = map(float, costs.groups())
            print(f"{model}: parts: flag allgather {flag_us:.1f} us per forward, one comparison "
                  f"{check_ms:.3f} ms every {every:.0f} forwards = {guard_ms:.4f} ms per step = "
                  f"{100 * share:.3f} % of a {step_ms:.2f} ms step")
        else:
            print(f"{model}: no --check-costs line")
            failed = True
    print(f"# load average {load_average()} at end")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
