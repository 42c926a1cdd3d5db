#!/usr/bin/env python3
"""Runs PyTorch's own distributed test suite against a torch.distributed backend.

The suite is `torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase`,
which ships inside the PyTorch wheel. It is driven here the way PyTorch's
test/distributed/test_distributed_spawn.py drives it (spawn mode: one
MultiProcessTestCase per test, WORLD_SIZE processes started with the "spawn" start
method), with three differences:

* a backend outside test_distributed_spawn.py's ("gloo", "nccl", "ucc") runs too
  (that file prints "Invalid backend" and runs nothing for any other name);
* `--import MODULE` is imported at the top of this file, so in the orchestrator, the
  worker and every spawned rank (the spawn start method re-imports this file as
  `__mp_main__` in each child): a third-party backend registers itself everywhere.
  Every rank records whether it saw the backend registered; the JSON says how many did;
* a per-test timeout: the suite's own (MultiProcessTestCase kills the ranks after
  `--timeout` s) and a watchdog here (the worker is killed `--timeout`+60 s after a test
  started), so a hang is counted as `hang` and the run goes on.

Usage (from the repository root, with PyTorch's Python):
  scripts/pytorch-python scripts/pytorch_dist_suite.py --backend gloo --world-size 2 --out gloo-w2.json
  scripts/pytorch-python scripts/pytorch_dist_suite.py --backend fakegloo \
      --import pytorch_suite_fakegloo --world-size 2 --out fakegloo-w2.json
  scripts/pytorch-python scripts/pytorch_dist_suite.py --compare gloo-w2.json fakegloo-w2.json
  scripts/pytorch-python scripts/pytorch_dist_suite.py --markdown gloo-w2.json fakegloo-w2.json

Statuses: passed; skipped (with the reason); failed (an AssertionError in a rank: a wrong
result or a wrong error); error (any other exception, a crashed rank, a bad exit code);
hang (the test ran into the timeout). docs/pytorch-backend.md describes how a backend
that is not gloo is treated by the suite (`--features`).
"""

import os
import sys

# ---------------------------------------------------------------------------------------
# Top of file: modules named by --import (or DDP_SUITE_IMPORT, comma separated) are imported
# first, in every process that runs this file: the orchestrator, the worker and each rank
# that the spawn start method starts (it re-runs this file's top level as __mp_main__).
# ---------------------------------------------------------------------------------------


def _early_import_names():
    names = [m for m in os.environ.get("DDP_SUITE_IMPORT", "").split(",") if m]
    argv = sys.argv
    for i, a in enumerate(argv):
        if a == "--import" and i + 1 < len(argv):
            names.extend(m for m in argv[i + 1].split(",") if m)
        elif a.startswith("--import="):
            names.extend(m for m in a.split("=", 1)[1].split(",") if m)
    seen = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen


# PyTorch's test helpers import `expecttest`, which the torch wheel does not depend on;
# scripts/pytorch-dist-suite.sh installs it here (pip --target), outside the shared venv.
_DEPS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "pytorch-suite-deps"
)
if os.path.isdir(_DEPS) and _DEPS not in sys.path:
    sys.path.append(_DEPS)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), _DEPS) if p]
    )

_IMPORTED = _early_import_names()
if _IMPORTED:
    import importlib

    _here = os.path.dirname(os.path.abspath(__file__))
    if _here not in sys.path:
        sys.path.insert(0, _here)
    for _m in _IMPORTED:
        importlib.import_module(_m)
    os.environ["DDP_SUITE_IMPORT"] = ",".join(_IMPORTED)

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import unittest  # noqa: E402

BUILTIN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
# DistTestCases.backend_feature entries that a backend outside PyTorch is given under
# --features like-gloo (docs/pytorch-backend.md says why): "ddp" (47 DDP tests that gloo
# runs) and "subgroup" (5) always; "gpu" and "plugin" only where no CUDA device is visible:
# require_backend_is_available(backend_feature["gpu"]) gates 25 tests that gloo runs, 23 of
# which also need 2 GPUs (they skip at run time, as on gloo) while 2 (all_gather_object_*)
# run on CPU; "plugin" is that decorator's "available" list for names it does not know.
# "cuda" is never added: its 6 tests need as many GPUs as ranks.
LIKE_GLOO_FEATURES = ("ddp", "subgroup")
LIKE_GLOO_FEATURES_NO_GPU = ("gpu", "plugin")
ROLE = os.environ.get("DDP_SUITE_ROLE", "")
STATUSES = ("passed", "failed", "error", "skipped", "hang")


