#!/usr/bin/env python3
"""GPU test reporting for scripts/test.sh and scripts/gpu-check.sh (standard library only).

  gpu_report.py ctest-summary --test-dir BUILD --junit FILE [--prefix test.sh] [--json OUT]
      Reads the tests labelled `gpu` (ctest --show-only=json-v1) and their results in CTest's JUnit
      file (ctest --output-junit), and prints one line: `PREFIX: N GPU tests not run: no CUDA
      device` when any was skipped for want of a device, `PREFIX: all N GPU tests ran` when none
      was, nothing when the run held no GPU test. --json writes the per-test results.
  gpu_report.py record-step --state DIR --kind step|benchmark --name NAME --rc RC --seconds S
                            --log FILE [--timeout T] [--command TEXT] [--extra KEY=VALUE ...]
      Appends one step's record (status, the log's tail, a benchmark's result line) to
      DIR/records.jsonl.
  gpu_report.py render --state DIR --out FILE
      Writes gpu-check's one JSON file from DIR (machine.json, torch.json, gpu_tests.json,
      records.jsonl, meta.json), atomically; callable after every step, so a run cut short
      still leaves the JSON of what it did.
  gpu_report.py machine --out FILE | torch --python PY --out FILE
      The machine (nvidia-smi, OS, compiler, CMake, nvcc) and PY's torch, as JSON.
  gpu_report.py check-cache --cache CMakeCache.txt --deps DIR
      Fails unless fmt, GoogleTest, CLI11, nlohmann-json and zlib were found in DIR.
  gpu_report.py self-test
      Exercises ctest-summary, record-step and render on made-up inputs (CTest runs it, label unit).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

GPU_LABEL = "gpu"
NO_DEVICE = "no CUDA device"
LOG_TAIL_CHARS = 4000
FAILED_TESTS_SHOWN = 5
FAILED_TAIL_LINES = 30
ERROR_LINE = re.compile(r"ddp-train-bench: |pytorch_ddp_bench: |[A-Za-z]*Error: |error: |"
                        r"FAILED|what\(\): |CMake Error|ninja: build stopped")
RESULT_LINE = re.compile(r"step_ms=([0-9.]+) samples_per_s=([0-9.]+)")


def gpu_test_names(test_dir):
    """Names of the tests labelled gpu in a build (or one of its subfolders)."""
    out = subprocess.run(["ctest", "--test-dir", test_dir, "--show-only=json-v1"],
                         capture_output=True, text=True, timeout=120, check=False)
    if out.returncode != 0:
        raise SystemExit(f"gpu_report: `ctest --test-dir {test_dir} --show-only=json-v1` failed "
                         f"(exit {out.returncode}): {out.stderr.strip()}")
    names = set()
    for test in json.loads(out.stdout).get("tests", []):
        for prop in test.get("properties", []):
            if prop.get("name") == "LABELS" and GPU_LABEL in prop.get("value", []):
                names.add(test["name"])
    return names


def skip_reason(output):
    """The message GTEST_SKIP printed (the line after `...: Skipped`), or ''."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith(": Skipped") and i + 1 < len(lines):
            return lines[i + 1].strip()
    return ""


def junit_results(junit_file, names=None):
    """Per-test results from CTest's JUnit file, for `names` (all tests when None)."""
    try:
        root = ET.parse(junit_file).getroot()
    except (OSError, ET.ParseError) as e:
        raise SystemExit(f"gpu_report: cannot read CTest's JUnit file {junit_file}: {e}")
    results = []
    for case in root.iter("testcase"):
        name = case.get("name", "")
        if names is not None and name not in names:
            continue
        output = case.findtext("system-out") or ""
        if case.find("failure") is not None or case.get("status") == "fail":
            status, message = "failed", output[-LOG_TAIL_CHARS:]
        elif case.find("skipped") is not None or case.get("status") in ("notrun", "disabled"):
            status = "skipped"
            message = skip_reason(output) or (case.find("skipped").get("message", "")
                                              if case.find("skipped") is not None else "")
        else:
            status, message = "passed", ""
        results.append({"name": name, "status": status,
                        "seconds": float(case.get("time", "0") or 0), "message": message})
    return results


