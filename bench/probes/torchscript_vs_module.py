#!/usr/bin/env python3
"""A TorchScript model under DDP against the same model as a libtorch nn::Module under DDP
(issue 27): ddp-train-bench's cnn (--model cnn) and the same architecture exported by Python with
torch.jit.script (--model-file), each trained by ddp-train-bench under ddprun at world 2,
alternated run by run (ABBA) on the same machine.

    python3 bench/probes/torchscript_vs_module.py --build build --rounds 6

Prints the median step_ms of each, script/module, and the spread over the rounds
((max - min) / median, the noise this run can resolve). Exit 1 when a run fails, 77 when the
exporting Python has no torch. --quick: one round of three steps (CI's form; numbers not judged).
"""
import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # bench_common
from bench_common import (REPO, SKIPPED, SYSTEM_PYTHON, clean_environment, cpu_model,  # noqa: E402
                          load_average, run, tail)

STEP = re.compile(r"step_ms=([0-9.]+) samples_per_s=([0-9.]+)")
EXPORT_SCRIPT = REPO / "tests" / "torch" / "export_torchscript_model.py"


def train(args, extra):
    argv = [str(args.build / "bin" / "ddprun"), "--standalone", "--nproc-per-node", "2",
            str(args.build / "bin" / "ddp-train-bench"), "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--batch-size", str(args.batch_size), *extra]
    code, output = run(argv, clean_environment(), args.timeout)
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {code}: {tail(output)}")
    return float(STEP.findall(output)[-1][0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, default=Path("build"), help="CMake build tree")
    parser.add_argument("--python", default=SYSTEM_PYTHON, help="the Python that exports")
    parser.add_argument("--how", choices=["script", "trace"], default="script")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.batch_size = 1, 3, 1, 8
    args.build = args.build.resolve()
    with tempfile.TemporaryDirectory(prefix="ddp-torchscript-bench-") as tmp:
        model_file = str(Path(tmp) / "cnn.pt")
        code, output = run([args.python, str(EXPORT_SCRIPT), "--model", "bench_cnn", "--how",
                            args.how, "--out", model_file], clean_environment(), args.timeout)
        if code != 0:
            print(f"torchscript_vs_module: {args.python} cannot export (needs torch): "
                  f"{tail(output)}")
            return SKIPPED
        version = output.strip().splitlines()[-1]
        print(f"# torchscript_vs_module: {cpu_model()}, load average {load_average()} at start; "
              f"world 2, batch {args.batch_size}, {args.rounds} rounds of {args.steps} steps; "
              f"cnn exported by torch {version} with torch.jit.{args.how}")
        modes = {"module": ["--model", "cnn"], "script": ["--model-file", model_file]}
        times = {mode: [] for mode in modes}
        try:
            for r in range(args.rounds):
                for mode in (list(modes) if r % 2 == 0 else list(reversed(modes))):
                    times[mode].append(train(args, modes[mode]))
        except RuntimeError as error:
            print(f"FAILED: {error}")
            return 1
    module, script = statistics.median(times["module"]), statistics.median(times["script"])
    spread = max((max(v) - min(v)) / statistics.median(v) for v in times.values())
    print(f"cnn: step_ms module {module:.2f} script {script:.2f} ratio {script / module:.4f} "
          f"spread {spread:.3f}")
    print(f"# runs: module {times['module']} script {times['script']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
