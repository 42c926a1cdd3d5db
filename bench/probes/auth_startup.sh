#!/usr/bin/env bash
# Cost of the job's secret: start-up time of a 4-process job under ddprun, and 1 KiB allreduce
# latency, with and without --secret-file. Runs alternate (plain, secret, plain, ...) so that load
# from elsewhere on the machine hits both sides alike; prints the median of each.
#
#   bash bench/probes/auth_startup.sh [BUILD_DIR] [RUNS]     (defaults: build, 11)
#
# WORLD (default 4) ranks; LATENCY_RUNS (default 5) latency runs of LATENCY_ITERS (default 2000)
# iterations each (tests/bench's tiny form: WORLD=2 RUNS=1 LATENCY_RUNS=1 LATENCY_ITERS=10).
# Start-up is the wall time of `ddprun --standalone --nproc-per-node 4 ddp-bench --sizes 1K
# --iters 1 --warmup 0`: process start, rendezvous (store handshake), mesh connection (ring
# handshake), shared-memory set-up, one allreduce, teardown. Latency is ddp-bench's own median.
set -euo pipefail
build=${1:-build}
runs=${2:-11}
world=${WORLD:-4}
latency_runs=${LATENCY_RUNS:-5}
latency_iters=${LATENCY_ITERS:-2000}
ddprun="$build/bin/ddprun"
bench="$build/bin/ddp-bench"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
head -c 32 /dev/urandom | base64 > "$tmp/secret"
chmod 600 "$tmp/secret"

median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

startup_ms() {  # $@: extra ddprun options
  local t0 t1
  t0=$(date +%s%N)
  "$ddprun" "$@" --standalone --nproc-per-node "$world" "$bench" --op allreduce --sizes 1K \
    --iters 1 --warmup 0 --timeout 60 >/dev/null
  t1=$(date +%s%N)
  echo $(((t1 - t0) / 1000))  # microseconds
}

latency_us() {  # $@: extra ddprun options; prints ddp-bench's median time for 1 KiB
  "$ddprun" "$@" --standalone --nproc-per-node "$world" "$bench" --op allreduce --sizes 1K \
    --iters "$latency_iters" --warmup $((latency_iters / 10)) --json --timeout 60 |
    grep -o '"time_us":[0-9.eE+-]*' | head -1 | cut -d: -f2
}

: >"$tmp/plain"; : >"$tmp/secret_runs"; : >"$tmp/lat_plain"; : >"$tmp/lat_secret"
for ((i = 0; i < runs; ++i)); do
  startup_ms >>"$tmp/plain"
  startup_ms --secret-file "$tmp/secret" >>"$tmp/secret_runs"
done
for ((i = 0; i < latency_runs; ++i)); do
  latency_us >>"$tmp/lat_plain"
  latency_us --secret-file "$tmp/secret" >>"$tmp/lat_secret"
done
plain=$(median <"$tmp/plain")
secret=$(median <"$tmp/secret_runs")
echo "world $world, $runs start-ups each (median, ms); $latency_runs latency runs each (median of medians, us)"
printf '| | no secret | --secret-file | difference |\n| --- | --- | --- | --- |\n'
awk -v p="$plain" -v s="$secret" 'BEGIN {printf "| job start-up (ms) | %.1f | %.1f | %+.1f |\n", p/1000, s/1000, (s-p)/1000}'
lp=$(median <"$tmp/lat_plain")
ls=$(median <"$tmp/lat_secret")
awk -v p="$lp" -v s="$ls" 'BEGIN {printf "| allreduce 1 KiB (us) | %.1f | %.1f | %+.1f |\n", p, s, s-p}'
echo "start-ups (us), no secret: $(tr '\n' ' ' <"$tmp/plain")"
echo "start-ups (us), secret:    $(tr '\n' ' ' <"$tmp/secret_runs")"