# ---------------------------------------------------------------------------------------
# Worker and rank side: the suite itself. Only imported where DDP_SUITE_ROLE=worker (the
# worker process and, by inheritance of the environment, every rank it spawns).
# ---------------------------------------------------------------------------------------

if ROLE == "worker":
    import torch
    import torch._utils_internal
    import torch.distributed as dist

    _BACKEND = os.environ["BACKEND"]
    # The suite's env:// tests use torch._utils_internal.TEST_MASTER_PORT (29500): a port
    # per run keeps two runs on one machine apart.
    if os.environ.get("DDP_SUITE_MASTER_PORT"):
        torch._utils_internal.TEST_MASTER_PORT = int(os.environ["DDP_SUITE_MASTER_PORT"])
    import torch.testing._internal.common_distributed as common_distributed
    from torch.testing._internal.common_distributed import DistTestCases

    # The feature table is read by skip decorators when distributed_test is imported, so
    # it is set before that import, in the worker and in every rank alike.
    _FEATURES = [f for f in os.environ.get("DDP_SUITE_FEATURES", "").split(",") if f]
    for _f in _FEATURES:
        DistTestCases.backend_feature.setdefault(_f, set()).add(_BACKEND)
    if os.environ.get("DDP_SUITE_TIMEOUT"):
        common_distributed.TIMEOUT_DEFAULT = int(os.environ["DDP_SUITE_TIMEOUT"])
        common_distributed.TIMEOUT_OVERRIDE.clear()

    from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
        DistributedTest,
        TestDistBackend,
    )

    def _backend_registered(name):
        name = name.lower()
        return name in dist.Backend.backend_list and getattr(
            dist.Backend, name.upper(), None
        ) == name

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        """As in test_distributed_spawn.py, for any backend name."""

        def setUp(self):
            super().setUp()
            if os.environ.get("DDP_SUITE_START_METHOD", "spawn") == "fork":
                # --start-method fork: the ranks are forks of this worker, which has
                # imported torch, the suite and the --import modules but has no process
                # group; no re-import per rank (test_distributed_spawn.py uses spawn).
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            # In a spawned rank: record that this rank sees the backend registered.
            log = os.environ.get("DDP_SUITE_CHILD_LOG")
            if log:
                registered = _backend_registered(_BACKEND)
                via = "import" if registered else None
                ensure = getattr(dist.Backend, "_ensure_backend_registered", None)
                if not registered and ensure is not None:
                    # PyTorch loads a backend named by a "torch.distributed.backends" entry
                    # point on first use (init_process_group): registered, without --import.
                    try:
                        ensure(_BACKEND)
                    except Exception:
                        pass
                    registered = _backend_registered(_BACKEND)
                    via = "entry point" if registered else None
                line = json.dumps(
                    {
                        "test": test_name,
                        "rank": rank,
                        "pid": os.getpid(),
                        "imports": [m for m in _IMPORTED if m in sys.modules],
                        "registered": registered,
                        "via": via,
                    }
                )
                with open(log, "a") as f:
                    f.write(line + "\n")
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    torch.backends.cuda.matmul.allow_tf32 = False


def _all_test_names():
    return sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test"))


