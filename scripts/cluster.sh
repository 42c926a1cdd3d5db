#!/usr/bin/env bash
# A simulated cluster on one machine: K "hosts", each a network namespace with its own address,
# joined by a bridge that lives in a namespace of its own, every link shaped with tc.
#
#   scripts/cluster.sh up --hosts 4 --rate 1gbit [--loss 0.1%] [--delay 100us] [--mtu 1500]
#   scripts/cluster.sh run [--nproc-per-host 2] [--master-port 29500] [--timeout 900] -- CMD...
#   scripts/cluster.sh exec HOST -- CMD...      # one command inside host HOST's namespace
#   scripts/cluster.sh hostfile [--slots N]     # an OpenMPI hostfile (see scripts/cluster-rsh.sh)
#   scripts/cluster.sh link HOST down|up        # pull (and put back) host HOST's cable
#   scripts/cluster.sh status
#   scripts/cluster.sh down                     # removes everything; safe to repeat
#
# Every name starts with $DDP_CLUSTER_PREFIX (default ddpc): namespaces PREFIX-br and PREFIX-h0..,
# nothing is created in the root namespace, so no traffic leaves the cluster. `run` starts one
# `ddprun --nnodes K --node-rank R` per host (from $DDP_BUILD_DIR/bin, default build/), waits for
# all of them up to a deadline and exits non-zero when any failed. docs/cluster.md has the details.
#
# Exit codes: 0 success, 1 failure, 2 bad input, 3 `status` with no cluster up, 77 cannot run here
# (not root, no `ip netns`, or a knob this kernel lacks, e.g. --delay without netem): "skipped".
set -uo pipefail

readonly PREFIX="${DDP_CLUSTER_PREFIX:-ddpc}"
readonly REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly BUILD_DIR="${DDP_BUILD_DIR:-$REPO/build}"
readonly BRIDGE_NS="$PREFIX-br"
readonly SUBNET="10.77.0"  # host R is $SUBNET.(R+1)/24; private to the cluster's namespaces
readonly HOST_IF="eth0"    # the host's end of its link (GLOO_SOCKET_IFNAME points at it)
readonly SKIP=77

die() {  # die CODE MESSAGE
  echo "cluster.sh: $2" >&2
  exit "$1"
}
usage_error() { die 2 "$1 (see 'scripts/cluster.sh --help')"; }

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

host_ns() { echo "$PREFIX-h$1"; }
host_addr() { echo "$SUBNET.$(($1 + 1))"; }

# Namespaces of this cluster, hosts in numeric order.
host_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-h[0-9]+$" |
    sed "s/^${PREFIX}-h//" | sort -n | sed "s/^/${PREFIX}-h/"
}
host_count() { host_namespaces | wc -l; }
cluster_exists() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -qE "^${PREFIX}-(br|h[0-9]+)$"
}

need_root() {
  [[ $(id -u) -eq 0 ]] || die $SKIP "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create \
network namespaces; skipped"
  command -v ip >/dev/null || die $SKIP "needs 'ip' (iproute2) for network namespaces; skipped"
  command -v tc >/dev/null || die $SKIP "needs 'tc' (iproute2) to shape the links; skipped"
}

# --rate: tc's rate syntax (e.g. 200mbit, 1gbit, 10gbit), or none for unshaped links.
# Prints the rate in bit/s (0 for none).
rate_bits() {
  local text="${1,,}"
  [[ $text == none || $text == unlimited ]] && { echo 0; return; }
  [[ $text =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit)$ ]] ||
    usage_error "--rate '$1' is not a rate; write e.g. 200mbit, 1gbit, 10gbit (tc's units), or none"
  local mult
  case "${BASH_REMATCH[3]}" in
    bit) mult=1 ;; kbit) mult=1e3 ;; mbit) mult=1e6 ;; gbit) mult=1e9 ;; tbit) mult=1e12 ;;
  esac
  local bits
  bits=$(awk -v v="${BASH_REMATCH[1]}" -v m="$mult" 'BEGIN { printf "%.0f", v * m }')
  ((bits >= 8000)) || usage_error "--rate '$1' is below 8kbit; tbf cannot shape that usefully"
  echo "$bits"
}

