#!/usr/bin/python3
"""Allreduce (float32, sum) of ddp and its peers on a simulated cluster, side by side in one run.

    bench/cluster/cluster_allreduce.py [--hosts 4] [--rates 1gbit,10gbit] [--sizes 1K,4K,...,256M]
                                       [--engines ddp-ring,ddp-hier,gloo,openmpi-tcp]
                                       [--json-out FILE]

For every rate, brings up a cluster of --hosts network-namespace hosts with scripts/cluster.sh
(every host's link shaped with tbf to the rate, both directions), measures on it, and takes it
down again (also after a failure or Ctrl-C):
  link          raw TCP in the ring pattern (every host sends to the next and receives from the
                previous at once, for --link-seconds): the payload rate a ring can get, the bound
  ddp-ring      ddp-bench, 1 rank per host: the ring over TCP between hosts
  ddp-hier      ddp-bench, 2 ranks per host: hierarchical (shared memory inside a host, ring
                between hosts; DDP_TRANSPORT=auto finds the hosts by their network namespaces)
  gloo          torch.distributed's gloo, Debian's python3-torch (bench/compare/gloo_allreduce.py
                under each host's ddprun, /usr/bin/python3), 1 rank per host
  openmpi-tcp   OpenMPI's MPI_Allreduce (bench/compare/mpi_allreduce.c), 1 rank per host, --mca
                btl tcp,self; mpirun runs in host 0 and reaches the others through
                scripts/cluster-rsh.sh (its plm_rsh_agent) and a hostfile of namespace names
Then, once, without shaping (--rate none): the link bound and ddp-ring's large sizes, i.e. what
this machine's CPUs allow at all (at 10gbit on 2 cores the CPU, not the link, may be the limit).

Every engine times the same way (a barrier before each iteration, the slowest rank's time, the
median over iterations). Sizes below --large-from run --small-iters iterations, the others
--large-iters (a 256 MiB allreduce takes seconds at 1 Gbit/s). ddp's results are verified in a
separate short ddp-bench --check run; the peers check their last iteration. --rounds N measures
every engine N times at each rate, interleaved, and shows the median round (the faster of two).
busbw here is per host link: algbw * 2(K-1)/K with K hosts, the bytes each host's link carries
each way divided by the time (for 1 rank per host this is ddp-bench's busbw; for ddp-hier it
counts hosts, not ranks, so it compares with the link rate). The physical limit is the link's
payload rate: the rate less Ethernet/IP/TCP headers and the ACKs of the opposite stream.
Prints the machine, the commands and a table per rate (Markdown); writes every row to
--json-out. Needs root (network namespaces); exit 77 with the reason when that is missing, 0
when every measurement ran, 1 when one failed (the table marks it), 2 for bad arguments.
"""

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # bench_common
from bench_common import (REPO, SKIPPED, SYSTEM_PYTHON, Cluster, clean_environment, cpu_model,
                          human, json_rows, load_average, parse_rate, parse_size, tail,
                          tool_version)

RSH_AGENT = str(REPO / "scripts" / "cluster-rsh.sh")
SUBNET = "10.77.0"  # scripts/cluster.sh: host R is SUBNET.(R+1)
ENGINES = ["ddp-ring", "ddp-hier", "gloo", "openmpi-tcp"]
PEERS = ("gloo", "openmpi-tcp")
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M,256M"


# --- the raw TCP ring (runs inside every host, started by cluster.sh run) --------------------

