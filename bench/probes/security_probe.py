#!/usr/bin/python3
"""Attacks a real ddp job that runs with a secret, from this machine on 127.0.0.1 only, and prints
a markdown table of the attacks tried and their outcomes (issue 15, "Numbers to reach").

    /usr/bin/python3 bench/probes/security_probe.py --build build          # the real run (~15 min)
    /usr/bin/python3 bench/probes/security_probe.py --build build --quick  # a smoke run (~2 min)

Every job is `ddprun --nproc-per-node W --master-port P --secret-file F ddp-bench --check ...`
with DDP_TRANSPORT=tcp (so that the data plane carries the collectives). Rows:

  store impostors  join the store without the secret, with a wrong one, replaying a recorded
                   client handshake, with a zero MAC, another protocol version, a cut handshake
  data impostors   claim the missing rank on every rank's data port: the plain hello of a job
                   without a secret, a guessed MAC, the acceptor's own MAC reflected, a replayed
                   (recorded) connector MAC, a MAC under the right secret but another job's
                   session, a MAC under another secret; then collective bytes on the connection
  fuzz             random and mutated handshakes/frames to the store port and to every data port
  idle             N idle connections over the store port and the data ports, kept open while
                   the job runs
  memory           rank 0's (the store host's) RSS under the attacks vs the baseline job, and
                   the store's memory limit documented in docs/store.md (n/a where none is)

The job runs with a soft descriptor limit of 1024 (--job-nofile), the usual default: the idle row
fails when rank 0 reaches it (its store accepted connections until it had no descriptor left,
so any file the job opened then would fail).

A rank's data port listens only while its group is being set up (the listener is closed once the
mesh is complete), so the data-plane rows hold the set-up open: the probe stops the highest rank
(SIGSTOP) as soon as it listens, before it connects to anyone, which leaves every other rank
waiting for it with its data port open; the attacks run then, and SIGCONT lets the job go on.
The job's time is reported without that hold. Stepping the rank can miss (it may connect to
everyone within one burst on a loaded machine); a held row then tries up to 5 jobs.

"accepted" counts attempts that got in: a store client that got status 0 or a reply to a
request, a data connection that the rank took and did not close within --verdict-seconds after a
wrong MAC (or the acceptor's answer to a plain hello). It must be 0; the script exits 1
otherwise, or when a job fails (exit code, --check) or an attack could not be run. A rank keeps
its collective mesh's listener open for peers that connect on first use but accepts on it only
while an operation waits for one: the data rows attack every listener of the waiting ranks that
accepts during the hold (a connection the rank never takes off a listener's queue reaches
nothing of it, and is counted "unanswered", not an attempt).

Everything is bounded in count and time, talks to 127.0.0.1 only, and every process it starts is
killed on exit (Ctrl-C included). Python 3 standard library only.
"""

import argparse
import hashlib
import hmac
import os
import random
import re
import resource
import selectors
import errno
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

HOST = "127.0.0.1"
STORE_MAGIC = 0x53504444  # "DDPS"
STORE_VERSION = 1
RING_PLAIN_MAGIC = 0x52504444  # "DDPR"
RING_AUTH_MAGIC = 0x41504444  # "DDPA"
RING_VERSION = 1
HEADER_MAGIC = 0x48504444  # "DDPH"
GROUP = b"default"
SESSION_KEY = b"ddp/pg/ring/default/0/auth/session"

JOBS = []  # every Popen started, for the clean-up
# The descriptor limit the probe found; the job gets it back (the probe raises its own).
ORIGINAL_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)
JOBS_LOCK = threading.Lock()


# --- small helpers ---------------------------------------------------------------------------


