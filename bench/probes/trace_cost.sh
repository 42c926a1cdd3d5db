#!/bin/bash
# The timeline's cost on DDP training: ddp-train-bench --model mlp with 2 ranks, DDP_TRACE unset
# (off) and set (on: every step records forward, backward, bucket and collective events, and
# each rank writes its trace at exit), interleaved in rotating order; then the medians of the
# runs' step_ms and their ratio.
#   bash bench/probes/trace_cost.sh [BUILD_BIN_DIR]
# REPS (default 8) rounds, STEPS (default 30) timed steps per run after WARMUP (default 5), of
# MODEL (default mlp). Results: docs/observability.md,
# "Cost of the timeline", and docs/benchmarks.md.
set -euo pipefail
bin=$(realpath "${1:-build/bin}")
reps=${REPS:-8}
steps=${STEPS:-30}
warmup=${WARMUP:-5}
model=${MODEL:-mlp}
out=$(mktemp)
traces=$(mktemp -d)
trap 'rm -rf "$out" "$traces"' EXIT

run() { # label [DDP_TRACE dir]
  local label=$1 dir=${2:-}
  local envs=(OMP_NUM_THREADS=1)
  [ -n "$dir" ] && envs+=(DDP_TRACE="$dir")
  env "${envs[@]}" timeout 300 "$bin/ddprun" --standalone --nproc-per-node 2 \
    "$bin/ddp-train-bench" --model "$model" --steps "$steps" --warmup "$warmup" 2>/dev/null |
    sed -n 's/^\[0\] step_ms=\([0-9.]*\).*/\1/p' | sed "s/^/$label /" >>"$out"
}

labels=(off on)
for ((rep = 0; rep < reps; ++rep)); do
  for ((k = 0; k < 2; ++k)); do
    case ${labels[$(((rep + k) % 2))]} in
      off) run off ;;
      on) run on "$traces" ;;
    esac
  done
done

python3 - "$out" "$traces" <<'PY'
import collections, json, os, statistics as st, sys
by = collections.defaultdict(list)
for line in open(sys.argv[1]):
    label, value = line.split()
    by[label].append(float(value))
for label in ("off", "on"):
    v = by[label]
    print(f"{label}: runs {len(v)} median step_ms {st.median(v):.2f} (min {min(v):.2f}, max {max(v):.2f})")
ratio = st.median(by["on"]) / st.median(by["off"])
print(f"on/off: {ratio:.3f} ({(ratio - 1) * 100:+.1f} %)")
trace = json.load(open(os.path.join(sys.argv[2], "trace_rank0.json")))
size = os.path.getsize(os.path.join(sys.argv[2], "trace_rank0.json"))
print(f"rank 0's trace of the last run: {trace['otherData']['events']} events, {size / 1024:.0f} KiB")
PY
