#!/usr/bin/env bash
# The GPU check: one script for a GPU machine that has a CUDA toolkit, CMake, ninja and a python3
# with a CUDA-enabled PyTorch, but no Debian packages and no network (the device tool's H200
# machine; docs/gpu.md). In at most DDP_GPU_CHECK_BUDGET seconds (default 360) it
#   1. reads the machine (nvidia-smi, compiler, CMake, nvcc) and that python3's torch,
#   2. configures a build against that PyTorch's libtorch, with the libraries from .gpu-deps/
#      (scripts/gpu-deps.sh makes it on the Debian machine; the device tool carries it),
#   3. builds only the tests labelled gpu (target ddp_gpu_tests), ddprun and ddp-train-bench,
#   4. runs `ctest -L gpu`,
#   5. times ddp against PyTorch on the GPU: world 2 on one GPU (ddp's staged path against
#      PyTorch DDP on gloo with CUDA tensors) and world 1 (ddp over DDP_BACKEND=nccl and PyTorch
#      over nccl, each against no DDP),
# and writes ONE JSON file, after every step, so a run cut short still leaves what it did:
# $OUT/gpu-check.json when the device tool's OUT is set, else build-gpu/gpu-check.json, or --out.
# Every step runs under `timeout`; a failing step or benchmark is recorded, not fatal, except
# that nothing is built or run after a failed configure or build. Exit 0 only when every step,
# GPU test and benchmark passed and no GPU test skipped.
#
#   bash scripts/gpu-check.sh [--out FILE]
#   bash scripts/gpu-check.sh --self-test     (the step and JSON machinery alone, no build)
#
# Environment: DDP_GPU_CHECK_PYTHON (default python3: the one with torch), DDP_GPU_CHECK_JOBS
# (default nproc), DDP_GPU_CHECK_BUDGET (seconds, default 360), DDP_GPU_CHECK_BUILD (default
# build-gpu), DDP_GPU_DEPS (default .gpu-deps), DDP_GPU_CHECK_STEPS (timed steps per benchmark,
# default 20), DDP_GPU_CHECK_TEST_JOBS (GPU tests run at once, default 4), DDP_GPU_CHECK_BENCHMARKS
# (0: the tests alone, the benchmarks recorded as not run; default 1).
set -eEuo pipefail  # -E: the ERR trap below also sees failures inside functions
cd "$(dirname "$0")/.."
repo=$PWD

out=""
self_test=0
while (($#)); do
  case $1 in
    --out)
      out=${2:?--out needs a file}
      shift 2
      ;;
    --self-test)
      self_test=1
      shift
      ;;
    *)
      echo "gpu-check: unknown argument '$1' (use --out FILE or --self-test)" >&2
      exit 2
      ;;
  esac
done