def log(msg):
    print(f"[probe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def connect(port, timeout=3.0):
    s = socket.create_connection((HOST, port), timeout=timeout)
    s.settimeout(timeout)
    return s


def recv_exact(s, n):
    """n bytes, or fewer when the peer closed (b'' on EOF at once)."""
    out = b""
    while len(out) < n:
        try:
            chunk = s.recv(n - len(out))
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        out += chunk
    return out


def closed_by_peer(s, seconds):
    """True when the peer closes (EOF or reset) within `seconds`; bytes it sends are drained."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        s.settimeout(left)
        try:
            if not s.recv(65536):
                return True
        except socket.timeout:
            return False
        except OSError:
            return True


def send_quietly(s, data):
    try:
        s.sendall(data)
        return True
    except OSError:
        return False


class Counter:
    def __init__(self):
        self.lock = threading.Lock()
        self.values = {}

    def add(self, key, n=1):
        with self.lock:
            self.values[key] = self.values.get(key, 0) + n

    def get(self, key):
        with self.lock:
            return self.values.get(key, 0)


# --- /proc: the job's processes, their listening ports, their memory --------------------------


def children_of(pid):
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except (OSError, ValueError):
        pass
    return None


def socket_inodes(pid):
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def tcp_table_rows(pid):
    """The split rows of /proc/PID/net/tcp and tcp6 (the process's network namespace)."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    yield line.split()
        except (OSError, StopIteration):
            pass


def tcp_port(address):
    """The port of a /proc/net/tcp address field (hex "ADDR:PORT")."""
    return int(address.rsplit(":", 1)[1], 16)


def listening_ports(pid):
    """TCP ports `pid` listens on (from its /proc/PID/net/tcp{,6} and its descriptors)."""
    inodes = socket_inodes(pid)
    if not inodes:
        return set()
    return {tcp_port(parts[1]) for parts in tcp_table_rows(pid)
            if parts[3] == "0A" and parts[9] in inodes}


def rank_took(pid, s):
    """Whether process `pid` accept()ed the connection `s`: True when its end of it is one of the
    process's descriptors, False while the connection waits in the queue of a listener the
    process is not accepting on at the moment (no descriptor: inode 0 in /proc/net/tcp), None
    when the connection is gone (the process closed it)."""
    try:
        mine, theirs = s.getsockname()[1], s.getpeername()[1]
    except OSError:
        return None
    inodes = socket_inodes(pid)
    for parts in tcp_table_rows(pid):
        if tcp_port(parts[1]) == theirs and tcp_port(parts[2]) == mine:
            return parts[9] in inodes
    return None


def served_now(pid, port, seconds):
    """Whether `pid` accepts connections on `port` now: a connection it takes within `seconds`.
    A rank keeps a collective mesh's listener open for peers that connect on first use and
    accepts on it only while an operation waits for one (docs/security.md)."""
    try:
        with connect(port) as s:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                taken = rank_took(pid, s)
                if taken is None or taken:
                    return True
                time.sleep(0.01)
    except OSError:
        return False
    return False


def proc_status_kib(pid, field):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def open_fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def fd_soft_limit(pid):
    """The process's own soft limit on descriptors now (the store raises it to the hard limit)."""
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    return int(line.split()[3])
    except (OSError, ValueError, IndexError):
        pass
    return None


# --- the job ------------------------------------------------------------------------------------


class Job:
    """One ddprun launch of ddp-bench --check with the secret; output to a file."""

    def __init__(self, args, workdir, name, timeout_s):
        self.args, self.name = args, name
        self.port = free_port()
        self.out_path = os.path.join(workdir, f"{name}.log")
        self.timeout_s = timeout_s
        self.proc = None
        self.t_start = self.t_end = None
        self.hold_s = 0.0
        self.workers = {}  # rank -> pid
        self.rss_max_kib = 0
        self.fds_max = 0
        self.fds_limit = None  # rank 0's soft limit when it held the most descriptors
        self._stop = threading.Event()
        self._sampler = None

    def start(self):
        env = dict(os.environ)
        env.pop("DDP_SECRET", None)
        env.pop("DDP_SECRET_FILE", None)
        env["DDP_TRANSPORT"] = self.args.transport
        env["DDP_TIMEOUT"] = str(int(self.timeout_s))
        cmd = [os.path.join(self.args.build, "bin", "ddprun"), "--nproc-per-node",
               str(self.args.world), "--master-addr", HOST, "--master-port", str(self.port),
               "--secret-file", self.args.secret_file,
               os.path.join(self.args.build, "bin", "ddp-bench"), "--check", "--sizes",
               self.args.size, "--iters", str(self.args.iters), "--warmup", "2"]
        # The job gets its own descriptor limit back (the probe raised its own for --idle).
        cmd = ["/bin/sh", "-c", 'ulimit -Sn "$0" && exec "$@"', str(self.args.job_nofile)] + cmd
        self.out = open(self.out_path, "wb")
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        with JOBS_LOCK:
            JOBS.append(self)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def find_workers(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = {}
            for pid in children_of(self.proc.pid):
                r = rank_of(pid)
                if r is not None:
                    found[r] = pid
            if len(found) == self.args.world:
                self.workers = found
                return True
            time.sleep(0.002)
        return False

    def _sample(self):
        while not self._stop.is_set() and self.proc.poll() is None:
            pid = self.workers.get(0)
            if pid:
                rss = proc_status_kib(pid, "VmRSS")
                hwm = proc_status_kib(pid, "VmHWM")
                fds = open_fds(pid)
                self.rss_max_kib = max(self.rss_max_kib, rss or 0, hwm or 0)
                if (fds or 0) > self.fds_max:
                    self.fds_max = fds
                    self.fds_limit = fd_soft_limit(pid)
            time.sleep(0.05)

    def data_ports(self):
        """rank -> data ports listening now (the store's port excluded)."""
        out = {}
        for r, pid in self.workers.items():
            ports = listening_ports(pid) - {self.port}
            if ports:
                out[r] = ports
        return out

    def wait(self):
        try:
            self.proc.wait(timeout=self.timeout_s + 120)
        except subprocess.TimeoutExpired:
            log(f"{self.name}: still running after {self.timeout_s + 120:.0f} s: killing it")
            self.kill()
            self.proc.wait()
        self.t_end = time.monotonic()
        self._stop.set()
        self.out.close()
        return self.proc.returncode

    def kill(self):
        if self.proc and self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except OSError:
                    pass

    @property
    def run_s(self):
        return (self.t_end - self.t_start) - self.hold_s

    def output(self):
        with open(self.out_path, "rb") as f:
            return f.read().decode(errors="replace")

    def check_ok(self):
        """exit 0 and every result row of rank 0 says 0 wrong elements."""
        text = self.output()
        rows = [l for l in text.splitlines() if re.match(r"^\[0\]\s+\w+\s+\d+\s+\d+\s", l)]
        return (self.proc.returncode == 0 and bool(rows)
                and all(l.split()[-1] == "0" for l in rows))

    def collective_us(self):
        """The median time of the collective that rank 0 printed (µs), or None."""
        for line in self.output().splitlines():
            if re.match(r"^\[0\]\s+\w+\s+\d+\s+\d+\s", line):
                return float(line.split()[5])
        return None

    def count(self, needle):
        return self.output().count(needle)


def hold_set_up(job, timeout=120.0, burst_s=0.0):
    """Stops the highest rank once it listens (before it connects to anyone), leaving the other
    ranks waiting for it with their data ports open. On a loaded machine the probe may not be
    scheduled for a long time, so the rank is not watched while it runs free: it is stopped at
    once, pinned to the probe's CPU (so that it runs only while the probe yields), let run in
    short bursts (until it blocks, or `burst_s`) and checked between bursts. Returns {rank: port} of the ranks that
    listen, or {} (then the job was let go on)."""
    if not job.find_workers():
        return {}
    last = job.workers[max(job.workers)]
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    try:
        os.kill(last, signal.SIGSTOP)
        job.hold_started = time.monotonic()
        theirs = os.sched_getaffinity(last)
        os.sched_setaffinity(0, {cpu})
        os.sched_setaffinity(last, {cpu})
        deadline = time.monotonic() + timeout
        try:
            while True:
                if job.proc.poll() is not None or time.monotonic() > deadline:
                    release(job, held=False)
                    return {}
                if listening_ports(last):
                    break
                # Sleeping while the rank is stopped keeps the probe ahead of it on the CPU (a
                # busy probe would be scheduled after the rank); the rank then runs on the
                # probe's CPU only until it blocks or the probe preempts it.
                time.sleep(0.001)
                os.kill(last, signal.SIGCONT)
                os.sched_yield()
                if burst_s:
                    time.sleep(burst_s)
                os.kill(last, signal.SIGSTOP)
        finally:
            os.sched_setaffinity(0, mine)
            try:
                os.sched_setaffinity(last, theirs)
            except OSError:
                pass
    except ProcessLookupError as e:
        log(f"{job.name}: rank {max(job.workers)} (pid {last}) is gone ({e}; job exit "
            f"{job.proc.poll()}); cannot hold the set-up")
        release(job, held=False)
        return {}
    # Every rank below the stopped one listens for it, unless the stopped rank got through first.
    settle = time.monotonic() + 5.0
    ports = {}
    while time.monotonic() < settle:
        ports = {r: min(p) for r, p in job.data_ports().items() if r != max(job.workers)}
        if len(ports) == len(job.workers) - 1:
            break
        time.sleep(0.05)
    if not ports:
        release(job, held=False)
    return ports


def start_held_job(args, workdir, name, timeout_s, row, tries=5):
    """A job whose set-up is held (see hold_set_up), trying up to `tries` jobs; the jobs that
    could not be held run to their end and are recorded in `row`. Returns (job, ports) or
    (None, {})."""
    for attempt in range(tries):
        job = Job(args, workdir, f"{name}{attempt}", timeout_s)
        job.start()
        ports = hold_set_up(job)
        if ports:
            return job, ports
        row.notes.append(f"{job.name}: the set-up could not be held (the last rank got through "
                         f"first)")
        job.wait()
        row.jobs.append(job)
    return None, {}


def release(job, held=True):
    """Lets the stopped rank go on; `held`: the set-up was held (its time is not the job's)."""
    pid = job.workers[max(job.workers)]
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass
    if hasattr(job, "hold_started"):
        if held:
            job.hold_s = time.monotonic() - job.hold_started
        del job.hold_started


# --- the store, as a client (for the operator's recordings and for attacks) --------------------


def store_hello(version=STORE_VERSION):
    return struct.pack("<II", STORE_MAGIC, version)


def store_frame(code, body=b""):
    return struct.pack("<IB", 1 + len(body), code) + body


def store_bytes(b):
    return struct.pack("<I", len(b)) + b


def store_handshake(s):
    """Sends the hello, returns (status, Ns or None)."""
    s.sendall(store_hello())
    head = recv_exact(s, 9)
    if len(head) < 9:
        return None, None
    status = head[8]
    nonce = recv_exact(s, 32) if status == 2 else None
    return status, nonce


def store_client_mac(secret, nonce):
    return hmac.new(secret, b"ddp-store client" + nonce, hashlib.sha256).digest()


def store_login(port, secret):
    """An authenticated connection (the operator's own client, who knows the secret)."""
    s = connect(port)
    status, ns = store_handshake(s)
    if status != 2:
        raise RuntimeError(f"the store answered status {status}, expected 2 (auth required)")
    nc = os.urandom(32)
    s.sendall(store_client_mac(secret, ns) + nc)
    ok = recv_exact(s, 33)
    if len(ok) != 33 or ok[0] != 0:
        raise RuntimeError("the store refused the real secret")
    if not hmac.compare_digest(ok[1:], hmac.new(secret, b"ddp-store server" + nc,
                                                hashlib.sha256).digest()):
        raise RuntimeError("the store's proof is wrong")
    return s


def store_get_if_present(s, key):
    s.sendall(store_frame(5, struct.pack("<I", 1) + store_bytes(key)))  # check
    n, = struct.unpack("<I", recv_exact(s, 4))
    body = recv_exact(s, n)
    if body[0] != 0 or body[1] != 1:
        return None
    s.sendall(store_frame(2, store_bytes(key)))  # get
    n, = struct.unpack("<I", recv_exact(s, 4))
    body = recv_exact(s, n)
    size, = struct.unpack("<I", body[1:5])
    return body[5:5 + size]


def store_impostor(port, variant, secret, verdict_s):
    """One attempt to get into the store without the secret. Returns 'refused', 'accepted', or
    'error: ...' (the attempt could not be made)."""
    try:
        s = connect(port)
    except OSError as e:
        return f"error: connect: {e}"
    with s:
        try:
            if variant == "version":
                s.sendall(store_hello(random.choice([0, 2, 0xFFFFFFFF])))
                head = recv_exact(s, 9)
                if len(head) == 9 and head[8] == 0:
                    return "accepted"
                s.sendall(store_frame(2, store_bytes(b"ddp/rendezvous/0/complete")))
                return "refused" if closed_by_peer(s, verdict_s) else "accepted"
            status, ns = store_handshake(s)
            if status is None:
                return "refused"
            if status != 2:
                return "accepted"  # the store let a client in without authentication
            if variant == "no secret":
                # A client without a secret just sends its request (padded past the 64 bytes the
                # server reads as the answer to its challenge).
                answer = store_frame(2, store_bytes(b"ddp/rendezvous/0/complete" + b"x" * 40))
            elif variant == "wrong secret":
                answer = store_client_mac(b"a guess at the secret", ns) + os.urandom(32)
            elif variant == "zero MAC":
                answer = bytes(64)
            elif variant == "replay":
                # Record a real client's answer on one connection, replay it on another.
                rec = connect(port)
                with rec:
                    _, ns_rec = store_handshake(rec)
                    answer = store_client_mac(secret, ns_rec) + os.urandom(32)
                    rec.sendall(answer)
                    recv_exact(rec, 33)
            elif variant == "cut handshake":
                s.sendall(os.urandom(random.randint(1, 63)))
                s.shutdown(socket.SHUT_WR)
                return "refused" if closed_by_peer(s, verdict_s) else "accepted"
            else:
                raise ValueError(variant)
            if not send_quietly(s, answer):
                return "refused"
            first = recv_exact(s, 1)
            if first == b"\0":
                return "accepted"
            # Refused (status 1 or EOF): a request sent anyway must get no answer.
            send_quietly(s, store_frame(8))
            return "refused" if closed_by_peer(s, verdict_s) else "accepted"
        except socket.timeout:
            return "accepted"  # neither refused nor closed within the deadline
        except OSError:
            return "refused"


STORE_VARIANTS = ["no secret", "wrong secret", "replay", "zero MAC", "version", "cut handshake"]


# --- the data plane -----------------------------------------------------------------------------


def ring_hello(magic, size, frm, to, name=GROUP):
    return struct.pack("<IIiiiI", magic, RING_VERSION, size, frm, to, len(name)) + name


def u32(v):
    return struct.pack("<I", v & 0xFFFFFFFF)


def ring_mac(secret, acceptor_side, session, size, connector, acceptor, nc, na):
    t = (u32(len(session)) + session + u32(len(GROUP)) + GROUP + u32(size) + u32(connector) +
         u32(acceptor) + nc + na)
    role = b"ddp-ring acceptor" if acceptor_side else b"ddp-ring connector"
    return hmac.new(secret, role + t, hashlib.sha256).digest()


def collective_bytes(count=4096):
    header = struct.pack("<IBBBBQQii", HEADER_MAGIC, 0, 0, 0, 1, 0, count, -1, 0)
    return header + b"\xff" * (4 * count)


def data_impostor(port, rank, pid, world, variant, secret, session, verdict_s):
    """Claims rank world-1 (the one being held) towards `rank` (process `pid`). Returns 'refused',
    'accepted', 'unanswered' (the rank never took the connection off its listener's queue: it was
    not accepting there, so nothing of the attempt reached it), 'no listener' or 'error: ...'."""

    def verdict(s):
        if closed_by_peer(s, verdict_s):
            return "refused"
        return "unanswered" if rank_took(pid, s) is False else "accepted"

    claimed = world - 1
    try:
        s = connect(port)
    except ConnectionRefusedError:
        return "no listener"
    except OSError as e:
        return f"error: connect: {e}"
    answer_len = 24 + len(GROUP) + 64
    with s:
        try:
            if variant == "plain hello":
                # The injection of the issue: the hello of a job without a secret, then data.
                s.sendall(ring_hello(RING_PLAIN_MAGIC, world, claimed, rank))
                got = recv_exact(s, 24 + len(GROUP))
                if len(got) == 24 + len(GROUP):
                    return "accepted"  # the rank answered a plain hello
                send_quietly(s, collective_bytes())
                return verdict(s)
            nc = os.urandom(32)
            hello = ring_hello(RING_AUTH_MAGIC, world, claimed, rank) + nc
            if variant == "replay":
                # Record: a real connector's MAC for the acceptor's nonce on a first connection
                # (computed here with the operator's secret, exactly what a wire recording holds).
                with connect(port) as rec:
                    rec.sendall(hello)
                    a = recv_exact(rec, answer_len)
                    if len(a) < answer_len:
                        return "refused"
                    na_rec = a[24 + len(GROUP):24 + len(GROUP) + 32]
                    recorded = ring_mac(secret, False, session, world, claimed, rank, nc, na_rec)
            s.sendall(hello)
            a = recv_exact(s, answer_len)
            if len(a) < answer_len:
                return "refused"  # closed before answering
            na = a[24 + len(GROUP):24 + len(GROUP) + 32]
            their_mac = a[24 + len(GROUP) + 32:]
            if variant == "guessed MAC":
                mac = os.urandom(32)
            elif variant == "reflected MAC":
                mac = their_mac
            elif variant == "replay":
                mac = recorded
            elif variant == "other session":
                mac = ring_mac(secret, False, os.urandom(32).hex().encode(), world, claimed, rank,
                               nc, na)
            elif variant == "wrong secret":
                mac = ring_mac(b"not the secret", False, session, world, claimed, rank, nc, na)
            else:
                raise ValueError(variant)
            if not send_quietly(s, mac):
                return "refused"
            send_quietly(s, collective_bytes())
            return verdict(s)
        except socket.timeout:
            return verdict(s)
        except OSError:
            return "refused"


DATA_VARIANTS = ["plain hello", "guessed MAC", "reflected MAC", "replay", "other session",
                 "wrong secret"]


# --- fuzz ---------------------------------------------------------------------------------------


def mutate(data, rng):
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            pos = rng.randint(0, len(b))
            b[pos:pos] = rng.randbytes(rng.randint(1, 64))
        elif op == 3 and len(b) >= 4:
            pos = rng.randrange(len(b) - 3)
            b[pos:pos + 4] = struct.pack("<I", rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF,
                                                           rng.getrandbits(32)]))
    return bytes(b)


def store_fuzz_case(rng):
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randint(1, 4096))
    if kind == 1:
        return mutate(store_hello(), rng)
    if kind == 2:  # hello, a random answer to the challenge, then frames
        frames = b"".join(store_frame(rng.randint(0, 255), rng.randbytes(rng.randint(0, 64)))
                          for _ in range(rng.randint(1, 4)))
        return store_hello() + rng.randbytes(64) + frames
    if kind == 3:  # frames without a handshake, some of them huge in the length field
        return mutate(store_frame(rng.randint(1, 9), store_bytes(b"ddp/x") + store_bytes(b"v")),
                      rng)
    return mutate(store_hello() + rng.randbytes(64), rng)


