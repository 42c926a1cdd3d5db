#!/usr/bin/python3
"""Fails naming every file of bench/ that no CTest test runs (issue 28: benchmarks that cannot rot).

    tests/bench/bench_coverage.py --source REPO --build BUILD_DIR [--ctest ctest]
                                  [--unconfigured CMAKELISTS ...]

Reads every test's command line from `ctest --show-only=json-v1` of BUILD_DIR. The files are those
of bench/'s sub-folders (micro/, compare/, cluster/, probes/, common/), named by their path below
bench/ (`compare/compare_ddp.py`); results/ holds data, not programs, and is not looked at. A
script (.py, .sh) counts as run when a command line names bench/<kind>/<file>; a program (.c, .cc)
when a command line names its executable (the file's stem, '_' or '-'), or, for a program this
build did not make (no MPI, DDP_BENCH_MICRO=OFF), it is reported and not held against the build. A
file that only a driver runs is listed in DRIVEN_BY with the driver, which must itself be run and
must name the file (so that the list cannot rot either). A script whose test lives in a folder that
this build does not configure (python/ without DDP_BUILD_PYTHON: scripts/test.sh runs it in its
pytorch stage) counts when that folder's CMakeLists.txt, given with --unconfigured, names
bench/<kind>/<file>. Headers, bench_common.py, CMakeLists.txt and README.md are not programs. A
file at the top of bench/ (other than those two) fails: it belongs in a folder of its kind. Exit 0
when every file is run, 1 otherwise (with the names), 2 for bad arguments.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

HELPERS = {"CMakeLists.txt", "README.md", "bench_common.py"}
DATA = "results"  # bench/results/: recorded runs, not programs
# file -> the driver whose tiny form runs it (the driver's source must name the file); paths below
# bench/.
DRIVEN_BY = {
    # ddp's distributed checkpoint beside PyTorch's dcp
    "compare/dcp_bench.cc": "compare/compare_dcp.py",
    "compare/pytorch_dcp_bench.py": "compare/compare_dcp.py",
    # ddp::rpc's round trips beside PyTorch's TensorPipe agent and the raw TCP bound
    "micro/rpc_latency.cc": "compare/compare_rpc.py",
    "compare/pytorch_rpc_bench.py": "compare/compare_rpc.py",
    "micro/tcp_roundtrip_bound.cc": "compare/compare_rpc.py",
    # as ddp-train-bench, with pytorch_ddp_bench.py on PyTorch 1.13 and 2.x
    "compare/ddp_train_bench.cc": "compare/compare_ddp.py",
    "compare/pytorch_ddp_bench.py": "compare/compare_ddp.py",
    # peers gloo (1.13) and gloo2 (2.x); openmpi-tcp and openmpi
    "compare/gloo_allreduce.py": "compare/compare_allreduce.py",
    "compare/mpi_allreduce.c": "compare/compare_allreduce.py",
    "common/pin_to_local_rank.sh": "probes/flight_recorder_cost.sh",  # PIN=1
    # as mesh-scale-probe, at every world it measures; peer gloo2, which scale.py --quick runs
    # where PyTorch 2.x is
    "probes/mesh_scale_probe.cc": "probes/scale.py",
    "probes/gloo_scale_probe.py": "probes/scale.py",
    "compare/pytorch_model_parallel_bench.py": "compare/compare_model_parallel.py",  # train-gpt's peer
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
    for path in sorted(bench.rglob("*")):
        name = path.relative_to(bench).as_posix()  # e.g. compare/compare_ddp.py
        if not path.is_file() or name.split("/")[0] == DATA or "__pycache__" in name:
            continue
        if path.name in HELPERS or path.suffix == ".h":
            continue
        if "/" not in name:
            missing.append(f"{name} (at the top of bench/: move it into the folder of its kind)")
            continue
        if name in DRIVEN_BY:
            driver = DRIVEN_BY[name]
            if not script_run(driver):
                missing.append(f"{name} (its driver {driver} is not run)")
            elif not any(n in (bench / driver).read_text()
                         for n in program_names(path.name)):
                missing.append(f"{name} ({driver}, which should run it, does not name it)")
            continue
        if path.suffix in (".py", ".sh"):
            if not script_run(name):
                missing.append(name)
        elif path.suffix in (".c", ".cc"):
            names = program_names(path.name)
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
