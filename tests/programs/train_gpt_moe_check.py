#!/usr/bin/env python3
"""train-gpt (examples/gpt) with a mixture of experts in every block (--moe-experts 4 --top-k 2)
under ddprun, float64: at ep 2, dp 2 x ep 2, ep 2 x tp 2, ep 2 x pp 2 and ep 2 with
--activation-checkpointing the last line ("final loss=... param_sum=...") must equal the
one-process run's to 1e-9 (relative); with a capacity so small that tokens drop
(--capacity-factor 0.5) dp 2 x ep 2 must equal one process too, and differ from the run without
drops; the flags that do not fit are named. Usage: train_gpt_moe_check.py BUILD_BIN_DIR"""
import os
import re
import subprocess
import sys

EXPERTS = ("--moe-experts", "4", "--top-k", "2")
MOE = EXPERTS + ("--microbatches", "1", "--batch-size", "8")

LAYOUTS = [  # dp, ep, tp, pp, extra flags
    (1, 1, 1, 1, ()),
    (1, 2, 1, 1, ()),
    (2, 2, 1, 1, ()),
    (1, 2, 2, 1, ()),
    (1, 2, 1, 2, ("--schedule", "gpipe")),  # 1F1B needs a micro-batch per stage
    (1, 2, 1, 1, ("--activation-checkpointing",)),
]


def run(bin_dir, ranks, *args):
    command = [os.path.join(bin_dir, "ddprun"), "--standalone", "--nproc-per-node", str(ranks),
               os.path.join(bin_dir, "train-gpt"), "--steps", "6", "--log-every", "3",
               "--dtype", "float64", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


def final(bin_dir, dp, ep, tp, pp, *extra):
    done = run(bin_dir, dp * ep * tp * pp, *MOE, "--dp", str(dp), "--ep", str(ep), "--tp",
               str(tp), "--pp", str(pp), *extra)
    name = f"dp{dp} ep{ep} tp{tp} pp{pp}{''.join(' ' + e for e in extra)}"
    match = re.search(r"final loss=(\S+) param_sum=(\S+)", done.stdout)
    if done.returncode != 0 or not match:
        sys.exit(f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return name, (float(match.group(1)), float(match.group(2)))


def expect_equal(name, values, reference_name, reference):
    for want, got, what in zip(reference, values, ("loss", "param_sum")):
        if abs(got - want) > 1e-9 * abs(want):
            sys.exit(f"{name}: {what} {got!r} but {reference_name} has {want!r}")


def expect_refused(bin_dir, ranks, args, needle):
    done = run(bin_dir, ranks, *args)
    if done.returncode == 0 or needle not in done.stderr:
        sys.exit(f"{args} was not refused with '{needle}':\n{done.stdout}\n{done.stderr}")


def main():
    bin_dir = sys.argv[1]
    finals = dict(final(bin_dir, *layout[:4], *layout[4]) for layout in LAYOUTS)
    reference_name = next(iter(finals))
    for name, values in finals.items():
        expect_equal(name, values, reference_name, finals[reference_name])
    # Capacity ceil(0.5 * 128 tokens * 2 / 4) = 32 of an expert's share: tokens drop, alike.
    tight = "--capacity-factor", "0.5"
    one_name, one = final(bin_dir, 1, 1, 1, 1, *tight)
    split_name, split = final(bin_dir, 2, 2, 1, 1, *tight)
    expect_equal(split_name, split, one_name, one)
    if abs(one[0] - finals[reference_name][0]) < 1e-12:
        sys.exit("--capacity-factor 0.5 trained to the loss of no capacity: nothing dropped")
    expect_refused(bin_dir, 1, ("--moe-experts", "4", "--top-k", "5"),
                   "--top-k 5 must be at most --moe-experts 4")
    expect_refused(bin_dir, 2, ("--moe-experts", "3", "--ep", "2"),
                   "--moe-experts 3 is not divisible by --ep 2")
    expect_refused(bin_dir, 2, ("--ep", "2"), "--ep, --top-k and --capacity-factor need "
                   "--moe-experts")
    expect_refused(bin_dir, 2, MOE + ("--dp", "2", "--fsdp"), "--moe-experts with --fsdp")
    expect_refused(bin_dir, 4, EXPERTS + ("--ep", "4", "--batch-size", "6"),
                   "--batch-size 6 must split into --dp 1 x --ep 4 replicas")
    expect_refused(bin_dir, 2, MOE + ("--dp", "2", "--ep", "2"),
                   "--dp 2 x --ep 2 x --tp 1 x --pp 1 = 4 ranks, but the job has 2")
    print("ok:", finals, {one_name: one, split_name: split})


if __name__ == "__main__":
    main()