def summary_line(results, prefix):
    skipped = [r for r in results if r["status"] == "skipped"]
    if not results:
        return None
    if not skipped:
        return f"{prefix}: all {len(results)} GPU tests ran"
    no_device = [r for r in skipped if NO_DEVICE in r["message"]]
    other = [r for r in skipped if NO_DEVICE not in r["message"]]
    parts = []
    if no_device:
        parts.append(f"{prefix}: {len(no_device)} GPU tests not run: {NO_DEVICE}")
    if other:
        reasons = "; ".join(sorted({r["message"] or "no reason given" for r in other}))
        parts.append(f"{prefix}: {len(other)} GPU tests skipped for another reason: {reasons}")
    return "\n".join(parts)


def failure_tails(results, prefix, max_tests=FAILED_TESTS_SHOWN, lines=FAILED_TAIL_LINES):
    """The end of each failed test's output, for the last lines of a log: CI shows a run's tail,
    and ctest prints a failed test's output long before its summary (a flake's cause was lost
    that way). At most `max_tests` tests, `lines` lines each."""
    failed = [r for r in results if r["status"] == "failed"]
    parts = []
    for r in failed[:max_tests]:
        tail = r["message"].rstrip().splitlines()[-lines:]
        parts.append(f"{prefix}: {r['name']} failed after {r['seconds']:.1f} s; the end of its "
                     f"output:\n" + "\n".join("  | " + t for t in tail))
    if len(failed) > max_tests:
        parts.append(f"{prefix}: and {len(failed) - max_tests} more failed tests (see above)")
    return "\n".join(parts)


def ctest_summary(args):
    names = gpu_test_names(args.test_dir)
    results = junit_results(args.junit, names)
    tails = failure_tails(junit_results(args.junit), args.prefix)
    if tails:
        print(tails, flush=True)
    line = summary_line(results, args.prefix)
    if line:
        print(line, flush=True)
    if args.json:
        counts = {s: sum(r["status"] == s for r in results)
                  for s in ("passed", "failed", "skipped")}
        write_json(args.json, {"total": len(results), **counts, "summary_line": line or "",
                               "tests": results})


def write_json(path, value):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".gpu_report.")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the report from other users
    os.replace(tmp, path)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        return {"error": f"unreadable {os.path.basename(path)}: {e}"}


def log_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError as e:
        return f"(no log: {e})"


