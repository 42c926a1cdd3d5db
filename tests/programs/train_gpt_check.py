#!/usr/bin/env python3
"""train-gpt (examples/gpt) under ddprun in several layouts of data, tensor and pipeline
parallelism, float64: every layout's last line ("final loss=... param_sum=...") must equal the
one-process run's to 1e-9 (relative), with and without --activation-checkpointing and --fsdp
(also with --fsdp-low-memory), and
with the interleaved and zero-bubble schedules (the interleaved one's flags that do not fit named)
and with context parallelism (--cp 2 alone and with tp, dp, pp and recomputation),
the loss must fall, and a mesh that does not fit the job (or --fsdp with --pp) must be named.
Checkpoints (PyTorch's DCP format): 5 steps at DP 2 x TP 2 x PP 2 saved, resumed at DP 1 x TP 2 x
PP 2, DP 1 x TP 2 x PP 1, DP 4 x TP 1 x PP 2 and in one process for 5 more, and 5 steps at DP 4 x
TP 1 x PP 2 resumed at DP 2 x TP 2 x PP 2, end where the uninterrupted runs end; a resume of
another model (fewer --layers) is named. With --fsdp (the same DCP folder): saved at DP 2 x TP 2,
resumed at DP 1 x TP 2 and DP 2 x TP 1 with --fsdp and at DP 1 x TP 2 x PP 2 without; a pipeline's
checkpoint resumed with --fsdp at another tp. A folder of the --fsdp layout before that (one
ShardedTrainState per tp rank, tests/data/train_gpt) resumes at its own --tp and any --dp, and
another --tp or no --fsdp is named. Usage: train_gpt_check.py BUILD_BIN_DIR"""
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Saved by train-gpt at a1e0f46 (before --fsdp saved DCP): tests/data/train_gpt/README.md.
OLD_FSDP = os.path.join(REPO, "tests", "data", "train_gpt",
                        "fsdp-sharded-train-state-dp2-tp2-step3.tar.gz")
OLD_SHAPE = ("--layers", "1", "--hidden", "16", "--heads", "2", "--block-size", "8",
             "--batch-size", "4")

LAYOUTS = [  # dp, tp, pp, schedule, micro-batches, extra flags
    (1, 1, 1, "1f1b", 1, ()),
    (1, 2, 1, "1f1b", 1, ()),
    (1, 1, 2, "gpipe", 2, ()),
    (2, 1, 2, "1f1b", 2, ()),
    (2, 2, 1, "gpipe", 2, ()),
    (2, 2, 2, "1f1b", 2, ()),
    # every block recomputed in backward (ddp::checkpoint): the same numbers, with the
    # tensor-parallel collectives run again inside the recomputation
    (1, 1, 1, "1f1b", 1, ("--activation-checkpointing",)),
    (2, 2, 1, "gpipe", 2, ("--activation-checkpointing",)),
    (1, 2, 2, "1f1b", 2, ("--activation-checkpointing",)),
    # FSDP over dp (each child built and sharded in turn), with tp (2-D), micro-batches
    # accumulated under no_sync, and with recomputation inside the sharded units
    (2, 1, 1, "1f1b", 1, ("--fsdp",)),
    (2, 2, 1, "1f1b", 2, ("--fsdp",)),
    (2, 2, 1, "1f1b", 1, ("--fsdp", "--activation-checkpointing")),
    # FSDP's low-memory backward: each parameter's gradient reduced as it is ready (and under
    # no_sync, the flat buffer all the same)
    (2, 2, 1, "1f1b", 1, ("--fsdp", "--fsdp-low-memory")),
    (2, 1, 1, "1f1b", 2, ("--fsdp", "--fsdp-low-memory")),
    # the interleaved schedule: two chunks of the model per pipeline rank, with dp, tp and
    # recomputation
    (1, 1, 2, "interleaved", 2, ("--virtual-stages", "2")),
    (2, 1, 2, "interleaved", 2, ("--virtual-stages", "2")),
    (1, 2, 2, "interleaved", 4, ("--virtual-stages", "2", "--activation-checkpointing")),
    # zero bubble: each backward split into input and weight passes
    (1, 1, 2, "zero-bubble", 2, ()),
    (2, 2, 2, "zero-bubble", 2, ()),
    (1, 1, 2, "zero-bubble", 4, ("--activation-checkpointing",)),
]