class _JsonResult(unittest.TestResult):
    """Writes one JSON line per event to a file the orchestrator reads."""

    def __init__(self, path, timeout):
        super().__init__()
        self._f = open(path, "a", buffering=1)
        self._timeout = timeout
        self._t0 = {}

    def _emit(self, **kw):
        self._f.write(json.dumps(kw) + "\n")
        self._f.flush()

    def startTest(self, test):
        super().startTest(test)
        name = test._testMethodName
        self._t0[name] = time.time()
        self._emit(event="start", test=name, t=self._t0[name])

    def _done(self, test, status, **kw):
        name = test._testMethodName
        dt = time.time() - self._t0.get(name, time.time())
        self._emit(event="result", test=name, status=status, time_s=round(dt, 2), **kw)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._done(test, "passed")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._done(test, "skipped", reason=str(reason))

    def _bad(self, test, err, default):
        text = "".join(traceback.format_exception(*err))
        name = test._testMethodName
        dt = time.time() - self._t0.get(name, time.time())
        if "terminated or timed out after" in text and dt >= self._timeout:
            status = "hang"
        elif "AssertionError" in text:
            status = "failed"
        else:
            status = default
        lines = [ln for ln in text.splitlines() if ln.strip()]
        self._done(test, status, detail="\n".join(lines[-30:]))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._bad(test, err, "failed")

    def addError(self, test, err):
        super().addError(test, err)
        self._bad(test, err, "error")

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._done(test, "passed", reason="expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._done(test, "failed", detail="unexpected success")


def _gloo_skip_decisions():
    """The suite's static skip decisions for BACKEND=gloo at this world size: a second,
    private copy of distributed_test is executed with BACKEND=gloo (module globals and skip
    decorators are evaluated at import). Returns {test name: skip reason or None}."""
    import importlib.util

    from torch.testing._internal.distributed import distributed_test as dt

    spec = importlib.util.spec_from_file_location("_ddp_suite_dt_as_gloo", dt.__file__)
    mod = importlib.util.module_from_spec(spec)
    saved = os.environ["BACKEND"]
    os.environ["BACKEND"] = "gloo"
    try:
        spec.loader.exec_module(mod)
    finally:
        os.environ["BACKEND"] = saved
    base = mod.DistributedTest._DistTestBase
    out = {}
    for n in dir(base):
        if n.startswith("test"):
            fn = getattr(base, n)
            skip = getattr(fn, "__unittest_skip__", False)
            out[n] = getattr(fn, "__unittest_skip_why__", "skipped") if skip else None
    return out


def _apply_gloo_skips():
    """--skips gloo: run exactly the tests the suite runs for gloo. Returns the tests that
    the suite skips for this backend's name but runs for gloo (now run)."""
    gloo = _gloo_skip_decisions()
    unskipped = []
    for n, why in gloo.items():
        fn = DistributedTest._DistTestBase.__dict__.get(n)
        if fn is None:
            continue
        mine = getattr(fn, "__unittest_skip__", False)
        if why is None and mine:
            fn.__unittest_skip__ = False
            unskipped.append(n)
        elif why is not None and not mine:
            fn.__unittest_skip__ = True
            fn.__unittest_skip_why__ = f"skipped on gloo: {why}"
    return sorted(unskipped)


def _worker_main(args):
    if args.list:
        print(json.dumps(_all_test_names()))
        return 0
    with open(args.tests_in) as f:
        names = [ln.strip() for ln in f if ln.strip()]
    if os.environ.get("DDP_SUITE_SKIPS") == "gloo" and _BACKEND != "gloo":
        unskipped = _apply_gloo_skips()
        with open(args.events, "a") as f:
            f.write(json.dumps({"event": "unskipped", "tests": unskipped}) + "\n")
    result = _JsonResult(args.events, int(os.environ["DDP_SUITE_TIMEOUT"]))
    known = set(_all_test_names())
    for n in names:
        if n not in known:
            result._emit(event="result", test=n, status="error", time_s=0,
                         detail="not a test of DistributedTest._DistTestBase")
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names if n in known)
    suite.run(result)
    return 0


# ---------------------------------------------------------------------------------------
# Orchestrator: starts the worker, watches it, restarts it after a hang or a crash.
# ---------------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _select(names, args):
    if args.tests_file:
        with open(args.tests_file) as f:
            wanted = [
                ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()
            ]
        unknown = [w for w in wanted if names is not None and w not in names]
        if unknown:
            raise SystemExit(f"pytorch_dist_suite: not in the suite: {', '.join(unknown)}")
        names = wanted
    if args.filter:
        rx = re.compile(args.filter)
        names = [n for n in names if rx.search(n)]
    return names