python=${DDP_GPU_CHECK_PYTHON:-python3}
jobs=${DDP_GPU_CHECK_JOBS:-$(nproc)}
budget=${DDP_GPU_CHECK_BUDGET:-360}
build=${DDP_GPU_CHECK_BUILD:-build-gpu}
deps=${DDP_GPU_DEPS:-.gpu-deps}
bench_steps=${DDP_GPU_CHECK_STEPS:-20}
test_jobs=${DDP_GPU_CHECK_TEST_JOBS:-4}
run_benchmarks=${DDP_GPU_CHECK_BENCHMARKS:-1}
for n in jobs budget bench_steps test_jobs; do
  if ! [[ ${!n} =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu-check: $n is '${!n}', not a positive whole number" >&2
    exit 2
  fi
done
if [[ -z $out ]]; then
  if [[ -n ${OUT:-} ]]; then out=$OUT/gpu-check.json; else out=$repo/$build/gpu-check.json; fi
fi
[[ $out == /* ]] || out=$repo/$out
[[ $build == /* ]] || build=$repo/$build
[[ $deps == /* ]] || deps=$repo/$deps
report=$repo/scripts/gpu_report.py

if ! command -v "$python" >/dev/null; then
  # No Python: the one JSON file still says what happened.
  mkdir -p "$(dirname "$out")"
  printf '{"schema": "ddp-gpu-check/1", "status": "failed", "failures": ["no %s on PATH: set DDP_GPU_CHECK_PYTHON to the python3 that has torch"]}\n' \
    "$python" >"$out"
  echo "gpu-check: no $python on PATH (set DDP_GPU_CHECK_PYTHON); wrote $out" >&2
  exit 1
fi

start=$SECONDS
deadline=$((start + budget))
if ((self_test)); then
  state=$(mktemp -d)
  out=$state/out/gpu-check.json
else
  state=$build/gpu-check-state
  rm -rf "$state"
fi
mkdir -p "$state/logs"
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
failures=()  # failures of the script itself, beside the steps'
completed=0  # set once the last benchmark was recorded: only then can the JSON say "ok"
last_error=""
trap 'last_error="line $LINENO: $BASH_COMMAND (exit $?)"' ERR

render() { "$python" "$report" render --state "$state" --out "$out"; }

write_meta() {  # [finished]
  local finished=${1:-} commit dirty=0 changes
  commit=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo "unknown (no git here)")
  if changes=$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null); then
    dirty=$(grep -c . <<<"$changes" || true)
  fi
  FINISHED=$finished COMPLETED=$completed STARTED=$started ELAPSED=$((SECONDS - start)) BUDGET=$budget COMMIT=$commit \
    DIRTY=$dirty JOBS=$jobs BUILD=$build DEPS=$deps PY=$python STEPS=$bench_steps \
    FAILURES=$(printf '%s\n' "${failures[@]+"${failures[@]}"}") \
    "$python" - "$state/meta.json" <<'EOF'
import json, os, sys
e = os.environ
meta = {"started": e["STARTED"], "finished": e["FINISHED"] or None,
        "completed": e["COMPLETED"] == "1",
        "elapsed_s": int(e["ELAPSED"]), "budget_s": int(e["BUDGET"]),
        "git": {"commit": e["COMMIT"], "modified_tracked_files": int(e["DIRTY"] or 0)},
        "options": {"jobs": int(e["JOBS"]), "build": e["BUILD"], "deps": e["DEPS"],
                    "python": e["PY"], "bench_steps": int(e["STEPS"])},
        "failures": [f for f in e["FAILURES"].split("\n") if f]}
with open(sys.argv[1], "w") as f:
    json.dump(meta, f)
EOF
}

# The seconds a step may take: at most $1, and never past the budget's deadline less $2 seconds
# kept for what follows. Prints 0 when less than 5 seconds would be left.
step_limit() {
  local want=$1 keep=${2:-0} left
  left=$((deadline - SECONDS - keep))
  ((left < want)) && want=$left
  ((want < 5)) && want=0
  echo "$want"
}

step_no=0
# run_step KIND NAME LIMIT [--extra K=V ...] -- COMMAND...: runs COMMAND under timeout LIMIT with
# its output in logs/NN-NAME.log (and on stdout), records the result, renders the JSON. Returns
# the command's status (0 when it passed). LIMIT 0: not run, recorded as such.
run_step() {
  local kind=$1 name=$2 limit=$3 extras=() rc=0 t0 log
  shift 3
  while [[ $1 != -- ]]; do
    extras+=("$1" "$2")
    shift 2
  done
  shift
  step_no=$((step_no + 1))
  log=$state/logs/$(printf %02d "$step_no")-$name.log
  if ((limit == 0)); then
    local why=${not_run_reason:-"the ${budget} s budget was spent"}
    echo "not run: $why (only $((deadline - SECONDS)) s of the ${budget} s budget left)" >"$log"
    "$python" "$report" record-step --state "$state" --kind "$kind" --name "$name" --rc 125 \
      --seconds 0 --log "$log" --command "$*" --extra "status=not_run" \
      --extra "error=not run: $why" "${extras[@]}"
    render
    echo "gpu-check: $kind $name not run: $why"
    return 125
  fi
  echo "=== gpu-check: $kind $name (limit $limit s): $*"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 || rc=$?
  sed 's/^/  | /' "$log" | tail -n 40
  "$python" "$report" record-step --state "$state" --kind "$kind" --name "$name" --rc "$rc" \
    --seconds $((SECONDS - t0)) --timeout "$limit" --log "$log" --command "$*" "${extras[@]}"
  render
  echo "gpu-check: $kind $name: exit $rc after $((SECONDS - t0)) s"
  return "$rc"
}

finish() {
  local rc=$?
  trap - EXIT
  if ((rc != 0 && !completed)) && [[ -n $last_error ]]; then
    failures+=("gpu-check.sh stopped early at $last_error")
  fi
  write_meta "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  render || true
  # The step logs, as one file beside the JSON (the device tool brings back a few files only).
  tar -czf "$(dirname "$out")/gpu-check-logs.tar.gz" -C "$state" logs 2>/dev/null || true
  "$python" - "$out" <<'EOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"gpu-check: {r['status']} in {r['elapsed_s']} s of {r['budget_s']} s; JSON: {sys.argv[1]}")
t = r.get("gpu_tests") or {}
if t.get("summary_line"):
    print(t["summary_line"])
for b in r.get("benchmarks", []):
    print(f"  {b['name']:<28} {b['status']:<8} " + (b.get("line") or b.get("error", ""))[:160])
for f in r.get("failures", []):
    print(f"  failure: {f[:200]}")
EOF
  if ((self_test)); then return; fi
  status=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["status"])' "$out" ||
    echo failed)
  [[ $status == ok ]] || exit 1
}

if ((self_test)); then
  # The machinery on harmless commands: a step that passes, one that fails, one that outlives
  # its limit, one left out for want of budget, a benchmark line; then the JSON must say so.
  write_meta
  render
  run_step step passes 10 -- echo "-- Configuring done" || true
  run_step step fails 10 -- bash -c 'echo "CMake Error: no libtorch" >&2; exit 3' || true
  run_step benchmark too-slow 1 --extra side=ddp -- sleep 30 || true
  run_step benchmark left-out 0 -- true || true
  run_step benchmark measured 10 --extra world=1 -- echo "step_ms=2.000 samples_per_s=32000.0" ||
    true
  completed=1
  write_meta "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  render
  "$python" - "$out" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
steps = {s["name"]: s for s in r["steps"]}
bench = {b["name"]: b for b in r["benchmarks"]}
assert r["status"] == "failed", r["status"]
assert steps["passes"]["status"] == "ok", steps
assert steps["fails"]["status"] == "error" and "no libtorch" in steps["fails"]["error"], steps
assert bench["too-slow"]["status"] == "timeout", bench
assert bench["too-slow"]["seconds"] < 20, bench
assert bench["left-out"]["status"] == "not_run", bench
assert bench["measured"]["status"] == "ok" and bench["measured"]["step_ms"] == 2.0, bench
assert len(r["failures"]) == 3, r["failures"]
print("gpu-check: self-test passed")
EOF
  rm -rf "$state"
  exit 0
fi

trap finish EXIT
write_meta
render

# 1. The machine and its PyTorch.
"$python" "$report" machine --out "$state/machine.json" || failures+=("reading the machine failed")
"$python" "$report" torch --python "$python" --out "$state/torch.json" ||
  failures+=("reading $python's torch failed")
render
torch_cmake=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("cmake_prefix_path") or "")' \
  "$state/torch.json")
torch_prefix=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("python_prefix") or "")' \
  "$state/torch.json")
if [[ -z $torch_cmake ]]; then
  failures+=("$python has no torch with a CMake package (torch.utils.cmake_prefix_path)")
  exit 1
fi
if [[ ! -d $deps/usr ]]; then
  failures+=("no $deps/usr: run scripts/gpu-deps.sh on the Debian machine and carry $deps")
  exit 1
fi

# The carried libraries: for the build (CMAKE_PREFIX_PATH) and for ddp's programs at run time
# (libfmt.so.9; their build RPATH names the folder too). The wheel's CUDA libraries come first for
# the CUDA runtime probe, which loads libcudart by name, as libtorch does through its RPATH.
deps_lib=$deps/usr/lib/x86_64-linux-gnu
site=$(dirname "$(dirname "$(dirname "$torch_cmake")")")  # site-packages/torch/share/cmake
cuda_libs=""
if [[ -d $site/nvidia ]]; then
  cuda_libs=$(find "$site/nvidia" -mindepth 2 -maxdepth 3 -type d -name lib | sort | paste -sd:)
fi
ddp_env=(env "LD_LIBRARY_PATH=$deps_lib${cuda_libs:+:$cuda_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
# PyTorch's side runs with the machine's own LD_LIBRARY_PATH (the driver's folder may be on it),
# not the carried libraries, though ddprun, which starts it, needs them.
if [[ -n ${LD_LIBRARY_PATH:-} ]]; then
  torch_env=(env "LD_LIBRARY_PATH=$LD_LIBRARY_PATH")
else
  torch_env=(env -u LD_LIBRARY_PATH)
fi

# 2. Configure: PyTorch's libtorch, the carried libraries, everything else off.
# Line tables (-g1): a crashed rank's backtrace is resolved to file and line on that machine.
configure=(cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS=-g1
  -DDDP_LIBTORCH=pytorch "-DTorch_DIR=$torch_cmake/Torch" "-DDDP_PYTORCH_VENV=$torch_prefix"
  "-DCMAKE_PREFIX_PATH=$deps/usr" -DDDP_WITH_MPI=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON
  -DCMAKE_DISABLE_FIND_PACKAGE_OpenSSL=ON -DDDP_BUILD_BENCH=ON -DDDP_BENCH_MICRO=OFF
  -DDDP_BUILD_TESTS=ON)
# The nccl backend compiles against nccl.h and cuda_runtime.h: those of the wheel's NCCL and CUDA
# runtime (what torch loads), wherever that Python keeps them.
if [[ -f $site/nvidia/nccl/include/nccl.h ]]; then
  configure+=("-DDDP_NCCL_INCLUDE_DIR=$site/nvidia/nccl/include")
fi
# A wheel's include folder may lack crt/ (CUDA 13's cu13 wheel does): then the toolkit's.
for dir in "$site/nvidia/cu13/include" "$site/nvidia/cuda_runtime/include" /usr/local/cuda/include; do
  if [[ -f $dir/cuda_runtime.h && -f $dir/crt/host_defines.h ]]; then
    configure+=("-DDDP_CUDA_RUNTIME_INCLUDE_DIR=$dir")
    break
  fi
done
if ! run_step step configure "$(step_limit 120 200)" -- "${configure[@]}"; then exit 1; fi
# The carried packages must be the ones found (a system copy would hide a gap in .gpu-deps).
run_step step carried-deps-used 10 -- "$python" "$report" check-cache --cache "$build/CMakeCache.txt" \
  --deps "$deps" || true

# 3. Build only what the check runs.
if ! run_step step build "$(step_limit "$budget" 110)" -- \
  cmake --build "$build" -j "$jobs" --target ddp_gpu_tests ddprun ddp-train-bench; then
  exit 1
fi

# Which std::filesystem the test program binds to (PyTorch 2.11's libtorch.so exports a broken
# copy; this machine's linker is not the Debian one's): recorded, and a failure if it is the wrong one.
run_step step link-probe 30 -- "${ddp_env[@]}" bash "$repo/scripts/gpu_link_probe.sh" \
  "$build/bin/torch_gpu_test" || true

# 4. The tests labelled gpu, a few at a time: they share the device, which holds several
# processes' contexts, and each spends most of its time starting (libtorch, CUDA, rendezvous).
junit=$state/gpu-tests.junit.xml
run_step step gpu-tests "$(step_limit 180 60)" -- "${ddp_env[@]}" ctest --test-dir "$build" -L gpu \
  -j "$test_jobs" --output-on-failure --timeout 90 --output-junit "$junit" || true
# A crashed rank printed its frames as offsets that only this machine's binaries resolve.
tests_log=$(ls "$state"/logs/*-gpu-tests.log 2>/dev/null | tail -n 1)
if [[ -n $tests_log ]] && grep -q "rank process crashed" "$tests_log"; then
  "$python" "$repo/scripts/symbolize_backtraces.py" "$tests_log" >"$state/logs/gpu-tests-symbolized.log" ||
    failures+=("symbolizing the GPU tests' backtraces failed")
  grep -A3 -- "->" "$state/logs/gpu-tests-symbolized.log" | grep -- "->" | grep -v "sigaction\|report_crash\|libc-start\|_start" | head -n 40 || true
fi
if [[ -f $junit ]]; then
  "$python" "$report" ctest-summary --test-dir "$build" --junit "$junit" --prefix gpu-check.sh \
    --json "$state/gpu_tests.json" || failures+=("summarising the GPU tests failed")
else
  failures+=("ctest -L gpu wrote no JUnit file")
fi
render

# 5. Benchmarks: mlp, batch 64 per rank, both sides under ddprun (the same launcher environment).
bench_args=(--model mlp --batch-size 64 --steps "$bench_steps" --warmup 5 --device cuda)
ddprun=("${ddp_env[@]}" "$build/bin/ddprun" --standalone)
train_bench=$build/bin/ddp-train-bench
torch_bench=("${torch_env[@]}" "$python" "$repo/bench/compare/pytorch_ddp_bench.py")
bench() {  # NAME SIDE WORLD BACKEND -- COMMAND...
  local name=$1 side=$2 world=$3 backend=$4 limit
  shift 5
  local not_run_reason=""
  limit=$(step_limit 75 0)
  if [[ $run_benchmarks == 0 ]]; then
    limit=0
    not_run_reason="left out by DDP_GPU_CHECK_BENCHMARKS=0"
  fi
  run_step benchmark "$name" "$limit" --extra "side=$side" --extra "world=$world" \
    --extra "backend=$backend" -- env OMP_NUM_THREADS=1 "$@" || true
}
# World 2 on one GPU first (the staged path against gloo with CUDA tensors), then world 1 over
# NCCL, then world 1 without DDP (the floor both DDPs are measured against).
# --phases: each rank's host time per phase (forward, backward, waiting for the buckets, step),
# in the log beside the result: where DDP's time goes on the device.
bench ddp-w2-one-gpu-staged ddp 2 ring -- "${ddprun[@]}" --nproc-per-node 2 \
  "$train_bench" "${bench_args[@]}" --phases
bench pytorch-w2-one-gpu-gloo pytorch 2 gloo -- "${ddprun[@]}" --nproc-per-node 2 \
  "${torch_bench[@]}" "${bench_args[@]}" --backend gloo
bench ddp-w1-nccl ddp 1 nccl -- DDP_BACKEND=nccl "${ddprun[@]}" --nproc-per-node 1 \
  "$train_bench" "${bench_args[@]}" --always-ddp --phases
bench pytorch-w1-nccl pytorch 1 nccl -- "${ddprun[@]}" --nproc-per-node 1 "${torch_bench[@]}" \
  "${bench_args[@]}" --always-ddp --backend nccl
bench ddp-w1-no-ddp ddp 1 none -- "${ddprun[@]}" --nproc-per-node 1 \
  "$train_bench" "${bench_args[@]}" --phases
bench pytorch-w1-no-ddp pytorch 1 none -- "${ddprun[@]}" --nproc-per-node 1 \
  "${torch_bench[@]}" "${bench_args[@]}"
# FSDP over NCCL at world 1 with and without CPU offload (last: left out first when time is short):
# what moving the shards, their gradients and the optimizer step to the host costs a step.
bench ddp-w1-nccl-fsdp ddp 1 nccl -- DDP_BACKEND=nccl "${ddprun[@]}" --nproc-per-node 1 \
  "$train_bench" "${bench_args[@]}" --sharding fsdp --phases
bench ddp-w1-nccl-fsdp-cpu-offload ddp 1 nccl -- DDP_BACKEND=nccl "${ddprun[@]}" \
  --nproc-per-node 1 "$train_bench" "${bench_args[@]}" --sharding fsdp --cpu-offload --phases
completed=1
