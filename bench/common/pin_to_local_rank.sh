#!/bin/bash
# Runs PROGRAM [ARGS...] pinned to the CPU numbered as the rank's LOCAL_RANK (set by ddprun), so
# that two ranks on two cores never share one: a launcher wrapper for latency measurements, e.g.
#   ddprun --standalone --nproc-per-node 2 bench/common/pin_to_local_rank.sh build/bin/ddp-bench \
#       --sizes 1K
set -euo pipefail
: "${LOCAL_RANK:?LOCAL_RANK is not set: run this under ddprun (or torchrun)}"
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc alone honours OMP_NUM_THREADS
if ((LOCAL_RANK >= cpus)); then
  echo "pin_to_local_rank.sh: local rank $LOCAL_RANK has no CPU of its own ($cpus CPUs)" >&2
  exit 2
fi
exec taskset -c "$LOCAL_RANK" "$@"
