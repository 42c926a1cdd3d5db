#!/usr/bin/python3
"""Fails naming every file of bench/ that no CTest test runs (issue 28: benchmarks that cannot rot).

    tests/bench/bench_coverage.py --source REPO --build BUILD_DIR [--ctest ctest]
                                  [--unconfigured CMAKELISTS ...]

Reads every test's command line from `ctest --show-only=json-v1` of BUILD_DIR. A script of bench/
(.py, .sh) counts as run when a command line names bench/<file>; a program (.c, .cc) when a
command line names its executable (the file's stem, '_' or '-'), or, for a program this build did
not make (no MPI, DDP_BENCH_MICRO=OFF), it is reported and not held against the build. A file that
only a driver runs is listed in DRIVEN_BY with the driver, which must itself be run and must name
the file (so that the list cannot rot either). A script whose test lives in a folder that this
build does not configure (python/ without DDP_BUILD_PYTHON: scripts/test.sh runs it in its pytorch
stage) counts when that folder's CMakeLists.txt, given with --unconfigured, names bench/<file>.
Headers and bench_common.py are helpers. Exit 0
when every file is run, 1 otherwise (with the names), 2 for bad arguments.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

HELPERS = {"CMakeLists.txt", "bench_common.py"}
# file -> the driver whose tiny form runs it (the driver's source must name the file).
DRIVEN_BY = {
    "ddp_train_bench.cc": "compare_ddp.py",      # as ddp-train-bench, with pytorch_ddp_bench.py
    "pytorch_ddp_bench.py": "compare_ddp.py",    # on PyTorch 1.13 and 2.x
    "gloo_allreduce.py": "compare_allreduce.py",  # peers gloo (1.13) and gloo2 (2.x)
    "mpi_allreduce.c": "compare_allreduce.py",    # peers openmpi-tcp and openmpi
    "pin_to_local_rank.sh": "flight_recorder_cost.sh",  # PIN=1
    "mesh_scale_probe.cc": "scale.py",  # as mesh-scale-probe, at every world it measures
    "gloo_scale_probe.py": "scale.py",  # peer gloo2, which scale.py --quick runs where PyTorch 2.x is
    "pytorch_model_parallel_bench.py": "compare_model_parallel.py",  # beside train-gpt
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="the repository (with bench/)")
    parser.add_argument("--build", required=True, help="the CMake build folder")
    parser.add_argument("--ctest", default="ctest")
    parser.add_argument("--unconfigured", nargs="*", default=[],
                        help="CMakeLists.txt files of folders this build leaves out")
    args = parser.parse_args()
    bench = Path(args.source) / "bench"
    bin_dir = Path(args.build) / "bin"
    if not bench.is_dir():
        parser.error(f"{bench} is not a folder")
    listing = subprocess.run([args.ctest, "--test-dir", args.build, "--show-only=json-v1"],
                             capture_output=True, text=True, check=False)
    if listing.returncode != 0:
        print(f"bench_coverage: ctest --show-only failed:\n{listing.stderr}", file=sys.stderr)
        return 2
    commands = [" ".join(t.get("command", [])) for t in json.loads(listing.stdout)["tests"]]
    words = {Path(w).name for c in commands for w in c.split()}

    elsewhere = [Path(f).read_text() for f in args.unconfigured]

    def script_run(name):
        return any(f"bench/{name}" in c for c in commands) or \
            any(f"bench/{name}" in text for text in elsewhere)

    def program_names(name):
        stem = Path(name).stem
        return {stem, stem.replace("_", "-")}

    missing, not_built = [], []
    for path in sorted(bench.iterdir()):
        name = path.name
        if name in HELPERS or path.suffix == ".h" or not path.is_file():
            continue
        if name in DRIVEN_BY:
            driver = DRIVEN_BY[name]
            if not script_run(driver):
                missing.append(f"{name} (its driver {driver} is not run)")
            elif not any(n in (bench / driver).read_text() for n in program_names(name)):
                missing.append(f"{name} ({driver}, which should run it, does not name it)")
            continue
        if path.suffix in (".py", ".sh"):
            if not script_run(name):
                missing.append(name)
        elif path.suffix in (".c", ".cc"):
            names = program_names(name)
            if not any((bin_dir / n).exists() for n in names):
                not_built.append(name)
            elif not names & words:
                missing.append(name)
        else:
            missing.append(f"{name} (unknown kind: add it here or give it a test)")
    for name in not_built:
        print(f"bench_coverage: {name}: not built in {args.build}, not checked")
    if missing:
        print("bench_coverage: no CTest test runs these files of bench/ (give each a tiny form in "
              "tests/bench/CMakeLists.txt):")
        for name in missing:
            print(f"  bench/{name}")
        return 1
    print(f"bench_coverage: every file of {bench} is run by a test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
