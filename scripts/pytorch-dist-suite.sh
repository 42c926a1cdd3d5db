#!/usr/bin/env bash
# PyTorch's distributed test suite (DistributedTest, from the torch wheel) on gloo and on a
# third-party backend, at world 2 and 3, one run after the other; see docs/pytorch-backend.md.
#
#   scripts/pytorch-dist-suite.sh BACKEND [MODULE] [OUTDIR] [-- runner options]
#
# BACKEND: the backend to compare with gloo (ddp, or fakegloo for the stand-in that is
# gloo under another name); MODULE: what registers it (torch_ddp, pytorch_suite_fakegloo);
# OUTDIR (default build/pytorch-suite): BACKEND-wN.json, gloo-wN.json, summary.md.
# Runner options after `--` go to every run, e.g. `-- --tests-file
# scripts/pytorch_dist_suite_ci.txt` for the CI subset, `-- --filter all_reduce`.
# WORLDS="2 3", NICE=10 and SKIPS=gloo are the defaults. The full run takes about an hour and a
# half on 2 busy cores (spawn: every rank of every test starts an interpreter).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
backend=${1:?usage: scripts/pytorch-dist-suite.sh BACKEND [MODULE] [OUTDIR] [-- runner options]}
shift
module=""; outdir=build/pytorch-suite
if [[ $# -gt 0 && $1 != -- ]]; then module=$1; shift; fi
if [[ $# -gt 0 && $1 != -- ]]; then outdir=$1; shift; fi
[[ $# -gt 0 && $1 == -- ]] && shift
extra=("$@")
worlds=${WORLDS:-2 3}
py=(nice -n "${NICE:-10}" scripts/pytorch-python)

# PyTorch's test helpers import expecttest, which the torch wheel does not pull in. It goes
# into .cache/ (git-ignored) rather than the shared PyTorch environment; the runner finds it.
if [[ ! -d .cache/pytorch-suite-deps/expecttest ]]; then
  scripts/pytorch-python -m pip install -q --target .cache/pytorch-suite-deps expecttest==0.3.0
fi

mkdir -p "$outdir"
# Tests that time out on purpose make ddp write flight-recorder dumps: into the output folder,
# not the working directory (the source tree).
export DDP_DUMP_DIR=${DDP_DUMP_DIR:-$(realpath "$outdir")}
imp=()
[[ -n $module ]] && imp=(--import "$module")
runs=()
rc=0
for w in $worlds; do
  for b in gloo "$backend"; do
    args=(--backend "$b" --world-size "$w" --out "$outdir/$b-w$w.json" --log "$outdir/$b-w$w.log")
    # The backend runs exactly the tests that the suite runs for gloo (--skips gloo; SKIPS=suite
    # for the suite's own decisions for its name): docs/pytorch-backend.md.
    [[ $b == "$backend" ]] && args+=("${imp[@]}" --skips "${SKIPS:-gloo}")
    "${py[@]}" scripts/pytorch_dist_suite.py "${args[@]}" "${extra[@]}" || rc=$?
    runs+=("$outdir/$b-w$w.json")
  done
done

{
  echo "# PyTorch DistributedTest: gloo and $backend"
  echo
  "${py[@]}" scripts/pytorch_dist_suite.py --markdown "${runs[@]}"
  for w in $worlds; do
    echo
    echo "## world $w"
    echo
    "${py[@]}" scripts/pytorch_dist_suite.py --compare "$outdir/gloo-w$w.json" "$outdir/$backend-w$w.json"
  done
} >"$outdir/summary.md"
cat "$outdir/summary.md"
# The gate: every test that passed on gloo passed on the backend, but for the name-caused ones
# (scripts/pytorch_dist_suite_allowed.txt).
for w in $worlds; do
  "${py[@]}" scripts/pytorch_dist_suite.py --require-parity "$outdir/gloo-w$w.json" \
    "$outdir/$backend-w$w.json" --allowed scripts/pytorch_dist_suite_allowed.txt || rc=1
done
exit "$rc"