def data_fuzz_case(rng, world):
    kind = rng.randrange(4)
    magic = rng.choice([RING_AUTH_MAGIC, RING_PLAIN_MAGIC])
    hello = ring_hello(magic, world, rng.randint(0, world), rng.randint(0, world))
    if kind == 0:
        return rng.randbytes(rng.randint(1, 4096))
    if kind == 1:
        return mutate(hello + rng.randbytes(32), rng)
    if kind == 2:  # a whole handshake's worth of bytes, then collective data
        return hello + rng.randbytes(64) + collective_bytes(rng.randint(1, 256))
    name_len = rng.choice([0, 7, 4096, 4097, 0xFFFFFFFF])
    return struct.pack("<IIiiiI", magic, rng.choice([0, 1, 2]), rng.randint(-2, 9),
                       rng.randint(-2, 9), rng.randint(-2, 9), name_len) + rng.randbytes(40)


class Fuzzer:
    """Connections with random/mutated bytes at a bounded rate until stopped."""

    def __init__(self, name, targets, make_case, rate, seed, threads=8):
        self.name, self.targets, self.make_case = name, targets, make_case
        self.rate, self.seed = rate / threads, seed
        self.stats = Counter()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(seed * 1000 + i,), daemon=True)
                        for i in range(threads)]

    def start(self):
        for t in self.threads:
            t.start()

    def join(self):
        self.stop.set()
        for t in self.threads:
            t.join()

    def _run(self, seed):
        rng = random.Random(seed)
        while not self.stop.is_set():
            ports = self.targets()
            if not ports:
                self.stop.wait(0.02)
                continue
            port = rng.choice(ports)
            case = self.make_case(rng)
            try:
                with socket.create_connection((HOST, port), timeout=1.0) as s:
                    s.settimeout(0.2)
                    self.stats.add("connections")
                    try:
                        s.sendall(case)
                        self.stats.add("bytes", len(case))
                    except OSError:
                        self.stats.add("reset while sending")
                    if rng.random() < 0.1:
                        self.stop.wait(0.2)  # some stay a moment, half-sent
                    try:
                        s.recv(4096)
                    except OSError:
                        pass
            except ConnectionRefusedError:
                self.stats.add("no listener")
            except OSError:
                self.stats.add("connect errors")
            self.stop.wait(1.0 / self.rate)


