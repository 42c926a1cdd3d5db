#!/usr/bin/env bash
# Runs one libFuzzer harness for a bounded time, for CTest and by hand (docs/fuzzing.md):
#   run_fuzzer.sh HARNESS SEED_CORPUS WORK_DIR [extra libFuzzer flags...]
# New inputs go to WORK_DIR/corpus (the seed corpus in the repository is only read); a crash,
# leak or timeout leaves its input in WORK_DIR/artifacts/ and fails with libFuzzer's report.
# DDP_FUZZ_SECONDS (default 15) bounds the run.
set -euo pipefail
harness=$1 seeds=$2 work=$3
shift 3
mkdir -p "$work/corpus" "$work/artifacts"
exec "$harness" -max_total_time="${DDP_FUZZ_SECONDS:-15}" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$@" "$work/corpus" "$seeds"
