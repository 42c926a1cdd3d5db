#!/bin/bash
# The flight recorder's cost on a 1 KiB allreduce (shared memory, 2 ranks): ddp-bench's median
# with the recorder off (DDP_FLIGHT_RECORDER_ENTRIES=0) and on (2000, the default), and optionally
# a build without the recorder, interleaved in rotating order, then the paired differences.
#   bash bench/probes/flight_recorder_cost.sh [BUILD_BIN_DIR [BASE_DIR]]
# BUILD_BIN_DIR: this build's bin/ (default build/bin). BASE_DIR: a folder holding another build's
# ddprun, ddp-bench and libddp_comm.so* (e.g. main's), run with LD_LIBRARY_PATH. REPS (default
# 30) rounds, ITERS (default 10000) iterations each. PIN=1 pins each rank to the CPU of its local
# rank (bench/common/pin_to_local_rank.sh): unpinned, the two ranks on a 2-core host switch between
# scheduling states that differ by more than the recorder costs. Results: docs/observability.md,
# "Cost".
set -euo pipefail
bin=$(realpath "${1:-build/bin}")
base=${2:-}
[ -n "$base" ] && base=$(realpath "$base")
reps=${REPS:-30}
iters=${ITERS:-10000}
out=$(mktemp)
pin=()
[ "${PIN:-0}" = 1 ] && pin=("$(dirname "$(realpath "$0")")/../common/pin_to_local_rank.sh")
trap '[ -n "${KEEP:-}" ] && cp "$out" "$KEEP"; rm -f "$out"' EXIT

run() { # label bin_dir entries [library dir]
  local label=$1 dir=$2 entries=$3 lib=${4:-}
  local envs=(DDP_FLIGHT_RECORDER_ENTRIES="$entries")
  [ -n "$lib" ] && envs+=(LD_LIBRARY_PATH="$lib")
  env "${envs[@]}" timeout 120 "$dir/ddprun" --standalone --nproc-per-node 2 --no-env-tuning \
    "${pin[@]}" "$dir/ddp-bench" --sizes 1K --iters "$iters" --warmup 500 --json 2>/dev/null |
    sed -n 's/^\[0\] {/{/p' |
    python3 -c "import sys, json
for line in sys.stdin: print('$label', json.loads(line)['time_us'])" >>"$out"
}

labels=(off on)
[ -n "$base" ] && labels+=(base)
for ((rep = 0; rep < reps; ++rep)); do
  n=${#labels[@]}
  for ((k = 0; k < n; ++k)); do
    label=${labels[$(((rep + k) % n))]}
    case $label in
      off) run off "$bin" 0 ;;
      on) run on "$bin" 2000 ;;
      base) run base "$base" 0 "$base" ;;
    esac
  done
done

python3 - "$out" "${#labels[@]}" <<'PY'
import statistics as st, sys, collections
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
n = int(sys.argv[2])
by = collections.defaultdict(list)
for label, value in rows:
    by[label].append(float(value))
for label, values in by.items():
    print(f"{label:5} runs {len(values):3}  median {st.median(values):.3f} us  mean {st.mean(values):.3f} us")
# On a 2-core host a run lands in one of two states for its whole length (measured: ~1.05 and
# ~2.27 us for 1 KiB), whatever the build; compare like with like.
cut = 1.5 * min(float(v) for _, v in rows)
for label, values in by.items():
    fast = [v for v in values if v < cut]
    slow = [v for v in values if v >= cut]
    print(f"{label:5} fast runs {len(fast):3} median {st.median(fast) if fast else float('nan'):.3f} us;"
          f"  slow runs {len(slow):3} median {st.median(slow) if slow else float('nan'):.3f} us")
rounds = [dict((l, float(v)) for l, v in rows[i:i + n]) for i in range(0, len(rows) - n + 1, n)]
pairs = [("on", "off")] + ([("on", "base"), ("off", "base")] if "base" in by else [])
for a, b in pairs:
    d = [(r[a] - r[b]) * 1000 for r in rounds if a in r and b in r and (r[a] < cut) == (r[b] < cut)]
    if len(d) > 1:
        # The median of the paired differences of runs in the same state: a run disturbed by the
        # host counts once, not by its size (the mean is printed too).
        print(f"{a} - {b}: {st.median(d):+.1f} ns median of {len(d)} paired differences "
              f"({st.median(d) / (st.median(by[b]) * 1000) * 100:+.2f} %); mean {st.mean(d):+.1f} ns, "
              f"standard error {st.stdev(d) / len(d) ** 0.5:.1f} ns")
PY