# --- idle connections ---------------------------------------------------------------------------


def open_idle(ports, n, seconds):
    """Starts n non-blocking connections spread over `ports` and waits up to `seconds` for them.
    Returns (established sockets, failed count, sockets still connecting): a listener that stops
    accepting leaves the rest in SYN retries, which are kept too."""
    sel = selectors.DefaultSelector()
    established, failed = [], 0
    for i in range(n):
        s = socket.socket()
        s.setblocking(False)
        err = s.connect_ex((HOST, ports[i % len(ports)]))
        if err == 0:
            established.append(s)
        elif err in (errno.EINPROGRESS, errno.EAGAIN):
            sel.register(s, selectors.EVENT_WRITE)
        else:
            failed += 1
            s.close()
    deadline = time.monotonic() + seconds
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            s = key.fileobj
            sel.unregister(s)
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                established.append(s)
            else:
                failed += 1
                s.close()
    pending = [key.fileobj for key in list(sel.get_map().values())]
    sel.close()
    return established, failed, pending


def still_open(socks):
    n = 0
    for s in socks:
        try:
            s.setblocking(False)
            if s.recv(1, socket.MSG_PEEK) == b"":
                continue  # EOF
            n += 1
        except BlockingIOError:
            n += 1
        except OSError:
            pass
    return n