def _read_events(path):
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for ln in f:
                if ln.endswith("\n"):
                    out.append(json.loads(ln))
    return out


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _orchestrate(args):
    backend = args.backend
    import torch  # noqa: E402  (the orchestrator needs its version and the device count)

    features = []
    if args.features == "like-gloo" and backend not in BUILTIN_BACKENDS:
        features = list(LIKE_GLOO_FEATURES)
        if not torch.cuda.is_available():
            features += LIKE_GLOO_FEATURES_NO_GPU
    work = tempfile.mkdtemp(prefix=f"ddp-suite-{backend}-w{args.world_size}-")
    tmp = os.path.join(work, "tmp")
    os.mkdir(tmp)
    for d in ("barrier", "test_dir", "init_dir"):
        os.mkdir(os.path.join(tmp, d))
    env = dict(os.environ)
    env.update(
        {
            "BACKEND": backend,
            "WORLD_SIZE": str(args.world_size),
            "TEMP_DIR": tmp,
            "INIT_METHOD": "file://" + os.path.join(tmp, "init_dir", "shared_init_file")
            if args.init_method == "file"
            else "env://",
            # tempfile.* of the suite (per-test TEMP_DIR, init files) stay under `work`.
            "TMPDIR": tmp,
            "DDP_SUITE_ROLE": "worker",
            "DDP_SUITE_IMPORT": ",".join(_IMPORTED),
            "DDP_SUITE_FEATURES": ",".join(features),
            "DDP_SUITE_TIMEOUT": str(args.timeout),
            "DDP_SUITE_SKIPS": args.skips,
            "DDP_SUITE_START_METHOD": args.start_method,
            "DDP_SUITE_MASTER_PORT": str(_free_port()),
            "DDP_SUITE_CHILD_LOG": os.path.join(work, "children.jsonl"),
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    me = os.path.abspath(__file__)
    py = sys.executable
    log_path = args.log or os.path.join(work, "worker.log")
    log = open(log_path, "a")

    if args.tests_file and not args.filter:
        # A fixed list: the worker checks the names (saves one import of the suite).
        names = _select(None, args)
    else:
        listed = subprocess.run(
            [py, me, "--worker", "--list"], env=env, capture_output=True, text=True
        )
        if listed.returncode != 0:
            sys.stderr.write(listed.stderr[-4000:])
            raise SystemExit("pytorch_dist_suite: the suite did not import (above)")
        all_names = json.loads(listed.stdout.strip().splitlines()[-1])
        names = _select(all_names, args)

    procs = []

    class _Interrupted(Exception):
        pass

    def _on_signal(signum, frame):
        raise _Interrupted(signum)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    results = {}
    events_path = os.path.join(work, "events.jsonl")
    t_start = time.time()
    pending = list(names)
    restarts = 0
    unskipped = []
    interrupted = None
    try:
        while pending:
            tests_in = os.path.join(work, f"tests-{restarts}.txt")
            with open(tests_in, "w") as f:
                f.write("\n".join(pending) + "\n")
            proc = subprocess.Popen(
                [py, me, "--worker", "--tests-in", tests_in, "--events", events_path],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            procs.append(proc)
            current = None
            seen = 0
            while True:
                rc = proc.poll()
                evs = _read_events(events_path)
                for ev in evs[seen:]:
                    if ev["event"] == "unskipped":
                        unskipped = ev["tests"]
                    elif ev["event"] == "start":
                        current = (ev["test"], time.time())
                        if args.verbose:
                            print(f"  {ev['test']} ...", end="", flush=True)
                    else:
                        results[ev["test"]] = {
                            k: v for k, v in ev.items() if k not in ("event", "test")
                        }
                        current = None
                        if args.verbose:
                            print(f" {ev['status']} ({ev['time_s']}s)", flush=True)
                seen = len(evs)
                if rc is not None:
                    break
                if current and time.time() - current[1] > args.timeout + 60:
                    _kill_group(proc)
                    results[current[0]] = {
                        "status": "hang",
                        "time_s": round(time.time() - current[1], 2),
                        "detail": f"watchdog: no result after {args.timeout + 60} s; worker killed",
                    }
                    if args.verbose:
                        print(" hang (watchdog)", flush=True)
                    break
                time.sleep(0.5)
            if proc.poll() is None:
                _kill_group(proc)
            else:
                # The worker exited; its ranks (same process group) must not outlive it.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if current and current[0] not in results:
                results[current[0]] = {
                    "status": "error",
                    "time_s": round(time.time() - current[1], 2),
                    "detail": f"the worker exited with {proc.returncode} during this test (see {log_path})",
                }
            left = [n for n in pending if n not in results]
            if left and left == pending:
                # Nothing progressed: do not loop forever.
                for n in left:
                    results[n] = {"status": "error", "time_s": 0, "detail": "worker did not start"}
                left = []
            pending = left
            restarts += 1
    except _Interrupted as e:
        # SIGTERM/SIGINT: the ranks go, the results so far are written, the rest is "not run".
        interrupted = e.args[0]
        for pr in procs:
            if pr.poll() is None:
                _kill_group(pr)
        for n in names:
            if n not in results:
                results[n] = {"status": "not run", "time_s": 0, "detail": "the run was interrupted"}
    wall = time.time() - t_start
    log.close()

    children = _read_events(os.path.join(work, "children.jsonl"))
    totals = {s: 0 for s in STATUSES}
    for r in results.values():
        totals[r["status"]] = totals.get(r["status"], 0) + 1
    totals["total"] = len(results)
    out = {
        "backend": backend,
        "world_size": args.world_size,
        "imports": _IMPORTED,
        "features_added": {f: [backend] for f in features},
        "skips": args.skips,
        "start_method": args.start_method,
        "unskipped": [n for n in unskipped if n in results],
        "init_method": args.init_method,
        "timeout_s": args.timeout,
        "torch": torch.__version__,
        "selection": {"filter": args.filter, "tests_file": args.tests_file},
        "wall_s": round(wall, 1),
        "worker_restarts": max(restarts - 1, 0),
        "interrupted_by_signal": interrupted,
        "ranks_started": len(children),
        "ranks_saw_backend": sum(1 for c in children if c["registered"]),
        "ranks_via_entry_point": sum(1 for c in children if c.get("via") == "entry point"),
        "totals": totals,
        "tests": {n: results[n] for n in names},
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=False)
        f.write("\n")
    print(
        f"{backend} world {args.world_size}: "
        + ", ".join(f"{totals[s]} {s}" for s in STATUSES + ("not run",) if s in totals)
        + f" of {totals['total']} in {wall:.0f} s; ranks that saw the backend registered: "
        f"{out['ranks_saw_backend']}/{out['ranks_started']} -> {args.out}"
    )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work}")
    if interrupted:
        return 128 + interrupted
    if out["ranks_saw_backend"] != out["ranks_started"]:
        print("pytorch_dist_suite: some ranks did not see the backend registered", file=sys.stderr)
        return 3
    return 0


def _load(path):
    with open(path) as f:
        return json.load(f)


def _why(r):
    """A skip's reason, or the error line of a failure's traceback."""
    if r.get("reason"):
        return r["reason"]
    lines = (r.get("detail") or "").splitlines()
    errs = [ln.strip() for ln in lines if re.match(r"^\s*[\w.]*(Error|Exception|Timeout)\b", ln)]
    return errs[-1] if errs else (lines[-1].strip() if lines else "")


def _compare(a_path, b_path):
    a, b = _load(a_path), _load(b_path)
    la = f"{a['backend']} w{a['world_size']}"
    lb = f"{b['backend']} w{b['world_size']}"
    for x, y, lx, ly in ((a, b, la, lb), (b, a, lb, la)):
        diff = [
            n
            for n, r in x["tests"].items()
            if r["status"] == "passed"
            and n in y["tests"]
            and y["tests"][n]["status"] != "passed"
        ]
        print(f"### passed on {lx}, not on {ly}: {len(diff)}")
        for n in diff:
            r = y["tests"][n]
            print(f"- {n}: {r['status']}: {_why(r)[:300]}")
        print()
    return 0


def _require_parity(ref_path, other_path, allowed_path):
    """Exit status 1 when a test that passed on the reference run (gloo) did not pass on the other
    (ddp), unless `allowed_path` lists it (one name a line, `# reason` comments): the gate CI
    applies. Prints each such test with its reason."""
    ref, other = _load(ref_path), _load(other_path)
    allowed = set()
    if allowed_path:
        with open(allowed_path) as f:
            allowed = {ln.split("#")[0].strip() for ln in f if ln.split("#")[0].strip()}
    bad, excused = [], []
    for name, r in ref["tests"].items():
        if r["status"] != "passed":
            continue
        o = other["tests"].get(name, {"status": "not run"})
        if o["status"] == "passed":
            continue
        (excused if name in allowed else bad).append((name, o))
    label = f"{other['backend']} w{other['world_size']}"
    for name, o in excused:
        print(f"allowed: {name} ({o['status']} on {label}; {allowed_path} says why)")
    for name, o in bad:
        print(f"NOT PASSED on {label} but passed on {ref['backend']}: {name}: {o['status']}: "
              f"{_why(o)[:300]}")
    print(f"parity: {len(bad)} test(s) that passed on {ref['backend']} did not pass on {label}"
          f" ({len(excused)} allowed)")
    return 1 if bad else 0


def _markdown(paths):
    print(
        "| backend | world | ranks | skips | passed | failed | error | skipped | hang "
        "| not run | total | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        d = _load(p)
        t = d["totals"]
        print(
            f"| {d['backend']} | {d['world_size']} | {d.get('start_method', 'spawn')} | "
            f"{d.get('skips', 'suite')} | {t['passed']} | {t['failed']} | {t['error']} | "
            f"{t['skipped']} | {t['hang']} | {t.get('not run', 0)} | {t['total']} | "
            f"{d['wall_s']:.0f} |"
        )
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", help="BACKEND: gloo, or a registered third-party name")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        help="module to import in every process first (registers the backend); repeatable",
    )
    p.add_argument("--filter", help="run only tests whose name matches this regex")
    p.add_argument("--tests-file", help="run only these tests (one name a line, # comments)")
    p.add_argument("--timeout", type=int, default=240, help="per-test timeout, s")
    p.add_argument("--init-method", choices=("file", "env"), default="file")
    p.add_argument(
        "--features",
        choices=("like-gloo", "none"),
        default="like-gloo",
        help="like-gloo (default): a backend not built into PyTorch gets gloo's "
        "DistTestCases.backend_feature entries ddp and subgroup, and gpu and plugin where no "
        "CUDA device is visible; none: the suite's table as it ships",
    )
    p.add_argument(
        "--skips",
        choices=("suite", "gloo"),
        default="suite",
        help="suite (default): the suite's skip decisions for this backend's name; gloo: "
        "the decisions it takes for gloo (run every test that gloo runs, whatever the name)",
    )
    p.add_argument(
        "--start-method",
        choices=("spawn", "fork"),
        default="spawn",
        help="spawn (default, as test_distributed_spawn.py): every rank starts a fresh "
        "interpreter and imports torch and the suite (seconds per test on a busy machine); "
        "fork: the ranks are forks of the worker (CPU only; for quick subsets)",
    )
    p.add_argument("--out", help="JSON results")
    p.add_argument("--log", help="worker output (default: a file in the temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per test")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"))
    p.add_argument("--markdown", nargs="+", metavar="R.json", help="a counts table")
    p.add_argument("--require-parity", nargs=2, metavar=("GLOO.json", "OTHER.json"),
                   help="exit 1 when a test that passed in GLOO.json did not pass in OTHER.json "
                   "and --allowed does not list it")
    p.add_argument("--allowed", help="with --require-parity: tests allowed to differ")
    # Worker side (internal).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--list", action="store_true", help="print the suite's test names")
    p.add_argument("--tests-in", help=argparse.SUPPRESS)
    p.add_argument("--events", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker_main(args)
    if args.compare:
        return _compare(*args.compare)
    if args.markdown:
        return _markdown(args.markdown)
    if args.require_parity:
        return _require_parity(*args.require_parity, args.allowed)
    if not args.backend:
        p.error("--backend is required")
    if args.list:
        os.environ.update(
            {"BACKEND": args.backend, "WORLD_SIZE": str(args.world_size), "DDP_SUITE_ROLE": "worker"}
        )
        return subprocess.call([sys.executable, os.path.abspath(__file__), "--worker", "--list"])
    if not args.out:
        args.out = f"pytorch-suite-{args.backend}-w{args.world_size}.json"
    return _orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