# --loss: a percentage (0.1%, 1, 100%). Prints parts per million.
loss_ppm() {
  local text="${1%\%}"
  [[ $text =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
    usage_error "--loss '$1' is not a percentage; write e.g. 0.1% or 1%"
  local ppm
  ppm=$(awk -v p="$text" 'BEGIN { printf "%.0f", p * 10000 }')
  ((ppm <= 1000000)) || usage_error "--loss '$1' is above 100%"
  echo "$ppm"
}

# --delay: tc's time syntax (100us, 1ms, 0.5ms). Validated only; see `up`.
check_delay() {
  [[ ${1,,} =~ ^[0-9]+(\.[0-9]+)?(us|usec|ms|msec|s|sec)$ ]] ||
    usage_error "--delay '$1' is not a time; write e.g. 100us or 1ms"
}

# tbf on one device: rate, a burst of 1 ms at the rate (at least 128 KiB, so that a 64 KiB GSO
# packet passes whole) and a queue of 50 ms, so that the incast of several senders is queued,
# not dropped. Optionally below netem's delay (netem as root, tbf as its child).
shape() {  # shape NS DEV BITS [DELAY]
  local ns=$1 dev=$2 bits=$3 delay=${4:-}
  local burst=$((bits / 8 / 1000))
  ((burst < 131072)) && burst=131072
  local parent=(root)
  if [[ -n $delay ]]; then
    tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$delay" limit 100000 || return 1
    parent=(parent 1:1 handle 10:)
  fi
  if ((bits > 0)); then
    tc -n "$ns" qdisc add dev "$dev" "${parent[@]}" tbf rate "${bits}bit" burst "$burst" \
      latency 50ms || return 1
  fi
}

# Probes whether this kernel has netem, in the bridge namespace's loopback (nothing else runs
# there). Prints tc's error when it has not.
netem_probe() {
  local out
  if out=$(tc -n "$BRIDGE_NS" qdisc add dev lo root netem delay 1ms 2>&1); then
    tc -n "$BRIDGE_NS" qdisc del dev lo root
    return 0
  fi
  echo "$out"
  return 1
}

# Drops PPM in a million packets arriving at the host (nftables' netdev ingress hook): every
# packet is received by exactly one host, so this is the loss of every path.
add_loss() {  # add_loss NS PPM
  local rule="numgen random mod 1000000 < $2 drop"
  (($2 >= 1000000)) && rule="drop"  # 100%: numgen's range ends at 999999
  ip netns exec "$1" nft -f - <<EOF
table netdev ${PREFIX}_loss {
  chain ingress {
    type filter hook ingress device "$HOST_IF" priority 0; policy accept;
    $rule
  }
}
EOF
}

reachable() {  # reachable NS ADDRESS
  local out
  out=$(ip netns exec "$1" timeout 5 bash -c "exec 3<>/dev/tcp/$2/9" 2>&1)
  [[ $? -eq 0 || $out == *"Connection refused"* ]]
}

cmd_up() {
  local hosts="" rate="" loss="" delay="" mtu=1500
  while (($#)); do
    case "$1" in
      --hosts) hosts=${2:-}; shift 2 || usage_error "--hosts needs a value" ;;
      --rate) rate=${2:-}; shift 2 || usage_error "--rate needs a value" ;;
      --loss) loss=${2:-}; shift 2 || usage_error "--loss needs a value" ;;
      --delay) delay=${2:-}; shift 2 || usage_error "--delay needs a value" ;;
      --mtu) mtu=${2:-}; shift 2 || usage_error "--mtu needs a value" ;;
      *) usage_error "up: unknown argument '$1'" ;;
    esac
  done
  [[ $hosts =~ ^[1-9][0-9]*$ ]] && ((hosts >= 1 && hosts <= 250)) ||
    usage_error "--hosts '$hosts' must be a whole number from 1 to 250"
  [[ -n $rate ]] || usage_error "up needs --rate (e.g. --rate 1gbit, or --rate none)"
  local bits ppm=0
  bits=$(rate_bits "$rate") || exit $?
  [[ -n $loss ]] && { ppm=$(loss_ppm "$loss") || exit $?; }
  [[ -n $delay ]] && { check_delay "$delay" || exit $?; }
  [[ $mtu =~ ^[1-9][0-9]*$ ]] && ((mtu >= 576 && mtu <= 65535)) ||
    usage_error "--mtu '$mtu' must be from 576 to 65535"
  need_root
  if ((ppm > 0)); then
    command -v nft >/dev/null || die $SKIP "--loss needs nftables' 'nft' (Debian package \
nftables): this kernel has no netem, so loss is made with nftables; unavailable here"
  fi
  if cluster_exists; then
    die 1 "a cluster with prefix '$PREFIX' is already up ($(host_count) hosts); run \
'scripts/cluster.sh down' first, or set DDP_CLUSTER_PREFIX for a second one"
  fi

  # From here on, any failure removes what was made.
  trap 'echo "cluster.sh: up failed; removing what was created" >&2; cmd_down >/dev/null' EXIT
  ip netns add "$BRIDGE_NS" ||
    die $SKIP "cannot create a network namespace ('ip netns add $BRIDGE_NS' failed); skipped"
  if [[ -n $delay ]] && awk -v d="$delay" 'BEGIN { exit !(d + 0 > 0) }'; then
    local why
    if ! why=$(netem_probe); then
      die $SKIP "--delay needs the kernel's netem qdisc, and this kernel has none ('tc qdisc add \
... netem' says: $why). Nothing else here can delay packets (no netem, no fq for timestamped \
pacing), so delay is unavailable: run without --delay"
    fi
  else
    delay=""
  fi
  ip -n "$BRIDGE_NS" link set lo up || exit 1
  ip -n "$BRIDGE_NS" link add br0 type bridge || exit 1
  ip -n "$BRIDGE_NS" link set br0 mtu "$mtu" up || exit 1
  # The bridge only forwards: no iptables on bridged packets (br_netfilter), less CPU per packet.
  for knob in bridge-nf-call-iptables bridge-nf-call-ip6tables bridge-nf-call-arptables; do
    ip netns exec "$BRIDGE_NS" sysctl -qw "net.bridge.$knob=0" 2>/dev/null || true
  done
  local r ns
  for ((r = 0; r < hosts; r++)); do
    ns=$(host_ns "$r")
    ip netns add "$ns" || exit 1
    ip -n "$BRIDGE_NS" link add "p$r" mtu "$mtu" type veth peer name "$HOST_IF" netns "$ns" ||
      exit 1
    ip -n "$BRIDGE_NS" link set "p$r" master br0 up || exit 1
    ip -n "$ns" link set lo up || exit 1
    ip -n "$ns" addr add "$(host_addr "$r")/24" dev "$HOST_IF" || exit 1
    ip -n "$ns" link set "$HOST_IF" mtu "$mtu" up || exit 1
    # Host egress (its upload) and the bridge port's egress (its download): full duplex at rate.
    shape "$ns" "$HOST_IF" "$bits" "$delay" || exit 1
    shape "$BRIDGE_NS" "p$r" "$bits" || exit 1
    if ((ppm > 0)); then add_loss "$ns" "$ppm" || exit 1; fi
  done
  # Host 0 reaches every other host before we say it is up: a TCP connection to a closed port
  # is refused at once by a reachable host (no ping needed), and fails otherwise. Skipped with
  # --loss, where a dropped packet could fail it.
  if ((ppm == 0)); then
    for ((r = 1; r < hosts; r++)); do
      reachable "$(host_ns 0)" "$(host_addr "$r")" ||
        die 1 "host 0 cannot reach host $r ($(host_addr "$r")) over the bridge"
    done
  fi
  trap - EXIT
  echo "cluster.sh: up: $hosts hosts ($SUBNET.1-$SUBNET.$hosts, namespaces $PREFIX-h0..\
$PREFIX-h$((hosts - 1))), rate ${rate,,} each way per host, loss ${loss:-0%}, \
delay ${delay:-none}, mtu $mtu"
}

