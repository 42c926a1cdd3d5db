#!/bin/sh
# expect_job_failure.sh MAX_SECONDS PATTERN... -- MPIEXEC NP [mpirun options...] -- PROGRAM [args]
# Runs the job through run_under_mpirun.sh and passes when it FAILS as a whole: mpirun exits
# non-zero within MAX_SECONDS and its output contains every PATTERN (fixed strings). Exits 77
# (skipped) when mpirun cannot run here.
max=$1
shift
patterns=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  patterns="$patterns
$1"
  shift
done
shift
here=$(dirname "$0")
start=$(date +%s.%N)
# The hard limit only keeps a broken fail-fast from hanging CTest; the check is MAX_SECONDS.
output=$(timeout $((max * 3 + 30)) sh "$here/run_under_mpirun.sh" "$@" 2>&1)
rc=$?
end=$(date +%s.%N)
echo "$output"
[ $rc -eq 77 ] && exit 77
elapsed=$(awk "BEGIN { printf \"%.1f\", $end - $start }")
echo "--- the job exited with status $rc after $elapsed s"
status=0
if [ $rc -eq 0 ]; then
  echo "FAILED: the job exited with status 0; one rank failed, so it must fail"
  status=1
fi
if awk "BEGIN { exit !($elapsed > $max) }"; then
  echo "FAILED: the job took $elapsed s to end; expected at most $max s"
  status=1
fi
echo "$patterns" | while IFS= read -r pattern; do
  [ -z "$pattern" ] && continue
  if ! printf '%s' "$output" | grep -qF -- "$pattern"; then
    echo "FAILED: the output does not contain '$pattern'"
    exit 1
  fi
done || status=1
exit $status