def record_step(args):
    text = log_text(args.log)
    timed_out = args.rc in (124, 137) and args.timeout is not None
    record = {"kind": args.kind, "name": args.name, "rc": args.rc,
              "status": "ok" if args.rc == 0 else ("timeout" if timed_out else "error"),
              "seconds": round(args.seconds, 2), "timeout_s": args.timeout,
              "command": args.command, "log": os.path.basename(args.log)}
    for pair in args.extra or []:
        key, _, value = pair.partition("=")
        record[key] = value
    if args.kind == "benchmark":
        lines = text.splitlines()
        result = [line for line in lines if RESULT_LINE.search(line)]
        if result:
            match = RESULT_LINE.search(result[-1])
            record["line"] = result[-1].strip()
            record["step_ms"] = float(match.group(1))
            record["samples_per_s"] = float(match.group(2))
            info = [line.strip() for line in lines if line.lstrip().startswith("model=") or
                    re.search(r"\bmodel=\S+ world_size=", line)]
            if info:
                record["info"] = info[-1]
            # ddp-train-bench --phases: each rank's host time per phase of a step.
            phases = [line.strip() for line in lines if "phases_ms " in line]
            if phases:
                record["phases"] = phases
            # zero2/fsdp: the peak of FSDP's flat buffers on the device beside the formula.
            buffers = [line.strip() for line in lines if "fsdp_buffers " in line]
            if buffers:
                record["fsdp_buffers"] = buffers[-1]
        elif args.rc == 0:
            record["status"] = "error"
            record["error"] = "exited 0 but printed no step_ms= line"
    if record["status"] != "ok":
        if timed_out:
            record["error"] = f"killed after its {args.timeout} s limit"
        # The programs' own error lines (ddp-train-bench's, a Python exception's, a test's),
        # the first three distinct ones; the log's tail holds the rest.
        errors = []
        for line in text.splitlines():
            if ERROR_LINE.search(line) and line.strip() not in errors:
                errors.append(line.strip())
        record.setdefault("error", " | ".join(errors[:3]) if errors else f"exit status {args.rc}")
        record["log_tail"] = text[-LOG_TAIL_CHARS:]
    with open(os.path.join(args.state, "records.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def render(args):
    state = args.state
    meta = read_json(os.path.join(state, "meta.json"), {})
    records = []
    try:
        with open(os.path.join(state, "records.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        pass
    steps = [r for r in records if r["kind"] == "step"]
    benchmarks = [r for r in records if r["kind"] == "benchmark"]
    gpu_tests = read_json(os.path.join(state, "gpu_tests.json"))
    failures = [f"step {r['name']}: {r.get('error', r['status'])}"
                for r in steps if r["status"] != "ok"]
    failures += [f"benchmark {r['name']}: {r.get('error', r['status'])}"
                 for r in benchmarks if r["status"] != "ok"]
    failures += meta.get("failures", [])
    machine = read_json(os.path.join(state, "machine.json"), {})
    if gpu_tests and "tests" in gpu_tests:
        failures += [f"GPU test {t['name']} failed" for t in gpu_tests["tests"]
                     if t["status"] == "failed"]
        if machine.get("gpu_count", 0) > 0 and gpu_tests.get("skipped", 0) > 0:
            failures.append(f"{gpu_tests['skipped']} GPU tests skipped on a machine where "
                            f"nvidia-smi lists {machine['gpu_count']} GPU(s)")
    finished = meta.get("finished")
    if finished and not meta.get("completed") and not failures:
        failures.append("gpu-check.sh stopped before its last step, for no recorded reason")
    status = "incomplete" if not finished else ("failed" if failures else "ok")
    report = {
        "schema": "ddp-gpu-check/1",
        "status": status,
        "started": meta.get("started"),
        "finished": finished,
        "elapsed_s": meta.get("elapsed_s"),
        "budget_s": meta.get("budget_s"),
        "git": meta.get("git"),
        "options": meta.get("options"),
        "machine": machine,
        "torch": read_json(os.path.join(state, "torch.json"), {}),
        "steps": steps,
        "gpu_tests": gpu_tests,
        "benchmarks": benchmarks,
        "failures": failures,
    }
    write_json(args.out, report)


def run_text(cmd, timeout=30):
    """A command's output, or what kept it from running (never raises)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cmd[0]}: {e}"
    text = (out.stdout + out.stderr).strip()
    return (text, None) if out.returncode == 0 else (None, f"{' '.join(cmd)}: exit "
                                                            f"{out.returncode}: {text[-300:]}")


def machine(args):
    info = {}
    text, err = run_text(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                          "--format=csv,noheader"])
    gpus = []
    for line in (text or "").splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 2:
            gpus.append(dict(zip(["name", "driver", "memory", "compute_capability"], fields)))
    info["gpus"] = gpus
    info["gpu_count"] = len(gpus)
    if err:
        info["nvidia_smi_error"] = err
    try:
        with open("/etc/os-release") as f:
            release = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        info["os"] = release.get("PRETTY_NAME", "").strip('"')
    except OSError as e:
        info["os"] = f"unknown ({e})"
    info["kernel"] = os.uname().release
    info["cpus"] = os.cpu_count()
    for name, cmd, pick in [("compiler", ["c++", "--version"], 0), ("cmake", ["cmake", "--version"], 0),
                            ("ninja", ["ninja", "--version"], 0), ("nvcc", ["nvcc", "--version"], -2),
                            ("ccache", ["ccache", "--version"], 0)]:
        text, err = run_text(cmd)
        info[name] = text.splitlines()[pick] if text else err
    write_json(args.out, info)


TORCH_PROBE = r"""
import json, sys, torch
info = {"version": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count(),
        "cmake_prefix_path": torch.utils.cmake_prefix_path, "python": sys.version.split()[0],
        "python_prefix": sys.prefix, "python_executable": sys.executable,
        "cxx11_abi": torch.compiled_with_cxx11_abi()}
if info["cuda_available"]:
    info["devices"] = [torch.cuda.get_device_name(i) for i in range(info["device_count"])]
try:
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as e:  # a build without NCCL
    info["nccl"] = f"unavailable ({e})"
print(json.dumps(info))
"""


def torch_info(args):
    text, err = run_text([args.python, "-c", TORCH_PROBE], timeout=120)
    if err:
        write_json(args.out, {"error": err})
        raise SystemExit(f"gpu_report: {err}")
    write_json(args.out, json.loads(text.splitlines()[-1]))


CARRIED = ["fmt_DIR", "GTest_DIR", "CLI11_DIR", "nlohmann_json_DIR", "ZLIB_INCLUDE_DIR",
           "ZLIB_LIBRARY_RELEASE"]


def check_cache(args):
    """Each carried package was found in the carried folder, not the system's."""
    deps = os.path.realpath(args.deps)
    found = {}
    with open(args.cache) as f:
        for line in f:
            key, _, value = line.rstrip("\n").partition("=")
            name = key.split(":")[0]
            if name in CARRIED:
                found[name] = value
    bad = []
    for name in CARRIED:
        value = found.get(name)
        where = os.path.realpath(value) if value else None
        ok = where is not None and (where == deps or where.startswith(deps + os.sep))
        print(f"{name} = {value} ({'carried' if ok else 'NOT from ' + args.deps})")
        if not ok:
            bad.append(f"{name} = {value}")
    if bad:
        raise SystemExit(f"error: packages not taken from {args.deps}: {'; '.join(bad)}")


def self_test(_args):
    """The writer on made-up inputs: a skipped, a passed and a failed GPU test, an ok step, a
    failed benchmark, a timed-out one, one with a result line; then the rendered file."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        with open(junit, "w") as f:
            f.write("""<?xml version="1.0" encoding="UTF-8"?>
<testsuite name="(empty)" tests="4" failures="1" disabled="0" skipped="1" time="0">
 <testcase name="G.Skips" classname="G.Skips" time="0.01" status="notrun">
  <skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>
  <system-out>[ RUN      ] G.Skips
x.cc:12: Skipped
no CUDA device (libcudart.so.13: cudaGetDeviceCount error 35)
[  SKIPPED ] G.Skips (0 ms)</system-out>
 </testcase>
 <testcase name="G.Runs" classname="G.Runs" time="0.5" status="run"><system-out>ok</system-out></testcase>
 <testcase name="G.Fails" classname="G.Fails" time="0.2" status="fail">
  <failure message="Failed"/><system-out>x.cc:3: Failure bytes differ</system-out></testcase>
 <testcase name="Cpu.Other" classname="Cpu.Other" time="0.1" status="run"/>
</testsuite>""")
        results = junit_results(junit, {"G.Skips", "G.Runs", "G.Fails"})
        by_name = {r["name"]: r for r in results}
        assert len(results) == 3, results
        assert by_name["G.Skips"]["status"] == "skipped", by_name
        assert NO_DEVICE in by_name["G.Skips"]["message"], by_name
        assert by_name["G.Fails"]["status"] == "failed", by_name
        assert by_name["G.Runs"]["status"] == "passed", by_name
        line = summary_line(results, "test.sh")
        assert line == "test.sh: 1 GPU tests not run: no CUDA device", line
        assert summary_line([by_name["G.Runs"]], "t") == "t: all 1 GPU tests ran"
        assert summary_line([], "t") is None
        tails = failure_tails(junit_results(junit), "t")
        assert tails == "t: G.Fails failed after 0.2 s; the end of its output:\n" \
                        "  | x.cc:3: Failure bytes differ", tails
        assert failure_tails([by_name["G.Runs"]], "t") == ""
        many = [dict(by_name["G.Fails"], name=f"F{i}") for i in range(3)]
        assert failure_tails(many, "t", max_tests=2).endswith("t: and 1 more failed tests (see above)")

        state = os.path.join(tmp, "state")
        os.makedirs(state)
        out = os.path.join(tmp, "out", "gpu-check.json")
        ns = argparse.Namespace
        render(ns(state=state, out=out))  # nothing recorded yet: still a valid, partial file
        first = read_json(out)
        assert first["status"] == "incomplete" and first["steps"] == [], first
        logs = {}
        for name, text in {"configure": "-- Configuring done\n",
                           "ddp_w2": "ddprun: rank 0: ddp-train-bench: the gradient is on "
                                     "cuda:0; ddp moves CPU tensors only\n",
                           "slow": "step 1\n",
                           "torch_w1": "[0] rank 0 phases_ms zero_grad=0.01 forward=0.2\n"
                                       "model=mlp world_size=1\nfsdp_buffers place=device "
                                       "peak_mb=1.0 formula_mb=1.0\nstep_ms=1.500 "
                                       "samples_per_s=42666.7\n"}.items():
            logs[name] = os.path.join(state, name + ".log")
            with open(logs[name], "w") as f:
                f.write(text)
        record_step(ns(state=state, kind="step", name="configure", rc=0, seconds=3.2,
                       log=logs["configure"], timeout=90, command="cmake ...", extra=None))
        record_step(ns(state=state, kind="benchmark", name="ddp_w2", rc=1, seconds=4.0,
                       log=logs["ddp_w2"], timeout=60, command="ddprun ...",
                       extra=["world=2", "side=ddp"]))
        record_step(ns(state=state, kind="benchmark", name="slow", rc=124, seconds=60.0,
                       log=logs["slow"], timeout=60, command="x", extra=None))
        record_step(ns(state=state, kind="benchmark", name="torch_w1", rc=0, seconds=9.0,
                       log=logs["torch_w1"], timeout=60, command="y", extra=None))
        write_json(os.path.join(state, "gpu_tests.json"),
                   {"total": 1, "passed": 0, "failed": 0, "skipped": 1, "tests": [
                       {"name": "G.Skips", "status": "skipped", "seconds": 0,
                        "message": NO_DEVICE}]})
        write_json(os.path.join(state, "machine.json"), {"gpu_count": 0})
        write_json(os.path.join(state, "meta.json"),
                   {"started": "t0", "finished": "t1", "completed": True})
        render(ns(state=state, out=out))
        report = read_json(out)
        bench = {b["name"]: b for b in report["benchmarks"]}
        assert report["status"] == "failed", report
        assert report["steps"][0]["status"] == "ok", report["steps"]
        assert bench["ddp_w2"]["status"] == "error", bench
        assert "CPU tensors only" in bench["ddp_w2"]["error"], bench
        assert bench["ddp_w2"]["world"] == "2", bench
        assert bench["slow"]["status"] == "timeout", bench
        assert bench["torch_w1"]["step_ms"] == 1.5, bench
        assert bench["torch_w1"]["info"] == "model=mlp world_size=1", bench
        assert bench["torch_w1"]["phases"] == ["[0] rank 0 phases_ms zero_grad=0.01 forward=0.2"]
        assert bench["torch_w1"]["fsdp_buffers"].endswith("peak_mb=1.0 formula_mb=1.0"), bench
        assert len(report["failures"]) == 2, report["failures"]
        # A GPU present but tests skipped: a failure, not a pass.
        write_json(os.path.join(state, "machine.json"), {"gpu_count": 1})
        render(ns(state=state, out=out))
        assert any("skipped on a machine" in f for f in read_json(out)["failures"])
    print("gpu_report: self-test passed")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ctest-summary")
    p.add_argument("--test-dir", required=True)
    p.add_argument("--junit", required=True)
    p.add_argument("--prefix", default="test.sh")
    p.add_argument("--json")
    p.set_defaults(run=ctest_summary)
    p = sub.add_parser("record-step")
    p.add_argument("--state", required=True)
    p.add_argument("--kind", choices=["step", "benchmark"], required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--timeout", type=int)
    p.add_argument("--command", default="")
    p.add_argument("--extra", action="append")
    p.set_defaults(run=record_step)
    p = sub.add_parser("render")
    p.add_argument("--state", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(run=render)
    p = sub.add_parser("machine")
    p.add_argument("--out", required=True)
    p.set_defaults(run=machine)
    p = sub.add_parser("torch")
    p.add_argument("--python", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(run=torch_info)
    p = sub.add_parser("check-cache")
    p.add_argument("--cache", required=True)
    p.add_argument("--deps", required=True)
    p.set_defaults(run=check_cache)
    p = sub.add_parser("self-test")
    p.set_defaults(run=self_test)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