def run(bin_dir, ranks, *args, steps=10):
    command = [os.path.join(bin_dir, "ddprun"), "--standalone", "--nproc-per-node", str(ranks),
               os.path.join(bin_dir, "train-gpt"), "--steps", str(steps), "--dtype", "float64",
               *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


def layout(dp, tp, pp):
    return ("--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--microbatches", "2")


def expect_resumed(bin_dir, ranks, args, folder, reference, what, at_step=5, steps=10):
    """Resumes from `folder` with `args` at `ranks` ranks: the run must say it resumed at step
    `at_step` and end where the uninterrupted run (`reference`: loss, param_sum) ends, to 1e-9."""
    resumed = run(bin_dir, ranks, *args, "--checkpoint", folder, "--resume", steps=steps)
    match = re.search(r"final loss=(\S+) param_sum=(\S+)", resumed.stdout)
    if resumed.returncode != 0 or f"at step {at_step}" not in resumed.stdout or not match:
        sys.exit(f"{what}: failed:\n{resumed.stdout}\n{resumed.stderr}")
    for want, got, name in zip(reference, map(float, match.groups()), ("loss", "param_sum")):
        if abs(got - want) > 1e-9 * abs(want):
            sys.exit(f"{what}: {name} {got!r} but the uninterrupted run has {want!r}")


def main():
    bin_dir = sys.argv[1]
    finals = {}
    for dp, tp, pp, schedule, micro, extra in LAYOUTS:
        done = run(bin_dir, dp * tp * pp, "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
                   "--schedule", schedule, "--microbatches", str(micro), *extra)
        name = f"dp{dp} tp{tp} pp{pp} {schedule} m{micro}{''.join(' ' + e for e in extra)}"
        if done.returncode != 0:
            sys.exit(f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        match = re.search(r"final loss=(\S+) param_sum=(\S+)", done.stdout)
        if not match:
            sys.exit(f"{name}: no final line:\n{done.stdout}")
        finals[name] = (float(match.group(1)), float(match.group(2)))
        if (dp, tp, pp) == (1, 1, 1) and not extra:
            losses = [float(x) for x in re.findall(r"step \d+ loss (\S+)", done.stdout)]
            if len(losses) != 2 or not losses[1] < losses[0]:
                sys.exit(f"the loss did not fall: {losses}")
    reference_name = next(iter(finals))
    reference = finals[reference_name]
    for name, values in finals.items():
        for want, got, what in zip(reference, values, ("loss", "param_sum")):
            if abs(got - want) > 1e-9 * abs(want):
                sys.exit(f"{name}: {what} {got!r} but {reference_name} has {want!r}")
    # Context parallelism: each window's positions split over cp ranks, ring attention, alone and
    # with tp, dp, pp and recomputation.
    for ranks, flags in ((2, ("--cp", "2")), (4, ("--cp", "2", "--tp", "2")),
                         (4, ("--cp", "2", "--dp", "2")),
                         (4, ("--cp", "2", "--pp", "2", "--microbatches", "2")),
                         (2, ("--cp", "2", "--activation-checkpointing"))):
        done = run(bin_dir, ranks, *flags)
        match = re.search(r"final loss=(\S+) param_sum=(\S+)", done.stdout)
        if done.returncode != 0 or not match:
            sys.exit(f"{flags} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        finals[" ".join(flags)] = (float(match.group(1)), float(match.group(2)))
        for want, got, what in zip(reference, finals[" ".join(flags)], ("loss", "param_sum")):
            if abs(got - want) > 1e-9 * abs(want):
                sys.exit(f"{flags}: {what} {got!r} but {reference_name} has {want!r}")
    for ranks, flags, needle in (
            (3, ("--cp", "3"), "--block-size 16 does not split into 2 x --cp 3 = 6 equal chunks"),
            (4, ("--cp", "2", "--dp", "2", "--fsdp"), "--cp 2 with --fsdp: not built yet"),
            (2, ("--dp", "2", "--fsdp-low-memory"), "--fsdp-low-memory without --fsdp")):
        done = run(bin_dir, ranks, *flags)
        if done.returncode == 0 or needle not in done.stderr:
            sys.exit(f"{flags} was not refused with '{needle}':\n{done.stdout}\n{done.stderr}")
    done = run(bin_dir, 2, "--dp", "3")
    if done.returncode == 0 or "--dp 3 x --tp 1 x --pp 1 = 3 ranks, but the job has 2" not in done.stderr:
        sys.exit(f"a mesh that does not fit was not named:\n{done.stdout}\n{done.stderr}")
    with tempfile.TemporaryDirectory() as scratch:
        # Saved at one layout, resumed at others (each from its own copy: a resume saves too).
        for saved_at, resumed_at in (((2, 2, 2), ((1, 2, 2), (1, 2, 1), (4, 1, 2), (1, 1, 1))),
                                     ((4, 1, 2), ((2, 2, 2),))):
            folder = os.path.join(scratch, "dp{}tp{}pp{}".format(*saved_at))
            first = run(bin_dir, saved_at[0] * saved_at[1] * saved_at[2], *layout(*saved_at),
                        "--checkpoint", folder, steps=5)
            if first.returncode != 0 or not os.path.exists(os.path.join(folder, ".metadata")):
                sys.exit(f"the checkpointed run at {saved_at} failed:\n{first.stdout}\n"
                         f"{first.stderr}")
            for dp, tp, pp in resumed_at:
                copy = f"{folder}-to-dp{dp}tp{tp}pp{pp}"
                shutil.copytree(folder, copy)
                expect_resumed(bin_dir, dp * tp * pp, layout(dp, tp, pp), copy, reference,
                               f"saved at {saved_at}, resumed at {(dp, tp, pp)}")
        folder = os.path.join(scratch, "dp2tp2pp2")
        # The pipeline's checkpoint resumes under --fsdp at another layout.
        copy = os.path.join(scratch, "dp2tp2pp2-to-fsdp")
        shutil.copytree(folder, copy)
        expect_resumed(bin_dir, 2, ("--dp", "2", "--fsdp"), copy, reference,
                       "saved at (2, 2, 2), resumed with --fsdp at dp 2")
        other = run(bin_dir, 2, "--pp", "2", "--microbatches", "2", "--layers", "3",
                    "--checkpoint", folder, "--resume")
        if other.returncode == 0 or "holds 53 model tensors, this model 41" not in other.stderr:
            sys.exit(f"a resume of another model was not named:\n{other.stdout}\n{other.stderr}")
    for flags, needle in (
            (("--pp", "2", "--schedule", "interleaved", "--virtual-stages", "3"),
             "--layers 4 does not divide into --pp 2 x --virtual-stages 3 = 6 equal chunks"),
            (("--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
              "--microbatches", "1"), "--microbatches 1 is not a multiple of --pp 2"),
            (("--pp", "2", "--microbatches", "2", "--virtual-stages", "2"),
             "--virtual-stages 2 needs --schedule interleaved")):
        done = run(bin_dir, 2, *flags)
        if done.returncode == 0 or needle not in done.stderr:
            sys.exit(f"{flags} was not refused with '{needle}':\n{done.stdout}\n{done.stderr}")
    done = run(bin_dir, 2, "--pp", "2", "--microbatches", "2", "--fsdp")
    if done.returncode == 0 or "--fsdp with --pp 2: FSDP shards the model over --dp" not in done.stderr:
        sys.exit(f"--fsdp with --pp was not named:\n{done.stdout}\n{done.stderr}")
    with tempfile.TemporaryDirectory() as scratch:
        # --fsdp saves the same DCP folder as the pipeline: it resumes at another dp and tp, and
        # without --fsdp (each resume from its own copy: a resume saves too).
        folder = os.path.join(scratch, "fsdp-dp2tp2")
        first = run(bin_dir, 4, "--dp", "2", "--tp", "2", "--fsdp", "--checkpoint", folder, steps=5)
        if first.returncode != 0 or not os.path.exists(os.path.join(folder, ".metadata")):
            sys.exit(f"the checkpointed --fsdp run failed:\n{first.stdout}\n{first.stderr}")
        for flags in (("--dp", "1", "--tp", "2", "--fsdp"), ("--dp", "2", "--tp", "1", "--fsdp"),
                      ("--dp", "1", "--tp", "2", "--pp", "2", "--microbatches", "2")):
            copy = f"{folder}-to-{'-'.join(f.strip('-') for f in flags)}"
            shutil.copytree(folder, copy)
            world = 1
            for name, value in zip(flags, flags[1:]):
                if name in ("--dp", "--tp", "--pp"):
                    world *= int(value)
            expect_resumed(bin_dir, world, flags, copy, reference,
                           f"--fsdp saved at dp 2 x tp 2, resumed with {flags}")
    check_old_fsdp_folder(bin_dir)
    print("ok:", {name: values for name, values in finals.items()})


def check_old_fsdp_folder(bin_dir):
    """The fixture (3 steps at dp 2 x tp 2, one ShardedTrainState per tp rank) resumes at tp 2 and
    dp 1 or 2 to where 6 uninterrupted steps end; at tp 1, or without --fsdp, it is named."""
    if not os.path.exists("/usr/share/common-licenses/GPL-3"):
        print("skipped the old --fsdp folder: it was trained on /usr/share/common-licenses/GPL-3, "
              "which this machine lacks")
        return
    done = run(bin_dir, 1, *OLD_SHAPE, steps=6)
    match = re.search(r"final loss=(\S+) param_sum=(\S+)", done.stdout)
    if done.returncode != 0 or not match:
        sys.exit(f"the small model's uninterrupted run failed:\n{done.stdout}\n{done.stderr}")
    reference = tuple(map(float, match.groups()))
    with tempfile.TemporaryDirectory() as scratch:
        def fresh(name):
            target = os.path.join(scratch, name)
            with tarfile.open(OLD_FSDP) as archive:
                if hasattr(tarfile, "data_filter"):
                    archive.extractall(target, filter="data")
                else:
                    archive.extractall(target)
            return os.path.join(target, "oldfsdp")
        for dp in (1, 2):
            expect_resumed(bin_dir, dp * 2, OLD_SHAPE + ("--dp", str(dp), "--tp", "2", "--fsdp"),
                           fresh(f"dp{dp}"), reference,
                           f"the old --fsdp folder resumed at dp {dp} x tp 2", at_step=3, steps=6)
        for flags, words in ((("--tp", "1", "--fsdp"), "resume with the --tp and --fsdp it was saved "
                              "with"),
                             (("--tp", "2"), "was saved with --fsdp (ShardedTrainState folders")):
            other = run(bin_dir, 2 if "2" in flags else 1, *OLD_SHAPE, *flags, "--checkpoint",
                        fresh("-".join(flags)), "--resume", steps=6)
            if other.returncode == 0 or words not in other.stderr:
                sys.exit(f"the old --fsdp folder resumed with {flags} was not named:\n"
                         f"{other.stdout}\n{other.stderr}")


if __name__ == "__main__":
    main()
