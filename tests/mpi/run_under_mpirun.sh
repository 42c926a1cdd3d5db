#!/bin/sh
# run_under_mpirun.sh MPIEXEC NP [mpirun options...] -- PROGRAM [args...]
# Runs PROGRAM on NP ranks; exits 77 (CTest: skipped) with the reason when mpirun cannot start
# processes here at all, so that a broken MPI installation shows as skipped, never as passed.
# Each run gets its own session directory: mpiruns started at the same moment (ctest -j, other
# jobs on the host) otherwise race to create /tmp/ompi.<host>.<uid> and one fails in orte_init.
mpiexec=$1
np=$2
shift 2
options=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do options="$options $1"; shift; done
shift
session=$(mktemp -d "${TMPDIR:-/tmp}/ddp-mpirun.XXXXXX") || exit 1
trap 'rm -rf "$session"' EXIT
base="--allow-run-as-root --oversubscribe --mca orte_tmpdir_base $session"
if ! probe=$(timeout 60 "$mpiexec" $base -np 1 true 2>&1); then
  echo "SKIPPED: '$mpiexec -np 1 true' does not run here, so the mpi tests cannot run:"
  echo "$probe" | head -20
  exit 77
fi
"$mpiexec" $base $options -np "$np" "$@"