def close_all(socks):
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


# --- the rows -----------------------------------------------------------------------------------


class Row:
    def __init__(self, attack):
        self.attack = attack
        self.attempts = 0
        self.accepted = 0
        self.jobs = []
        self.notes = []
        self.failed_to_run = False


def job_result(row, baseline_s, baseline_us):
    if not row.jobs:
        return "no job"
    parts = []
    for job in row.jobs:
        ok = "--check OK" if job.check_ok() else "**--check FAILED**"
        ratio = job.run_s / baseline_s if baseline_s else float("nan")
        hold = f", {job.hold_s:.1f} s hold excluded" if job.hold_s else ""
        us = job.collective_us()
        op = (f", allreduce {us / 1000:.1f} ms ({us / baseline_us:.2f}x)"
              if us and baseline_us else "")
        parts.append(f"exit {job.proc.returncode}, {ok}, {job.run_s:.1f} s "
                     f"({ratio:.2f}x baseline{hold}){op}")
    if len(parts) > 3:
        bad = [p for p in parts if "FAILED" in p or not p.startswith("exit 0")]
        times = [j.run_s for j in row.jobs]
        ops = [j.collective_us() for j in row.jobs if j.collective_us()]
        op = (f", allreduce {max(ops) / 1000:.1f} ms at most ({max(ops) / baseline_us:.2f}x)"
              if ops and baseline_us else "")
        return (f"{len(parts)} jobs, {len(parts) - len(bad)} exit 0 + --check OK; "
                f"{min(times):.1f}..{max(times):.1f} s ({max(times) / baseline_s:.2f}x "
                f"baseline at most){op}" + ("; " + "; ".join(bad) if bad else ""))
    return "; ".join(parts)


