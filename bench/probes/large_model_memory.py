#!/usr/bin/env python3
"""A model larger than one process, built and trained with FSDP: `train-gpt --fsdp` at world W
(FULL_SHARD over dp, each block built and sharded in turn, AdamW) with --layers GptBlocks of
--hidden, and the peak resident memory its largest rank adds (train-gpt's build_added_mb before
the first step, peak_added_mb over the run) against the formulas of docs/sharding.md:

  construction   <= (shard + one unit) x 1.1          shard = 4P/W bytes, unit = 4U bytes
  training step  <= 16P/W (DDP's 16P, / W) + one unit's gather (4U) + activations

P: the model's parameters (12h^2 + 13h per block, the embeddings and the head); U: the largest
unit's (one block). Prints a table with the model's size, both peaks, both bounds and the step
time. Usage:

  python3 bench/probes/large_model_memory.py --build build [--world 4] [--hidden 2048]
      [--layers 20] [--steps 3]        (about 4 GiB of float32 parameters: 1.0e9)
      [--low-memory] [--no-env-tuning] [--activations]

--activations runs the job again at half the batch and counts the activations (with their
gradients) as twice the peak's growth from there: what the bound's "+ activations" is, measured.
The bound is then also given with the gradient autograd produces for the largest parameter (4h x h:
it exists beside the unit's parameters while its Linear's backward runs, whatever FSDP does).
--no-env-tuning: ddprun leaves glibc's malloc as it is (its tuning keeps up to 1 GiB of freed
memory per rank for speed, which a rank's peak then includes).

--quick: a tiny model, for CI (the program keeps running; the numbers are not judged).
"""
import argparse
import os
import re
import subprocess
import sys

VOCAB = 96  # --vocab-at-least: the vocabulary, whatever the text's characters (fewer than 96)
TIMING = re.compile(r"median_step_ms=([0-9.]+) .*peak_added_mb=([-0-9.]+) "
                    r"build_added_mb=([-0-9.]+)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--low-memory", action="store_true",
                        help="train-gpt --fsdp-low-memory: nothing in flight, gradients reduced "
                             "per parameter")
    parser.add_argument("--no-env-tuning", action="store_true",
                        help="ddprun --no-env-tuning: glibc's malloc returns freed memory")
    parser.add_argument("--activations", action="store_true",
                        help="also run at half the batch and measure the activations")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=int, default=3600)
    args = parser.parse_args()
    if args.quick:
        args.world, args.hidden, args.heads, args.layers, args.steps = 2, 64, 4, 2, 2
    h, block = args.hidden, args.block_size
    unit = 12 * h * h + 13 * h
    parameters = args.layers * unit + VOCAB * h + block * h + 2 * h + VOCAB * h
    step_ms, peak_added, build_added = run(args, args.batch_size)
    mib = 1 << 20
    shard, one_unit = 4 * parameters / args.world / mib, 4 * unit / mib
    build_bound = (shard + one_unit) * 1.1
    step_bound = 16 * parameters / args.world / mib + one_unit
    activations = None
    if args.activations:
        _, half_peak, _ = run(args, args.batch_size // 2)
        activations = 2 * (peak_added - half_peak)
    print(f"train-gpt --fsdp, world {args.world}: {parameters / 1e9:.3f}e9 float32 parameters "
          f"({4 * parameters / (1 << 30):.2f} GiB), {args.layers} blocks of {h} "
          f"({one_unit:.0f} MiB each)")
    print("| what (the largest rank) | measured MiB | bound MiB | formula |")
    print("|---|---|---|---|")
    print(f"| building and sharding | {build_added:.0f} | {build_bound:.0f} | (shard {shard:.0f} "
          f"+ one unit {one_unit:.0f}) x 1.1 |")
    print(f"| a training step (AdamW) | {peak_added:.0f} | {step_bound:.0f} + activations | "
          f"16P/W {16 * parameters / args.world / mib:.0f} + one unit {one_unit:.0f} |")
    if activations is not None:
        largest = 4 * 4 * h * h / mib  # the MLP's 4h x h weight
        print(f"| a training step, activations measured | {peak_added:.0f} | "
              f"{step_bound + activations:.0f} | + activations {activations:.0f} (2 x the peak's "
              f"growth from batch {args.batch_size // 2}) |")
        print(f"| the same, with the largest parameter's gradient | {peak_added:.0f} | "
              f"{step_bound + activations + largest:.0f} | + {largest:.0f} |")
    print(f"median step: {step_ms:.0f} ms; DDP would hold 16P = {16 * parameters / mib:.0f} MiB "
          f"per rank")


def run(args, batch_size):
    """train-gpt's median step (ms), the peak its largest rank adds and the peak of building."""
    h = args.hidden
    command = [os.path.join(args.build, "bin", "ddprun"), "--standalone", "--nproc-per-node",
               str(args.world)]
    if args.no_env_tuning:
        command.append("--no-env-tuning")
    command += [os.path.join(args.build, "bin", "train-gpt"), "--fsdp",
                "--dp", str(args.world), "--hidden", str(h), "--heads", str(args.heads),
                "--layers", str(args.layers), "--block-size", str(args.block_size),
                "--batch-size", str(batch_size), "--steps", str(args.steps), "--time-after", "1",
                "--vocab-at-least", str(VOCAB), "--log-every", str(10 ** 6)]
    if args.low_memory:
        command.append("--fsdp-low-memory")
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    match = TIMING.search(done.stdout)
    if done.returncode != 0 or not match:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return tuple(map(float, match.groups()))


if __name__ == "__main__":
    main()
