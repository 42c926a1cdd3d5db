"""Helpers shared by the benchmark drivers in bench/'s folders (compare/compare_allreduce.py,
cluster/cluster_allreduce.py, cluster/cluster_train.py, probes/scale.py, ...): argument parsing of
sizes and rates, running a program with a deadline, the JSON rows programs print, the machine's
description, and the simulated cluster (scripts/cluster.sh) as an object. Standard library only.
A script in bench/<kind>/ imports it after putting this folder on sys.path:

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # bench_common
    from bench_common import REPO, run  # noqa: E402
"""

import argparse
import json
import os
import re
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # bench/common/ -> the repository
CLUSTER_SCRIPT = str(REPO / "scripts" / "cluster.sh")
SYSTEM_PYTHON = "/usr/bin/python3"  # sees Debian's python3-torch; a pyenv python3 may not
PYTORCH2_PYTHON = str(REPO / "scripts" / "pytorch-python")  # PyTorch 2.x from PyPI
SKIPPED = 77  # cluster.sh's (and the drivers') "cannot run here"
# Variables of an enclosing launcher that must not leak into the programs a driver starts.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                    "DDP_BACKEND", "DDP_TRANSPORT", "DDP_HOST_ID")


def parse_size(text):
    """'64K', '1M', '4096' -> bytes."""
    match = re.fullmatch(r"(\d+)([kmg]?)(i?b)?", text.strip().lower())
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a byte size (e.g. 1K, 64K, 1M)")
    return int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2)]


def parse_rate(text):
    """tc's rate syntax -> bit/s (0 for none)."""
    t = text.strip().lower()
    if t == "none":
        return 0
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)", t)
    if not match:
        raise argparse.ArgumentTypeError(f"'{text}' is not a rate (e.g. 100mbit, 1gbit, 10gbit)")
    return float(match.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
                                     "tbit": 1e12}[match.group(2)]


def human(nbytes):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def run(argv, env, timeout):
    """Runs argv in its own process group; returns (exit code, output). Never outlives timeout:
    at the deadline the group gets SIGTERM (cluster.sh run stops its hosts on it), then SIGKILL
    30 s later; the code is then 124."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        return 124, output + f"\n(killed after {timeout} s)"


def json_rows(output):
    """JSON objects in the output, one per line, after cluster.sh's '[hR] ' and ddprun's
    '[rank] ' prefixes; lines that are not JSON are left out."""
    rows = []
    for line in output.splitlines():
        line = re.sub(r"^(\[h?\d+\] )+", "", line.strip())
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def tail(output, lines=4):
    return " | ".join(output.strip().splitlines()[-lines:])


def cpu_model():
    """The CPU's model name from /proc/cpuinfo ('unknown' without it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def load_average():
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def tool_version(argv):
    """The first line a program prints (e.g. its version), 'unknown' if it cannot run."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
        return out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def clean_environment(**extra):
    """This process's environment without an enclosing launcher's variables, plus extra."""
    env = dict(os.environ, **extra)
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    return env


class Cluster:
    """scripts/cluster.sh with one prefix and build tree: up at a rate, run a command on every
    host (one ddprun per host), down. Remembers every distinct command line (`commands`, with
    the repository's path left out) for the report. Every call has a deadline."""

    def __init__(self, build_dir, prefix, hosts, mtu=1500, timeout=300, env=None):
        self.hosts = hosts
        self.mtu = mtu
        self.timeout = timeout
        self.env = dict(env if env is not None else clean_environment(OMP_NUM_THREADS="1"),
                        DDP_BUILD_DIR=str(build_dir), DDP_CLUSTER_PREFIX=prefix)
        self.commands = []

    def script(self, *argv, timeout=120):
        return run([CLUSTER_SCRIPT, *argv], self.env, timeout)

    def note(self, argv):
        text = " ".join(argv).replace(str(REPO) + "/", "")
        if text not in self.commands:
            self.commands.append(text)

    def status(self):
        return self.script("status")

    def up(self, rate):
        argv = ["up", "--hosts", str(self.hosts), "--rate", rate, "--mtu", str(self.mtu)]
        self.note(["scripts/cluster.sh", *argv])
        return self.script(*argv)

    def down(self):
        return self.script("down")

    def host_run(self, nproc, command, timeout=None, env=None):
        """cluster.sh run: `command` under ddprun on every host, nproc ranks per host. env: extra
        variables for this run only."""
        timeout = timeout or self.timeout
        argv = ["run", "--nproc-per-host", str(nproc), "--timeout", str(timeout), "--", *command]
        self.note(["scripts/cluster.sh", *argv])
        return run([CLUSTER_SCRIPT, *argv], dict(self.env, **(env or {})), timeout + 60)