def run_attempts(fn, variants, count, deadline):
    tally = {}
    i = 0
    while i < count and time.monotonic() < deadline:
        v = variants[i % len(variants)]
        outcome = fn(v)
        tally.setdefault(v, {}).setdefault(outcome, 0)
        tally[v][outcome] += 1
        i += 1
    return tally


def summarize(tally):
    attempts = sum(n for v in tally.values() for o, n in v.items()
                   if o in ("refused", "accepted"))
    accepted = sum(v.get("accepted", 0) for v in tally.values())
    detail = ", ".join(f"{v}: " + "/".join(f"{n} {o}" for o, n in sorted(os_.items()))
                       for v, os_ in tally.items())
    return attempts, accepted, detail


def wait_for_store(job, timeout=60.0):
    """True once rank 0's store accepts connections."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        if job.workers.get(0) and job.port in listening_ports(job.workers[0]):
            return True
        time.sleep(0.01)
    return False


def row_store_impostors(args, secret, workdir, baseline_s, timeout_s):
    row = Row("store impostors (no secret, wrong secret, replayed client handshake, zero MAC, "
              "other version, cut handshake)")
    tally = {}
    # While the job runs its collectives; jobs follow one another until every attempt is made.
    for attempt in range(5):
        done = sum(n for v in tally.values() for n in v.values())
        if done >= args.attempts:
            break
        job = Job(args, workdir, f"store_impostors{attempt}", timeout_s)
        job.start()
        job.find_workers()
        if wait_for_store(job):
            while done < args.attempts and job.proc.poll() is None:
                v = STORE_VARIANTS[done % len(STORE_VARIANTS)]
                outcome = store_impostor(job.port, v, secret, args.verdict_seconds)
                if outcome.startswith("error") and job.proc.poll() is not None:
                    break  # the job ended under the attempt: not counted
                tally.setdefault(v, {}).setdefault(outcome, 0)
                tally[v][outcome] += 1
                done += 1
        job.wait()
        row.jobs.append(job)
        row.notes.append(f"job {attempt + 1}: store logged {job.count('authentication failed')} "
                         f"'authentication failed'")
    row.attempts, row.accepted, detail = summarize(tally)
    row.notes.append(detail)
    if row.attempts < args.attempts:
        row.failed_to_run = True
        row.notes.append(f"only {row.attempts} of {args.attempts} attempts were made")
    return row


def row_data_impostors(args, secret, workdir, baseline_s, timeout_s):
    row = Row("data-plane impostors claiming the held rank (plain hello, guessed MAC, reflected "
              "MAC, replayed MAC, other job's session, wrong secret), then collective bytes")
    tally = {}
    job, ports = start_held_job(args, workdir, "data_impostors", timeout_s, row)
    if job:
        with store_login(job.port, secret) as s:
            session = store_get_if_present(s, SESSION_KEY) or b""
        if not session:
            row.notes.append("no session id in the store: replay/other-session MACs use ''")
        # Every data listener of the waiting ranks that accepts now: a rank also keeps its
        # collective mesh's listener open, and accepts there only while an operation waits for a
        # peer that connects on first use (an attempt there would wait in the queue, unanswered).
        targets, unserved = [], []
        for r, listening in sorted(job.data_ports().items()):
            if r == max(job.workers):
                continue
            for port in sorted(listening):
                served = served_now(job.workers[r], port, args.verdict_seconds)
                (targets if served else unserved).append((r, port))
        if unserved:
            row.notes.append("not accepting during the hold (not attacked): " + ", ".join(
                f"rank {r} port {port}" for r, port in unserved))
        per_port = (args.attempts + len(targets) - 1) // max(1, len(targets))
        deadline = time.monotonic() + 120
        for r, port in targets:
            t = run_attempts(
                lambda v: data_impostor(port, r, job.workers[r], args.world, v, secret, session,
                                        args.verdict_seconds),
                DATA_VARIANTS, max(per_port, len(DATA_VARIANTS)), deadline)
            for v, outcomes in t.items():
                for o, n in outcomes.items():
                    tally.setdefault(v, {}).setdefault(o, 0)
                    tally[v][o] += n
        still = job.data_ports()
        release(job)
        job.wait()
        row.jobs.append(job)
        row.notes.append(f"attacked ranks {sorted({r for r, _ in targets})} on ports "
                         f"{[port for _, port in targets]}; still listening after the attacks: "
                         f"{sorted(still)}")
        row.notes.append(f"ranks logged {job.count('refused a connection')} refusals")
    else:
        row.failed_to_run = True
    row.attempts, row.accepted, detail = summarize(tally)
    row.notes.append(detail)
    if row.attempts < args.attempts:
        row.failed_to_run = True
        row.notes.append(f"only {row.attempts} of {args.attempts} attempts reached a listener")
    return row


def row_fuzz(args, secret, workdir, baseline_s, timeout_s):
    row = Row(f"fuzz: random/mutated bytes to the store port and every data port, "
              f"{args.fuzz_seconds:.0f} s")
    current = {"job": None, "held": {}, "data": []}
    stop_scan = threading.Event()

    def store_targets():
        job = current["job"]
        return [job.port] if job and job.proc.poll() is None else []

    def data_targets():
        return current["data"]

    def scan():
        # One thread looks for data ports (short-lived outside a hold); the fuzzers read its list.
        while not stop_scan.is_set():
            job = current["job"]
            if current["held"]:
                current["data"] = list(current["held"].values())
            elif job and job.workers and job.proc.poll() is None:
                current["data"] = [p for ports in job.data_ports().values() for p in ports]
            else:
                current["data"] = []
            stop_scan.wait(0.005)

    store_fuzz = Fuzzer("store", store_targets, store_fuzz_case, args.fuzz_rate, 1)
    data_fuzz = Fuzzer("data", data_targets, lambda rng: data_fuzz_case(rng, args.world),
                       args.fuzz_rate, 2)
    scanner = threading.Thread(target=scan, daemon=True)
    end = time.monotonic() + args.fuzz_seconds
    try:
        # The first job is held at set-up for half of the time: its data ports get fuzzed.
        # (The hold is taken before the fuzzers start: they would starve the probe's stepping.)
        job, ports = start_held_job(args, workdir, "fuzz_held", timeout_s, row)
        end = time.monotonic() + args.fuzz_seconds
        current["job"], current["held"] = job, ports
        scanner.start()
        store_fuzz.start()
        data_fuzz.start()
        if job:
            time.sleep(max(0.0, args.fuzz_seconds / 2))
            row.notes.append(f"{job.name}: set-up held for {args.fuzz_seconds / 2:.0f} s with "
                             f"ranks {sorted(ports)} listening on {sorted(ports.values())}")
            current["held"] = {}
            release(job)
            job.wait()
            row.jobs.append(job)
        else:
            row.failed_to_run = True
        while time.monotonic() < end:
            job = Job(args, workdir, f"fuzz{len(row.jobs)}", timeout_s)
            job.start()
            job.find_workers()
            current["job"] = job
            job.wait()
            row.jobs.append(job)
    finally:
        store_fuzz.join()
        data_fuzz.join()
        stop_scan.set()
        if scanner.is_alive():
            scanner.join()
    for f in (store_fuzz, data_fuzz):
        st = f.stats.values
        row.notes.append(f"{f.name}: {st.get('connections', 0)} connections, "
                         f"{st.get('bytes', 0)} bytes, {st.get('reset while sending', 0)} reset "
                         f"while sending, {st.get('no listener', 0)} refused by the kernel (no "
                         f"listener), {st.get('connect errors', 0)} connect errors")
    row.attempts = store_fuzz.stats.get("connections") + data_fuzz.stats.get("connections")
    row.accepted = 0  # fuzz cannot authenticate; what counts is the job's result
    row.notes.append(f"logged: {sum(j.count('refused a connection') for j in row.jobs)} data "
                     f"refusals, {sum(j.count('closing connection from') for j in row.jobs)} store "
                     f"closes")
    if data_fuzz.stats.get("connections") == 0:
        row.failed_to_run = True
        row.notes.append("no data port was ever fuzzed")
    return row


def row_idle(args, secret, workdir, baseline_s, timeout_s):
    row = Row(f"idle connections: {args.idle} over the store port and the data ports, kept open "
              f"while the job runs")
    job, ports = start_held_job(args, workdir, "idle", timeout_s, row)
    socks, pending = [], []
    if not job:
        row.failed_to_run = True
        return row
    try:
        targets = [job.port] + list(ports.values())
        socks, failed, pending = open_idle(targets, args.idle, 20)
        to_store = [s for s in socks if s.getpeername()[1] == job.port]
        row.notes.append(f"{len(socks)} established ({len(to_store)} to the store, "
                         f"{len(socks) - len(to_store)} to data ports "
                         f"{sorted(ports.values())}), {len(pending)} never accepted by the "
                         f"kernel (SYN retries), {failed} failed")
        time.sleep(1.0)
        row.notes.append(f"still open before the release: {still_open(socks)}")
        release(job)
        row.attempts = len(socks) + len(pending)
        # Once the set-up is over the data ports are closed; the store's connections stay.
        time.sleep(2.0)
        if job.proc.poll() is None:
            row.notes.append(f"still open 2 s into the run: {still_open(to_store)} to the "
                             f"store, {still_open(socks) - still_open(to_store)} to data "
                             f"ports")
        job.wait()
        limit = job.fds_limit or args.job_nofile
        row.notes.append(f"rank 0 held at most {job.fds_max} descriptors (its soft limit then "
                         f"{limit}; started with {args.job_nofile})")
        if job.fds_max >= limit:
            row.failed_to_run = True
            row.notes.append("**rank 0 ran out of file descriptors** (a checkpoint or any file "
                             "it opened then would fail)")
        if job.count("Too many open files"):
            row.notes.append(f"rank 0 logged 'Too many open files' "
                             f"{job.count('Too many open files')} times")
    finally:
        close_all(socks)
        close_all(pending)
    row.jobs.append(job)
    return row


def documented_store_memory_limit(repo):
    try:
        with open(os.path.join(repo, "docs", "store.md")) as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("|") and re.search(r"memory", line, re.I):
            m = re.search(r"(\d[\d,.]*)\s*(KiB|MiB|GiB)", line)
            if m:
                scale = {"KiB": 1, "MiB": 1024, "GiB": 1024 * 1024}[m.group(2)]
                return float(m.group(1).replace(",", "")) * scale, line.strip()
    return None


# --- main ---------------------------------------------------------------------------------------


def run_baseline(args, workdir, timeout_s, name):
    base = Job(args, workdir, name, timeout_s)
    base.start()
    base.find_workers()
    base.wait()
    if not base.check_ok():
        sys.exit(f"security_probe: the baseline job failed (exit {base.proc.returncode}); "
                 f"see {base.out_path}")
    log(f"{name}: {base.run_s:.1f} s, rank 0 RSS at most {base.rss_max_kib} KiB")
    return base


def main():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build", help="build folder with bin/ddprun, bin/ddp-bench")
    p.add_argument("--fuzz-seconds", type=float, default=None,
                   help="fuzz duration (default 600; 30 with --quick)")
    p.add_argument("--idle", type=int, default=10000, help="idle connections (default 10000)")
    p.add_argument("--attempts", type=int, default=120,
                   help="impostor attempts per plane (default 120)")
    p.add_argument("--quick", action="store_true", help="short durations for a smoke run")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--iters", type=int, default=None,
                   help="ddp-bench --iters (default 1500; 300 with --quick)")
    p.add_argument("--size", default="1M", help="ddp-bench --sizes (default 1M)")
    p.add_argument("--transport", default="tcp", help="DDP_TRANSPORT of the job (default tcp)")
    p.add_argument("--fuzz-rate", type=float, default=200.0,
                   help="fuzz connections per second per plane at most (default 200)")
    p.add_argument("--verdict-seconds", type=float, default=3.0,
                   help="how long a refused connection may take to be closed (default 3)")
    p.add_argument("--job-nofile", type=int, default=1024,
                   help="the job's soft descriptor limit (default 1024, the usual default; the "
                        "issue's store ran out of descriptors at it)")
    p.add_argument("--store-memory-limit-mib", type=float, default=None,
                   help="the store's memory limit to compare with (default: the row of the "
                        "Limits table in docs/store.md that mentions memory, else n/a)")
    p.add_argument("--only", default="", help="comma-separated rows to run: store,data,fuzz,idle")
    args = p.parse_args()
    if args.fuzz_seconds is None:
        args.fuzz_seconds = 30.0 if args.quick else 600.0
    if args.iters is None:
        args.iters = 300 if args.quick else 1500
    args.build = os.path.abspath(args.build)
    for tool in ("ddprun", "ddp-bench"):
        if not os.access(os.path.join(args.build, "bin", tool), os.X_OK):
            sys.exit(f"security_probe: {args.build}/bin/{tool} not found; build it first "
                     f"(cmake --build {args.build} --target ddprun ddp-bench)")
    if args.world < 2:
        sys.exit("security_probe: --world must be at least 2")

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.idle + 2048
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            sys.exit(f"security_probe: --idle {args.idle} needs {want} descriptors, the hard "
                     f"limit is {hard}; lower --idle or raise the limit")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    workdir = tempfile.mkdtemp(prefix="ddp-security-probe-")
    args.secret_file = os.path.join(workdir, "job.secret")
    secret = os.urandom(32).hex().encode()
    with open(os.open(args.secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(secret + b"\n")
    timeout_s = max(120.0, args.fuzz_seconds + 300.0)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    only = set(filter(None, args.only.split(",")))
    rows = []
    bases = []
    try:
        # The baseline, with the secret and without any attack: before the attacks and after
        # them (this machine may be shared; the spread shows its noise).
        bases.append(run_baseline(args, workdir, timeout_s, "baseline_before"))
        baseline_s = bases[0].run_s
        for name, fn in (("store", row_store_impostors), ("data", row_data_impostors),
                         ("fuzz", row_fuzz), ("idle", row_idle)):
            if only and name not in only:
                continue
            log(f"row {name} ...")
            rows.append(fn(args, secret, workdir, baseline_s, timeout_s))
            log(f"row {name}: {rows[-1].attempts} attempts, {rows[-1].accepted} accepted")
        bases.append(run_baseline(args, workdir, timeout_s, "baseline_after"))
    except KeyboardInterrupt:
        log("interrupted: stopping every job")
        cleanup()
        sys.exit(130)
    finally:
        cleanup()

    baseline_s = sum(b.run_s for b in bases) / len(bases)
    baseline_us = sum(b.collective_us() or 0 for b in bases) / len(bases)
    base = max(bases, key=lambda b: b.rss_max_kib)
    # Memory row: rank 0's peak RSS during the attack jobs vs the baseline.
    attacked = [j for r in rows for j in r.jobs]
    mem = Row("memory: rank 0 (store host) peak RSS during the attacks")
    limit = documented_store_memory_limit(repo)
    if args.store_memory_limit_mib:
        limit = (args.store_memory_limit_mib * 1024, "--store-memory-limit-mib")
    peak = max((j.rss_max_kib for j in attacked), default=0)
    mem.notes.append(f"peak {peak / 1024:.1f} MiB vs baseline {base.rss_max_kib / 1024:.1f} MiB "
                     f"(+{(peak - base.rss_max_kib) / 1024:.1f} MiB); documented store memory "
                     f"limit: " + (f"{limit[0] / 1024:.0f} MiB" if limit else "n/a"))
    if limit and peak - base.rss_max_kib > limit[0]:
        mem.accepted = 1
        mem.notes.append("**over the documented limit**")
    mem.attempts = len(attacked)
    mem.notes.append(f"sampled every 50 ms in each of the {len(attacked)} attack jobs "
                     f"(attempts = jobs)")
    rows.append(mem)

    print()
    print(f"Security probe: world {args.world}, DDP_TRANSPORT={args.transport}, ddp-bench --check "
          f"--sizes {args.size} --iters {args.iters}, secret from --secret-file, the job's "
          f"descriptor limit {args.job_nofile}; baseline "
          f"{baseline_s:.1f} s (mean of {', '.join(f'{b.run_s:.1f}' for b in bases)} s, before "
          f"and after the attacks; load average {os.getloadavg()[0]:.1f}), median allreduce "
          f"{baseline_us / 1000:.1f} ms. Job times exclude the deliberate set-up holds; "
          f"'allreduce' is ddp-bench's median per call. Logs: {workdir}")
    print()
    print("| attack | attempts | accepted | job result | notes |")
    print("| --- | ---: | ---: | --- | --- |")
    failed = False
    for row in rows:
        result = job_result(row, baseline_s, baseline_us) if row.jobs else "-"
        print(f"| {row.attack} | {row.attempts} | {row.accepted} | {result} | "
              f"{'; '.join(row.notes)} |")
        if row.accepted or row.failed_to_run:
            failed = True
        if any(not j.check_ok() for j in row.jobs):
            failed = True
    print()
    print("RESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


def cleanup():
    with JOBS_LOCK:
        for job in JOBS:
            job.kill()


if __name__ == "__main__":
    sys.exit(main())