# Pids of processes in this cluster's namespaces.
cluster_pids() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(br|h[0-9]+)$"); do
    ip netns pids "$ns" 2>/dev/null
  done
}

cmd_down() {
  local pids ns removed=0
  pids=$(cluster_pids)
  if [[ -n $pids ]]; then
    # Only processes inside the cluster's namespaces: what `run`/`exec` started there.
    echo "cluster.sh: down: stopping processes still in the cluster: $(echo $pids)" >&2
    kill -TERM $pids 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      [[ -z $(cluster_pids) ]] && break
      sleep 0.2
    done
    pids=$(cluster_pids)
    [[ -n $pids ]] && kill -KILL $pids 2>/dev/null
  fi
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(br|h[0-9]+)$"); do
    # Deleting a namespace deletes its ends of the veth pairs, and with them the other ends.
    ip netns del "$ns" && removed=$((removed + 1))
  done
  if cluster_exists; then die 1 "down: could not remove every namespace of '$PREFIX'"; fi
  echo "cluster.sh: down: removed $removed namespaces"
}

cmd_status() {
  if ! cluster_exists; then
    echo "no cluster with prefix '$PREFIX'"
    return 3
  fi
  local n ns r=0
  n=$(host_count)
  echo "cluster '$PREFIX': $n hosts, bridge in namespace $BRIDGE_NS"
  for ns in $(host_namespaces); do
    r=${ns#"$PREFIX"-h}
    local state
    state=$(ip -n "$BRIDGE_NS" -o link show "p$r" 2>/dev/null | grep -q 'state UP' && echo up ||
      echo "DOWN (cut: cluster.sh link $r up)")
    echo "  host $r: namespace $ns, address $(host_addr "$r"), link $state"
    echo "    egress:  $(tc -n "$ns" qdisc show dev "$HOST_IF" 2>/dev/null | tr '\n' ';')"
    echo "    ingress: $(tc -n "$BRIDGE_NS" qdisc show dev "p$r" 2>/dev/null | tr '\n' ';')"
    local rule
    rule=$(ip netns exec "$ns" nft list table netdev "${PREFIX}_loss" 2>/dev/null |
      grep -oE '(numgen.*)?drop')
    [[ -n $rule ]] && echo "    loss:    $rule (at ingress; numgen: drops below N of a million)"
    local pids
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [[ -n $pids ]] && echo "    processes: $pids"
  done
  return 0
}

need_cluster() {
  cluster_exists || die 1 "no cluster with prefix '$PREFIX' is up; run 'scripts/cluster.sh up' \
first"
}

# The environment a process inside host R gets: its own address for ddp and gloo, and no host
# identity inherited from outside (each namespace is a host of its own).
host_env() {  # host_env R
  echo "DDP_ADVERTISE_ADDR=$(host_addr "$1")" "GLOO_SOCKET_IFNAME=$HOST_IF" \
    "DDP_CLUSTER_HOST=$1"
}

cmd_exec() {
  (($# >= 1)) || usage_error "exec needs a host number and a command: exec 0 -- CMD..."
  local r=$1
  shift
  [[ ${1:-} == -- ]] && shift
  (($#)) || usage_error "exec needs a command after the host number"
  need_root
  need_cluster
  local n
  n=$(host_count)
  [[ $r =~ ^(0|[1-9][0-9]*)$ ]] && ((r < n)) || usage_error "exec: host '$r' is not one of 0..$((n - 1))"
  # shellcheck disable=SC2046
  exec ip netns exec "$(host_ns "$r")" env -u DDP_HOST_ID $(host_env "$r") "$@"
}

# Cuts or restores host R's link (its bridge port goes down: the host sees no carrier and every
# packet to or from it is lost), for fault tests: a cable pulled mid-run.
cmd_link() {  # link R down|up
  (($# == 2)) || usage_error "link needs a host number and down or up: link 1 down"
  local r=$1 state=$2
  [[ $state == down || $state == up ]] || usage_error "link: '$state' is neither down nor up"
  need_root
  need_cluster
  local n
  n=$(host_count)
  [[ $r =~ ^(0|[1-9][0-9]*)$ ]] && ((r < n)) || usage_error "link: host '$r' is not one of 0..$((n - 1))"
  ip -n "$BRIDGE_NS" link set "p$r" "$state" || die 1 "link: could not set host $r's link $state"
  echo "cluster.sh: link: host $r ($(host_ns "$r")) is $( [[ $state == down ]] && echo cut off ||
    echo connected again)"
}

cmd_hostfile() {
  local slots=1
  while (($#)); do
    case "$1" in
      --slots) slots=${2:-}; shift 2 || usage_error "--slots needs a value" ;;
      *) usage_error "hostfile: unknown argument '$1'" ;;
    esac
  done
  [[ $slots =~ ^[1-9][0-9]*$ ]] || usage_error "--slots '$slots' must be a positive number"
  need_cluster
  local ns
  for ns in $(host_namespaces); do echo "$ns slots=$slots"; done
}

cmd_run() {
  local nproc=1 port=29500 timeout=900
  while (($#)); do
    case "$1" in
      --nproc-per-host) nproc=${2:-}; shift 2 || usage_error "--nproc-per-host needs a value" ;;
      --master-port) port=${2:-}; shift 2 || usage_error "--master-port needs a value" ;;
      --timeout) timeout=${2:-}; shift 2 || usage_error "--timeout needs a value" ;;
      --) shift; break ;;
      *) usage_error "run: unknown argument '$1' (the command goes after --)" ;;
    esac
  done
  (($#)) || usage_error "run needs a command after --, e.g. run -- build/bin/ddp-bench"
  [[ $nproc =~ ^[1-9][0-9]*$ ]] || usage_error "--nproc-per-host '$nproc' must be a positive number"
  [[ $port =~ ^[1-9][0-9]*$ ]] && ((port >= 1 && port <= 65535)) ||
    usage_error "--master-port '$port' must be from 1 to 65535"
  [[ $timeout =~ ^[1-9][0-9]*$ ]] || usage_error "--timeout '$timeout' must be whole seconds"
  local ddprun="$BUILD_DIR/bin/ddprun"
  [[ -x $ddprun ]] || usage_error "$ddprun does not exist: build it (cmake --build \
$BUILD_DIR --target ddprun) or set DDP_BUILD_DIR"
  need_root
  need_cluster
  local n r tmp
  n=$(host_count)
  tmp=$(mktemp -d /tmp/ddpc-run.XXXXXX) || die 1 "mktemp failed"
  local -a jobs=()
  for ((r = 0; r < n; r++)); do
    # setsid: each host's ddprun leads its own process group, which the deadline can stop.
    (
      # shellcheck disable=SC2046
      setsid bash -c 'echo $$ >"$0"; exec "$@"' "$tmp/pid.$r" \
        ip netns exec "$(host_ns "$r")" env -u DDP_HOST_ID $(host_env "$r") \
        "$ddprun" --nnodes "$n" --node-rank "$r" --nproc-per-node "$nproc" \
        --master-addr "$(host_addr 0)" --master-port "$port" -- "$@" 2>&1 </dev/null |
        sed -u "s/^/[h$r] /"
    ) &
    jobs[r]=$!
  done
  # The hosts' ddpruns are in sessions of their own (a terminal's Ctrl-C does not reach them):
  # when this script is interrupted or terminated, it stops them before it exits.
  # shellcheck disable=SC2064
  trap "stop_and_exit 130 '$tmp' $n" INT
  # shellcheck disable=SC2064
  trap "stop_and_exit 143 '$tmp' $n" TERM
  # Like ddprun with its workers: the first host that fails stops the others, so that they do
  # not wait for it until their collective timeout; at the deadline every host is stopped.
  local -a code=()
  local deadline=$(($(now_ms) + timeout * 1000)) running stop_reason="" kill_at=0
  while :; do
    running=0
    for ((r = 0; r < n; r++)); do
      [[ -n ${code[r]:-} ]] && continue
      if kill -0 "${jobs[r]}" 2>/dev/null; then
        running=1
      else
        wait "${jobs[r]}"
        code[r]=$?
        if ((code[r] != 0)) && [[ -z $stop_reason ]]; then
          stop_reason="host $r failed"
          echo "cluster.sh: run: host $r ($(host_ns "$r")) exited with code ${code[r]}; \
stopping the other hosts" >&2
          signal_hosts TERM "$tmp" "$n"
          kill_at=$(($(now_ms) + 10000))
        fi
      fi
    done
    ((running)) || break
    if [[ -z $stop_reason ]] && (($(now_ms) >= deadline)); then
      stop_reason="timeout"
      echo "cluster.sh: run: still running after ${timeout}s; stopping every host's ddprun" >&2
      signal_hosts TERM "$tmp" "$n"
      kill_at=$(($(now_ms) + 10000))
    fi
    if ((kill_at > 0 && $(now_ms) >= kill_at)); then
      signal_hosts KILL "$tmp" "$n"  # what ddprun did not stop within 10 s
      kill_at=0
    fi
    sleep 0.1
  done
  local failed=0
  for ((r = 0; r < n; r++)); do
    if ((code[r] != 0)); then
      echo "cluster.sh: run: host $r ($(host_ns "$r")) exited with code ${code[r]}" >&2
      failed=1
    fi
  done
  rm -rf "$tmp"
  [[ $stop_reason == timeout ]] && die 1 "run: timed out after ${timeout}s"
  ((failed)) && die 1 "run: failed on at least one host"
  return 0
}

# On SIGINT/SIGTERM during `run`: SIGTERM to every host's ddprun, SIGKILL to what is left after
# 10 s, then exit with CODE.
stop_and_exit() {  # stop_and_exit CODE TMP N
  echo "cluster.sh: run: interrupted; stopping every host's ddprun" >&2
  signal_hosts TERM "$2" "$3"
  local until=$(($(now_ms) + 10000)) r left
  while (($(now_ms) < until)); do
    left=0
    for ((r = 0; r < $3; r++)); do
      [[ -s $2/pid.$r ]] && kill -0 "$(cat "$2/pid.$r")" 2>/dev/null && left=1
    done
    ((left)) || break
    sleep 0.1
  done
  signal_hosts KILL "$2" "$3"
  rm -rf "$2"
  exit "$1"
}

now_ms() { echo $((${EPOCHREALTIME/./} / 1000)); }

# Sends SIG to the process group of every host's ddprun (ddprun forwards SIGTERM to its
# workers and kills them after its 5 s grace period).
signal_hosts() {  # signal_hosts SIG TMP N
  local r
  for ((r = 0; r < $3; r++)); do
    [[ -s $2/pid.$r ]] && kill "-$1" -- "-$(cat "$2/pid.$r")" 2>/dev/null
  done
}

main() {
  (($#)) || { usage >&2; exit 2; }
  # The prefix goes into namespace names, patterns and an nftables table name.
  [[ $PREFIX =~ ^[A-Za-z][A-Za-z0-9]{0,15}$ ]] || usage_error "DDP_CLUSTER_PREFIX '$PREFIX' must \
be a letter and up to 15 letters or digits"
  local command=$1
  shift
  case "$command" in
    up) cmd_up "$@" ;;
    down) need_root; cmd_down ;;
    status) cmd_status ;;
    run) cmd_run "$@" ;;
    exec) cmd_exec "$@" ;;
    hostfile) cmd_hostfile "$@" ;;
    link) cmd_link "$@" ;;
    -h | --help | help) usage ;;
    *) usage_error "unknown command '$command'; choose up, run, exec, hostfile, link, status or down" ;;
  esac
}

main "$@"