def tcp_ring_worker(port, seconds):
    """Host RANK sends to RANK+1 and receives from RANK-1 at once; prints the receive rate."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nxt = f"{SUBNET}.{(rank + 1) % size + 1}"
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(1)
    listener.settimeout(30)
    deadline = time.monotonic() + 30
    out = None
    while out is None:
        try:
            out = socket.create_connection((nxt, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    inp, _ = listener.accept()
    inp.settimeout(seconds + 30)
    out.settimeout(seconds + 30)
    # Everyone is connected once every host has heard from its previous one: start together.
    out.sendall(b"s")
    assert inp.recv(1) == b"s"
    start = time.monotonic()
    payload = bytearray(4 << 20)

    def send():
        view = memoryview(payload)
        while time.monotonic() - start < seconds:
            out.sendall(view)
        out.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    buf = memoryview(bytearray(4 << 20))
    total, mark, end = 0, None, None
    # Leave out slow start and the ragged end (scaled down for short runs, which a fixed 0.5 s
    # warm-up would leave with no window at all).
    warm, stop = min(0.5, seconds / 4), seconds - min(0.2, seconds / 10)
    while True:
        n = inp.recv_into(buf)
        if n == 0:
            break
        total += n
        now = time.monotonic() - start
        if mark is None and now >= warm:
            mark = (now, total)
        if end is None and now >= stop:
            end = (now, total)
    sender.join()
    if mark is None or end is None or end[0] <= mark[0]:
        raise SystemExit("tcp ring: the measurement window was empty")
    rate = (end[1] - mark[1]) / (end[0] - mark[0]) / 1e9
    print(json.dumps({"rank": rank, "recv_gbps": rate}), flush=True)
    return 0


# --- the benchmark -----------------------------------------------------------------------------

class Bench(Cluster):
    def __init__(self, args):
        self.args = args
        self.build = Path(args.build_dir).resolve()
        self.bin = self.build / "bin"
        super().__init__(self.build, args.prefix, args.hosts, mtu=args.mtu, timeout=args.timeout,
                         env=clean_environment(OMP_NUM_THREADS="1"))

    def cluster(self, *argv, timeout=120):
        return self.script(*argv, timeout=timeout)

    def link(self):
        """Raw TCP ring: the slowest host's receive rate (GB/s of payload)."""
        code, out = self.host_run(1, [SYSTEM_PYTHON, str(Path(__file__).resolve()),
                                      "--tcp-ring-worker", "--link-seconds",
                                      str(self.args.link_seconds)], timeout=120)
        rows = json_rows(out)
        if code != 0 or len(rows) != self.args.hosts:
            return None, f"failed (exit {code}): {tail(out)}"
        return {"recv_gbps": min(r["recv_gbps"] for r in rows),
                "per_host_gbps": [r["recv_gbps"] for r in sorted(rows, key=lambda r: r["rank"])]}, \
            None

    def size_groups(self, sizes):
        small = [s for s in sizes if s < self.args.large_from]
        large = [s for s in sizes if s >= self.args.large_from]
        groups = []
        if small:
            groups.append((small, self.args.small_iters, self.args.small_warmup))
        if large:
            groups.append((large, self.args.large_iters, self.args.large_warmup))
        return groups

    def ddp(self, nproc, sizes, check=False):
        rows, errors = {}, []
        groups = [(sizes, 1, 0)] if check else self.size_groups(sizes)
        for group, iters, warmup in groups:
            command = [str(self.bin / "ddp-bench"), "--op", "allreduce", "--dtype", "float32",
                       "--reduce-op", "sum", "--json", "--sizes", ",".join(map(str, group)),
                       "--iters", str(iters), "--warmup", str(warmup), "--timeout",
                       str(self.args.timeout)]
            if check:
                command.append("--check")
            code, out = self.host_run(nproc, command)
            got = json_rows(out)
            if code != 0 or len(got) != len(group):
                errors.append(f"failed (exit {code}): {tail(out)}")
                continue
            rows.update({r["bytes"]: r for r in got})
        return rows, "; ".join(errors) or None

    def gloo(self, sizes):
        rows, errors = {}, []
        for group, iters, warmup in self.size_groups(sizes):
            command = [SYSTEM_PYTHON, str(REPO / "bench" / "compare" / "gloo_allreduce.py"),
                       "--sizes", ",".join(map(str, group)), "--iters", str(iters),
                       "--warmup", str(warmup),
                       "--timeout", str(self.args.timeout)]
            code, out = self.host_run(1, command)
            got = json_rows(out)
            if code != 0 or len(got) != len(group):
                errors.append(f"failed (exit {code}): {tail(out)}")
                continue
            rows.update({r["bytes"]: r for r in got})
        return rows, "; ".join(errors) or None

    def openmpi(self, sizes):
        program = self.bin / "mpi_allreduce"
        if not program.exists():
            return {}, f"not built: {program} (needs OpenMPI's libopenmpi-dev)"
        code, hostfile_text = self.cluster("hostfile")
        if code != 0:
            return {}, f"cluster.sh hostfile failed: {hostfile_text.strip()}"
        hostfile = Path(f"/tmp/{self.args.prefix}-hostfile-{os.getpid()}")
        hostfile.write_text(hostfile_text)
        rows, errors = {}, []
        try:
            for group, iters, warmup in self.size_groups(sizes):
                mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                          "--hostfile", str(hostfile), "--mca", "plm_rsh_agent", RSH_AGENT,
                          "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                          "--mca", "btl_tcp_if_include", "eth0",
                          "--mca", "oob_tcp_if_include", "eth0",
                          # The remote orted writes hwloc's topology into shared memory at the
                          # "biggest" hole of its address space, and segfaults there about one
                          # launch in five on this kernel (hwloc_shmem_topology_write; 18 of 90
                          # launches, 0 of 80 with this): ranks then read the topology themselves.
                          "--mca", "rtc_hwloc_vmhole", "none"]
                if self.args.mpi_yield:
                    # What OpenMPI does itself when it knows a node is oversubscribed; it cannot
                    # know here (every host has 1 slot, the hosts share 2 CPUs).
                    mpirun += ["--mca", "mpi_yield_when_idle", "1"]
                mpirun += ["-np", str(self.args.hosts), "-x", "OMP_NUM_THREADS", str(program),
                           "--sizes", ",".join(map(str, group)), "--iters", str(iters),
                           "--warmup", str(warmup), "--label", "openmpi-tcp"]
                argv = ["exec", "0", "--", "timeout", str(self.args.timeout), *mpirun]
                self.note(["scripts/cluster.sh", *argv])
                code, out = self.cluster(*argv, timeout=self.args.timeout + 60)
                got = json_rows(out)
                if code == 213 and not got:
                    # ORTE's daemons could not reach each other across the namespaces ("usually
                    # caused by a firewall"): seen once in a CI run under load, never on a rerun.
                    # One more launch, said on stderr; a second failure is reported.
                    sys.stderr.write(f"openmpi-tcp: the launch failed (exit 213), retrying once: "
                                     f"{tail(out)}\n")
                    code, out = self.cluster(*argv, timeout=self.args.timeout + 60)
                    got = json_rows(out)
                if code != 0 or len(got) != len(group):
                    errors.append(f"failed (exit {code}): {tail(out)}")
                    continue
                rows.update({r["bytes"]: r for r in got})
        finally:
            hostfile.unlink(missing_ok=True)
        return rows, "; ".join(errors) or None


