#!/usr/bin/python3
"""Memory per rank of each sharding strategy against the ZeRO formulas (docs/sharding.md).

    bench/probes/sharding_memory.py [--worlds 2,4]
                                    [--variants ddp,ddp-view,zero1,zero1-view,zero2,fsdp]
                                    [--optimizer adam|chunked-adam|sgd] [--model large]
                                    [--build-dir build] [--batch-size 8] [--steps 3] [--warmup 1]
                                    [--no-env-tuning] [-- ddp-train-bench ARG ...]

Runs `ddprun --standalone --nproc-per-node W ddp-train-bench --model M --optimizer O --sharding S`
for every world size and variant, one after another ("-view" adds --gradient-as-bucket-view: DDP's
gradients are views of its buckets instead of a second copy; ":OPTIMIZER" runs that variant with
another --optimizer, e.g. zero1:chunked-adam), and prints a markdown table of the
largest rank's two measures beside the formula of each:

  state_mem_mb  resident memory right after the last optimizer step (parameters, gradients and
                optimizer state all live, freed temporaries given back) minus the resident memory
                before the model was built; formula: the model state of the table in
                docs/sharding.md (Adam: DDP 16Ψ, stage 1 8Ψ + 8Ψ/W, stage 2 4Ψ + 12Ψ/W, stage 3
                16Ψ/W; SGD with momentum: 12Ψ, 8Ψ + 4Ψ/W, 4Ψ + 8Ψ/W, 12Ψ/W; bytes)
  peak_mem_mb   peak resident memory (VmHWM) minus the same baseline; formula: the same plus, for
                stage 3, the largest unit's parameters (4 bytes each), as the issue states it

and the peak against DDP's (the first variant's at the same W, when that is ddp): what decides an
out-of-memory. --no-env-tuning is ddprun's (malloc returns freed memory at once; by default
ddprun tells glibc to keep it, for speed); the arguments after -- go to ddp-train-bench (e.g.
--param-dtype bfloat16, --keep-free-heap).

Ψ and the largest unit come from the bench's own first line. Exit status 0 when every run
succeeded (whatever the ratios: this is a measurement, not a test), 1 otherwise. Standard library
only.
"""
import argparse
import os
import re
import subprocess
import sys

FIRST = re.compile(r"params=(\d+) largest_unit_params=(\d+)")
LAST = re.compile(r"step_ms=([0-9.]+) .*peak_mem_mb=([0-9.]+) state_mem_mb=([0-9.]+)")
MIB = 1024.0 * 1024.0


def state_formula(sharding, optimizer, params, world):
    """Model-state bytes per rank, and the formula's text."""
    state = 8 if optimizer in ("adam", "chunked-adam") else 4  # state bytes per parameter
    if sharding == "ddp":
        return (8 + state) * params, f"{8 + state}Ψ"
    if sharding == "zero1":
        return 8 * params + state * params / world, f"8Ψ + {state}Ψ/W"
    if sharding == "zero2":
        return 4 * params + (4 + state) * params / world, f"4Ψ + {4 + state}Ψ/W"
    return (8 + state) * params / world, f"{8 + state}Ψ/W"


def parse_variant(variant, default_optimizer):
    """(sharding, view, optimizer) of 'SHARDING[-view][:OPTIMIZER]'."""
    name, _, optimizer = variant.partition(":")
    sharding, _, view = name.partition("-")
    return sharding, view, optimizer or default_optimizer


def run(args, world, variant):
    sharding, view, optimizer = parse_variant(variant, args.optimizer)
    argv = [os.path.join(args.build_dir, "bin", "ddprun")]
    if args.no_env_tuning:
        argv.append("--no-env-tuning")
    argv += ["--standalone", "--nproc-per-node",
            str(world), os.path.join(args.build_dir, "bin", "ddp-train-bench"), "--model",
            args.model, "--optimizer", optimizer, "--sharding", sharding, "--batch-size",
            str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if view == "view":
        argv.append("--gradient-as-bucket-view")
    argv += args.bench_args
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.timeout)
    first = FIRST.search(proc.stdout)
    last = LAST.search(proc.stdout)
    if proc.returncode != 0 or not first or not last:
        sys.stdout.write(proc.stdout[-2000:])
        return None
    return dict(params=int(first.group(1)), unit=int(first.group(2)),
                step_ms=float(last.group(1)), peak=float(last.group(2)),
                state=float(last.group(3)), sharding=sharding, optimizer=optimizer)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--variants", default="ddp,ddp-view,zero1,zero1-view,zero2,fsdp")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "chunked-adam", "sgd"])
    parser.add_argument("--model", default="large")
    parser.add_argument("--build-dir", default="build")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--no-env-tuning", action="store_true", help="ddprun --no-env-tuning")
    parser.add_argument("bench_args", nargs="*", metavar="-- ARG",
                        help="after --: more ddp-train-bench arguments")
    args = parser.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        sharding, view, optimizer = parse_variant(v, args.optimizer)
        if sharding not in ("ddp", "zero1", "zero2", "fsdp") or view not in ("", "view") or \
                optimizer not in ("adam", "chunked-adam", "sgd"):
            parser.error(f"unknown variant {v!r}: ddp, zero1, zero2, fsdp, each optionally -view, "
                         f"then optionally :adam, :chunked-adam or :sgd")

    print(f"| W | variant | state_mem_mb | state formula (MiB) | state ÷ formula | peak_mem_mb | "
          f"peak formula (MiB) | peak ÷ formula | peak ÷ DDP's |")
    print("|---|---|---:|---|---:|---:|---|---:|---:|")
    ok = True
    for world in [int(w) for w in args.worlds.split(",")]:
        ddp_peak = None
        for variant in variants:
            r = run(args, world, variant)
            if r is None:
                print(f"| {world} | {variant} | failed | | | | | | |", flush=True)
                ok = False
                continue
            state_bytes, text = state_formula(r["sharding"], r["optimizer"], r["params"], world)
            peak_bytes, peak_text = state_bytes, text
            if r["sharding"] == "fsdp":
                peak_bytes += 4 * r["unit"]
                peak_text += " + 4Ψunit"
            state_mib, peak_mib = state_bytes / MIB, peak_bytes / MIB
            if variant == "ddp":
                ddp_peak = r["peak"]
            versus_ddp = f"{r['peak'] / ddp_peak:.2f}" if ddp_peak else ""
            print(f"| {world} | {variant} | {r['state']:.1f} | {text} = {state_mib:.0f} | "
                  f"{r['state'] / state_mib:.2f} | {r['peak']:.1f} | {peak_text} = "
                  f"{peak_mib:.0f} | {r['peak'] / peak_mib:.2f} | {versus_ddp} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
