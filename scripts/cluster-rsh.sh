#!/usr/bin/env bash
# OpenMPI's remote-shell agent for the simulated cluster (scripts/cluster.sh): mpirun calls it
# like ssh, `cluster-rsh.sh [ssh options] HOST COMMAND...`, with HOST a name from
# `scripts/cluster.sh hostfile` (a cluster namespace, e.g. ddpc-h1); it runs COMMAND there with
# a shell, as sshd would:
#
#   scripts/cluster.sh hostfile > hosts
#   scripts/cluster.sh exec 0 -- mpirun --hostfile hosts --mca plm_rsh_agent scripts/cluster-rsh.sh ...
#
# Only namespaces named like the cluster's hosts are entered; anything else is refused.
set -euo pipefail
prefix="${DDP_CLUSTER_PREFIX:-ddpc}"
while [[ $# -gt 0 && $1 == -* ]]; do  # ssh options mpirun may add (-x, -o X=Y, ...)
  case "$1" in -o | -l | -p | -i) shift 2 ;; *) shift ;; esac
done
host=${1:?cluster-rsh.sh: no host given}
shift
if [[ ! $host =~ ^${prefix}-h[0-9]+$ ]] || ! ip netns list | awk '{print $1}' | grep -qx "$host"; then
  echo "cluster-rsh.sh: '$host' is not a host of the cluster '$prefix' (scripts/cluster.sh status)" >&2
  exit 255
fi
# cluster.sh exec gives the command the host's environment (its address for ddp and gloo).
exec "$(dirname "${BASH_SOURCE[0]}")/cluster.sh" exec "${host#"${prefix}"-h}" -- /bin/sh -c "$*"
