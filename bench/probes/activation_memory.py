#!/usr/bin/python3
"""Activation checkpointing's memory and time on train-gpt (docs/sharding.md, issue 52).

    bench/probes/activation_memory.py [--build-dir build] [--world 1] [--rounds 3]
                                      [--layers 8] [--hidden 64] [--heads 4] [--block-size 128]
                                      [--batch-size 64] [--steps 5] [--time-after 2]
                                      [--timeout 900]

Runs train-gpt (under `ddprun --standalone --nproc-per-node W` when --world > 1, data-parallel)
without and with --activation-checkpointing, alternating, --rounds times each, at a shape where
activations dominate (a long block and a large batch over a narrow model), and prints a markdown
table of the medians of its timing line: the step time, the largest rank's peak resident memory
(VmHWM) and that peak minus the resident memory before the model was built (peak_added_mb: the
model, its gradients, AdamW's state and the activations), with the ratios of the checkpointed run
to the plain one. Issue 52 asks for peak ≤ 0.5x and step ≤ 1.4x (one more forward). Both runs must
end on the same `final loss=... param_sum=...` line: checkpointing changes no number.

Exit status 0 when every run succeeded and the final lines agree (whatever the ratios: this is a
measurement, not a test), 1 otherwise. Standard library only.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

TIMING = re.compile(r"median_step_ms=([0-9.]+) samples_per_s=[0-9.]+ peak_rss_mb=([0-9.]+) "
                    r"peak_added_mb=([-0-9.]+)")
FINAL = re.compile(r"final loss=(\S+) param_sum=(\S+)")


def run(args, checkpointing):
    binary = os.path.join(args.build_dir, "bin", "train-gpt")
    command = [binary]
    if args.world > 1:
        command = [os.path.join(args.build_dir, "bin", "ddprun"), "--standalone",
                   "--nproc-per-node", str(args.world), binary, "--dp", str(args.world)]
    command += ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads",
                str(args.heads), "--block-size", str(args.block_size), "--batch-size",
                str(args.batch_size), "--steps", str(args.steps), "--time-after",
                str(args.time_after), "--log-every", str(args.steps)]
    if checkpointing:
        command.append("--activation-checkpointing")
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    timing, final = TIMING.search(done.stdout), FINAL.search(done.stdout)
    if done.returncode != 0 or not timing or not final:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return [float(x) for x in timing.groups()], final.groups()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", default="build")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--time-after", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.world < 1 or args.rounds < 1 or not 0 <= args.time_after < args.steps:
        sys.exit("--world and --rounds must be at least 1, --time-after in [0, --steps)")

    results = {False: [], True: []}
    finals = set()
    for _ in range(args.rounds):
        for checkpointing in (False, True):
            values, final = run(args, checkpointing)
            results[checkpointing].append(values)
            finals.add(final)
    if len(finals) != 1:
        sys.exit(f"the runs ended on different final lines: {sorted(finals)}")

    medians = {k: [statistics.median(v[i] for v in runs) for i in range(3)]
               for k, runs in results.items()}
    print(f"train-gpt --layers {args.layers} --hidden {args.hidden} --heads {args.heads} "
          f"--block-size {args.block_size} --batch-size {args.batch_size} at world {args.world}, "
          f"medians of {args.rounds} alternating runs; final line {finals.pop()}")
    print()
    print("| run | step ms | peak RSS MiB | peak added MiB |")
    print("| --- | ---: | ---: | ---: |")
    for checkpointing, name in ((False, "plain"), (True, "--activation-checkpointing")):
        step, peak, added = medians[checkpointing]
        print(f"| {name} | {step:.1f} | {peak:.1f} | {added:.1f} |")
    plain, checkpointed = medians[False], medians[True]
    ratio = lambda i: checkpointed[i] / plain[i] if plain[i] > 0 else float("nan")
    print(f"| ratio (checkpointed / plain) | {ratio(0):.3f} | {ratio(1):.3f} | {ratio(2):.3f} |")


if __name__ == "__main__":
    main()