def median_of_rounds(rounds):
    """Per size, the round whose median time is the median of the rounds' (the lower middle one
    for an even count, i.e. the faster of two), with every round's time kept."""
    table = {}
    for nbytes in sorted({b for r in rounds for b in r}):
        rows = sorted((r[nbytes] for r in rounds if nbytes in r), key=lambda row: row["time_us"])
        table[nbytes] = dict(rows[(len(rows) - 1) // 2],
                             rounds_time_us=[row["time_us"] for row in rows])
    return table


def link_busbw(row, hosts):
    """busbw per host link (GB/s): algbw * 2(K-1)/K."""
    return row["bytes"] / (row["time_us"] * 1e-6) / 1e9 * 2 * (hosts - 1) / hosts


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--hosts", type=int, default=4, help="hosts (default 4)")
    parser.add_argument("--rates", default="1gbit,10gbit",
                        help="comma-separated link rates, tc syntax (default 1gbit,10gbit)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        type=lambda t: [parse_size(w) for w in t.split(",")])
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {','.join(ENGINES)}")
    parser.add_argument("--large-from", type=parse_size, default=parse_size("4M"),
                        help="sizes from here on use --large-iters (default 4M)")
    parser.add_argument("--small-iters", type=int, default=20)
    parser.add_argument("--small-warmup", type=int, default=3)
    parser.add_argument("--large-iters", type=int, default=3)
    parser.add_argument("--large-warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="times every engine is measured at each rate, interleaved; the table "
                             "shows the median round (the faster of two) (default 1)")
    parser.add_argument("--link-seconds", type=float, default=3.0,
                        help="duration of the raw TCP ring measurement (default 3)")
    parser.add_argument("--no-unshaped", action="store_true",
                        help="skip the run without shaping (the CPU bound)")
    parser.add_argument("--mtu", type=int, default=1500, help="link MTU (default 1500)")
    parser.add_argument("--no-mpi-yield", dest="mpi_yield", action="store_false",
                        help="let OpenMPI busy-poll (default: --mca mpi_yield_when_idle 1)")
    parser.add_argument("--build-dir", default=os.environ.get("DDP_BUILD_DIR", str(REPO / "build")),
                        help="CMake build tree with bin/ddp-bench, bin/ddprun, bin/mpi_allreduce")
    parser.add_argument("--prefix", default="ddpcb",
                        help="cluster.sh's DDP_CLUSTER_PREFIX for the bench's cluster (ddpcb); "
                             "'{pid}' in it becomes this process's id (a cluster of its own)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per program run")
    parser.add_argument("--json-out", "--json", dest="json_out",
                        help="also write every measurement to this file "
                             "(bench/cluster/plot_cluster.py)")
    parser.add_argument("--tcp-ring-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=5201, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.prefix = args.prefix.replace("{pid}", str(os.getpid()))
    if args.tcp_ring_worker:
        return tcp_ring_worker(args.port, args.link_seconds)

    engines = args.engines.split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        parser.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    rates = [r.strip() for r in args.rates.split(",")]
    for r in rates:
        try:
            parse_rate(r)
        except argparse.ArgumentTypeError as e:
            parser.error(f"--rates: {e}")
    for value, name, low in ((args.hosts, "--hosts", 2), (args.small_iters, "--small-iters", 1),
                             (args.large_iters, "--large-iters", 1), (args.rounds, "--rounds", 1),
                             (args.small_warmup, "--small-warmup", 0),
                             (args.large_warmup, "--large-warmup", 0)):
        if value < low:
            parser.error(f"{name} must be at least {low}, got {value}")
    for program in ("ddp-bench", "ddprun"):
        if not (Path(args.build_dir) / "bin" / program).exists():
            parser.error(f"{args.build_dir}/bin/{program} does not exist: build it first "
                         f"(cmake --build {args.build_dir} --target ddp-bench ddprun "
                         f"mpi_allreduce) or pass --build-dir")
    if os.geteuid() != 0:
        print("cluster_allreduce: needs root for the cluster's network namespaces; skipped",
              file=sys.stderr)
        return SKIPPED
    sizes = [max(1, s // 4) * 4 for s in args.sizes]

    bench = Bench(args)
    code, out = bench.cluster("status")
    if code == 0:
        print(f"cluster_allreduce: a cluster with prefix '{args.prefix}' is already up; take it "
              f"down (DDP_CLUSTER_PREFIX={args.prefix} scripts/cluster.sh down) or pass --prefix",
              file=sys.stderr)
        return 1

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = load_average()
    results = {}  # rate -> {"link": ..., engine: {bytes: row}}
    errors = {}  # (rate, engine) -> text
    checked = {}  # engine -> wrong elements in the checked run
    check_sizes = []  # the sizes of that run
    interrupted = False

    def measure(rate, which):
        print(f"# {rate}: {which} ...", file=sys.stderr, flush=True)

    plan = [(r, engines, sizes) for r in rates]
    if not args.no_unshaped:
        plan.append(("none", ["ddp-ring"], [s for s in sizes if s >= args.large_from] or sizes))
    try:
        for index, (rate, rate_engines, rate_sizes) in enumerate(plan):
            code, out = bench.up(rate)
            if code == SKIPPED:
                print(f"cluster_allreduce: {out.strip()}", file=sys.stderr)
                return SKIPPED
            if code != 0:
                errors[(rate, "cluster")] = f"up failed: {tail(out)}"
                continue
            try:
                res = results.setdefault(rate, {})
                measure(rate, "link (raw TCP ring)")
                res["link"], err = bench.link()
                if err:
                    errors[(rate, "link")] = err
                if index == 0:
                    for engine, nproc in (("ddp-ring", 1), ("ddp-hier", 2)):
                        if engine not in engines:
                            continue
                        measure(rate, f"{engine} --check")
                        check_sizes[:] = [s for s in (1024, 1 << 20, 64 << 20)
                                          if s <= max(sizes)]
                        rows, err = bench.ddp(nproc, check_sizes, check=True)
                        if err:
                            errors[(rate, engine + " check")] = err
                        else:
                            checked[engine] = sum(r["wrong"] or 0 for r in rows.values())
                rounds = {engine: [] for engine in rate_engines}
                for round_index in range(args.rounds):
                    for engine in rate_engines:
                        if (rate, engine) in errors:
                            continue
                        measure(rate, f"{engine} (round {round_index + 1}/{args.rounds})")
                        if engine == "ddp-ring":
                            rows, err = bench.ddp(1, rate_sizes)
                        elif engine == "ddp-hier":
                            rows, err = bench.ddp(2, rate_sizes)
                        elif engine == "gloo":
                            rows, err = bench.gloo(rate_sizes)
                        else:
                            rows, err = bench.openmpi(rate_sizes)
                        rounds[engine].append(rows)
                        if err:
                            errors[(rate, engine)] = err
                for engine, measured in rounds.items():
                    res[engine] = median_of_rounds(measured)
            finally:
                code, out = bench.down()
                if code != 0:
                    errors[(rate, "cluster")] = f"down failed: {tail(out)}"
    except KeyboardInterrupt:
        interrupted = True
        bench.down()
    load_after = load_average()

    # --- report ---
    k = args.hosts
    lines = [f"# Allreduce float32 sum on a simulated cluster: {k} hosts", ""]
    lines.append(f"- date: {started:%Y-%m-%d %H:%M} UTC; host {platform.node()}, kernel "
                 f"{platform.release()}")
    lines.append(f"- machine: {os.cpu_count()} CPUs ({cpu_model()}) shared by every host; load "
                 f"average {load_before} before, {load_after} after")
    commit = tool_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    torch_version = tool_version([SYSTEM_PYTHON, "-c", "import torch; print(torch.__version__)"])
    lines.append(f"- engines: ddp {commit}; gloo from torch {torch_version}; "
                 f"{tool_version(['mpirun', '--version'])}"
                 f" (mpi_yield_when_idle {'1' if args.mpi_yield else 'off'})")
    lines.append(f"- links: tbf at the rate on every host's egress and on its bridge port's egress "
                 f"(full duplex), MTU {args.mtu}; no delay or loss")
    lines.append(f"- method: median of {args.small_iters} iterations after {args.small_warmup} "
                 f"warm-up below {human(args.large_from)}, of {args.large_iters} after "
                 f"{args.large_warmup} from there; each after a barrier, slowest rank's time; "
                 f"{args.rounds} round(s) per engine, interleaved, the median round shown. "
                 f"busbw = algbw · 2(K−1)/K per host link (K = {k}), GB/s = 1e9 B/s")
    lines.append("")
    summary = []
    for rate in [r for r, _, _ in plan]:
        res = results.get(rate, {})
        bits = parse_rate(rate)
        cols = [e for e in (engines if rate != "none" else ["ddp-ring"]) if e in res]
        title = f"## {rate}: shaped to {bits / 8e9:.3f} GB/s each way per host" if bits else \
            "## unshaped (rate none): the machine's own bound"
        lines.append(title)
        lines.append("")
        link = res.get("link")
        if link:
            lines.append(f"Raw TCP ring (every host sends to the next, {args.link_seconds:g} s): "
                         f"{link['recv_gbps']:.3f} GB/s payload per host (slowest host; all: "
                         + ", ".join(f"{x:.3f}" for x in link["per_host_gbps"]) + ")"
                         + (f" = {link['recv_gbps'] / (bits / 8e9):.2f}× the rate" if bits else ""))
            lines.append("")
        header = ["size"]
        for e in cols:
            header += [f"{e} µs", f"{e} busbw"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---:" for _ in header) + "|")
        for nbytes in (sizes if rate != "none" else plan[-1][2]):
            cells = [human(nbytes)]
            for e in cols:
                row = res[e].get(nbytes)
                cells += [f"{row['time_us']:.1f}", f"{link_busbw(row, k):.3f}"] if row else \
                    ["–", "–"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        # Targets at 64 MiB.
        target = 64 << 20
        ring = res.get("ddp-ring", {}).get(target)
        best_ddp = max((res.get(e, {}).get(target) for e in ("ddp-ring", "ddp-hier")
                        if res.get(e, {}).get(target)), key=lambda r: link_busbw(r, k),
                       default=None)
        if bits and best_ddp:
            bw = link_busbw(best_ddp, k)
            which = "ddp-ring" if ring is best_ddp else "ddp-hier"
            ok = bw >= 0.9 * bits / 8e9
            summary.append(f"{rate}, 64 MiB: {which} busbw {bw:.3f} GB/s = "
                           f"{bw / (bits / 8e9):.2f}× the shaped rate (target ≥ 0.9×): "
                           f"{'PASS' if ok else 'FAIL'}"
                           + (f"; {bw / link['recv_gbps']:.2f}× the raw TCP ring" if link else ""))
            for peer in PEERS:
                prow = res.get(peer, {}).get(target)
                if prow:
                    x = link_busbw(best_ddp, k) / link_busbw(prow, k)
                    summary.append(f"{rate}, 64 MiB: {which} {x:.2f}× {peer}'s busbw "
                                   f"(target > 1×): {'PASS' if x > 1 else 'FAIL'}")
        if not bits and ring:
            summary.append(f"unshaped, 64 MiB: ddp-ring busbw {link_busbw(ring, k):.3f} GB/s"
                           + (f"; raw TCP ring {link['recv_gbps']:.3f} GB/s" if link else ""))
    if summary:
        lines.append("Targets:")
        lines += [f"- {s}" for s in summary]
        lines.append("")
    if checked:
        lines.append("- wrong elements: " + ", ".join(f"{e} {w}" for e, w in checked.items())
                     + f" (ddp: a ddp-bench --check run of {', '.join(map(human, check_sizes))} at the first "
                     "rate); "
                     + ", ".join(f"{p} {sum((r.get('wrong') or 0) for res in results.values() for r in res.get(p, {}).values())}"
                                 for p in PEERS if p in engines)
                     + " (the peers: the last iteration of every size)")
    for (rate, what), text in errors.items():
        lines.append(f"- {rate} {what}: {text}")
    if interrupted:
        lines.append("- interrupted (Ctrl-C): the tables are partial")
    lines.append("")
    lines.append("Commands (DDP_CLUSTER_PREFIX=" + args.prefix + ", OMP_NUM_THREADS=1):")
    lines += [f"- `{c}`" for c in bench.commands]
    print("\n".join(lines), flush=True)

    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "date": started.isoformat(), "hosts": k, "cpus": os.cpu_count(),
            "cpu_model": cpu_model(), "kernel": platform.release(), "load_before": load_before,
            "load_after": load_after, "mtu": args.mtu, "mpi_yield_when_idle": args.mpi_yield,
            "results": {rate: {e: (rows if e == "link" else {str(b): r for b, r in rows.items()})
                               for e, rows in res.items()} for rate, res in results.items()},
            "checked_wrong": checked, "errors": {f"{r} {w}": t for (r, w), t in errors.items()},
            "commands": bench.commands}, indent=1))
    return 1 if errors or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
