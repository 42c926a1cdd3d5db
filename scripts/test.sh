#!/usr/bin/env bash
# Installs what is missing, builds and runs every test, in stages (CTest labels: unit,
# multiprocess, netns, slow, fuzz, gpu; after each ctest run of the main and pytorch stages, one
# line says how many tests labelled gpu did not run for want of a CUDA device, docs/gpu.md):
#   main   the default build against DDP_LIBTORCH's libtorch (debian: build/, pytorch:
#          build-pytorch/): every test
#   pytorch  when main is against Debian's libtorch: build-pytorch/ against PyTorch 2.x from PyPI,
#          what differs by libtorch: torch_ddp (python/: ddp as a torch.distributed backend,
#          pip-installed into the PyTorch environment) with a subset of PyTorch's own suite, the
#          trainer's runs (also under PyTorch 2.x's torchrun), the package, the configure checks
#          and tests/torch's unit suite (state dicts, optimizer states, hostile files: the pickle
#          and IValue paths that differ between libtorch versions); the layers below (net, store,
#          comm, init) do not link libtorch and are the same code as in main
#   asan   build-asan/ (clang, ASan+UBSan, no libtorch): the unit and multiprocess suites
#   tsan   build-tsan/ (TSan, no libtorch): the net, store, engine (comm, shm), init and rpc tests
#   fuzz   build-fuzz/ (clang, libFuzzer+ASan+UBSan, no libtorch): each harness for
#          DDP_FUZZ_SECONDS (default 15) from its seed corpus (docs/fuzzing.md)
# DDP_TEST_STAGES picks stages (default: main,pytorch,asan,tsan,fuzz; without pytorch when
# DDP_LIBTORCH=pytorch, as main covers it then), e.g.
#   DDP_TEST_STAGES=asan bash scripts/test.sh
# Extra arguments go to the main stage's ctest, e.g. `scripts/test.sh -L unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch-choice.sh

if [[ $ddp_libtorch == debian ]]; then
  stages=${DDP_TEST_STAGES:-main,pytorch,asan,tsan,fuzz}
else
  stages=${DDP_TEST_STAGES:-main,asan,tsan,fuzz}
fi
for s in ${stages//,/ }; do
  case $s in main | pytorch | asan | tsan | fuzz) ;; *)
    echo "test.sh: unknown stage '$s' in DDP_TEST_STAGES (stages: main, pytorch, asan, tsan," \
         "fuzz)" >&2
    exit 2
    ;;
  esac
done
want() { [[ ",$stages," == *",$1,"* ]]; }

jobs=$(nproc)
asan_options=halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1
suppressions=$PWD/tests/system/sanitizers
sanitizer_env=(
  "ASAN_OPTIONS=$asan_options"
  "LSAN_OPTIONS=suppressions=$suppressions/lsan.supp:print_suppressions=0"
  "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1"
  "TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$suppressions/tsan.supp"
)
# ctest over a build that may hold tests labelled gpu, then one line on them: a GPU test that
# skipped for want of a CUDA device is never a silent pass (scripts/gpu_report.py reads ctest's
# JUnit file; docs/gpu.md). The exit status is ctest's, or the report's if that fails.
#   run_ctest DIR [ctest arguments...]
run_ctest() {
  local dir=$1 junit rc=0
  shift
  junit=$(mktemp --suffix=.xml)
  ctest --test-dir "$dir" --output-junit "$junit" "$@" || rc=$?
  python3 scripts/gpu_report.py ctest-summary --test-dir "$dir" --junit "$junit" \
    --prefix test.sh || { ((rc != 0)) || rc=$?; }
  rm -f "$junit"
  return "$rc"
}

# A folder whose CTestTestfile.cmake lists the test folders given (relative to BUILD), for one
# ctest run over them: a run per folder waits for each folder's longest test with a core idle.
#   tests_of BUILD FOLDER... (prints the folder's path)
tests_of() {
  local build=$1 dir
  shift
  dir=$build/stage-tests
  mkdir -p "$dir"
  printf 'subdirs("%s")\n' "${@/#/$PWD/$build/}" > "$dir/CTestTestfile.cmake"
  echo "$dir"
}

# Every stage builds RelWithDebInfo with line tables only (-g1): backtraces and sanitizer reports
# keep file:line, and the objects are a quarter of -g's size, so compiles and links are faster
# (a libtorch test: 17 MB against 4.5 MB). For a debugger session build without test.sh.
build_type=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
            "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")

timings=()
# Each stage says how much disk it starts with: a linker that runs out of disk dies of SIGBUS
# ("ld terminated with signal 7 [Bus error]"), which names nothing, as CI's run of stop 59 did.
stage_start() {
  echo "=== test.sh: stage $1 ($(df -h --output=avail . | tail -1 | tr -d ' ') free on this disk) ==="
  stage_t0=$SECONDS
}
# Under CI (CI=true, a clean clone thrown away afterwards) a finished stage's build folder goes:
# the five build folders together take about 10 GiB, the largest 3, and only ccache is reused.
#   stage_end NAME [BUILD_DIR]
stage_end() {
  timings+=("$1 $((SECONDS - stage_t0)) s")
  if [[ ${CI:-} == true && -n ${2:-} && -d $2 ]]; then
    echo "test.sh: CI=true, removing $2/ ($(du -sh "$2" | cut -f1)) now that stage $1 is done"
    rm -rf "$2"
  fi
}
report_timings() {
  local t
  for t in "${timings[@]}"; do echo "test.sh: stage $t"; done
}
trap report_timings EXIT

bash scripts/install-deps.sh

if want main; then
  stage_start main
  echo "test.sh: main stage against $ddp_libtorch_line ($ddp_build_dir/)"
  python_option=()  # torch_ddp builds against PyTorch's own libtorch only
  [[ $ddp_libtorch == pytorch ]] && python_option=(-DDDP_BUILD_PYTHON=ON)
  cmake -S . -B "$ddp_build_dir" -G Ninja "${build_type[@]}" \
    "${ddp_cmake_libtorch[@]}" "${python_option[@]}"
  cmake --build "$ddp_build_dir"
  if [[ $ddp_libtorch == pytorch ]]; then
    TORCH_DDP_BUILD_DIR=$PWD/$ddp_build_dir scripts/pytorch-python -m pip install --quiet \
      --no-build-isolation ./python
  fi
  run_ctest "$ddp_build_dir" --output-on-failure --timeout 600 -j "$jobs" "$@"
  stage_end main "$ddp_build_dir"
fi

if want pytorch; then
  stage_start pytorch
  DDP_LIBTORCH=pytorch source scripts/libtorch-choice.sh
  echo "test.sh: pytorch stage against $ddp_libtorch_line ($ddp_build_dir/)"
  cmake -S . -B "$ddp_build_dir" -G Ninja "${build_type[@]}" \
    "${ddp_cmake_libtorch[@]}" -DDDP_BUILD_PYTHON=ON
  # Only what this stage's tests run (the folders below, the programs their scripts start, and
  # every installed program: tests/system/package installs the build tree): the torch-free tests and
  # benchmarks ran in the main stage, and linking each against PyTorch's libtorch costs CI
  # minutes for nothing. Of tests/torch only the unit suite: its multi-process suite is the same
  # C++ against another libtorch, 26 files that took a third of this stage's build and whose
  # paths the trainer's runs and torch_ddp's tests cross here; the CI's 90 minutes could not hold
  # both (a cold run took 101).
  pytorch_stage_dirs=(tests/programs tests/system/package tests/system/libtorch_select python)
  cmake --build "$ddp_build_dir" --target "${pytorch_stage_dirs[@]/%//all}" torch_unit_test \
    train-char-gpt train-gpt train-hybrid ddp-bench ddp-train-bench
  # torch_ddp into the PyTorch environment, as the README says (reusing this build), for the
  # tests below and PyTorch's own suite (python/ and tests/python run it from the build folder).
  TORCH_DDP_BUILD_DIR=$PWD/$ddp_build_dir scripts/pytorch-python -m pip install --quiet \
    --no-build-isolation ./python
  # Left to the main stage, where they ran: the benchmarks' tiny forms (fault_trial.*: what they
  # drive does not depend on the libtorch), the comparisons against a PyTorch reference script
  # (*PyTorch*: the reference runs the same Python either way, and the ddp side's other tests
  # run here), train-fashion-mnist's option checks (refused before libtorch does anything), and
  # the trainer's longest runs, whose features (ZeRO, FSDP, Join, accumulation, checkpoint
  # refusals, the state-dict crossover with Python) tests/torch covers here through the library:
  # its short training, resume, SyncBatchNorm, bf16 and PowerSGD runs stay.
  main_stage_only='^fault_trial[.]|(Equals|SameNumbersAs|SameParametersAs)PyTorch'
  main_stage_only+='|^TrainFashionMnistOptionsTest[.]|^train_fashion_mnist[.]state_dict_crossover$'
  main_stage_only+='|^TrainFashionMnistTest[.](GlobalBatchSize|FsdpAndZero2|ZeroSharded|Resuming'
  main_stage_only+='WithAnother|UnevenInputsUnderJoin|AFullDisk|AnEpochCheckpointOfSgd)'
  # train-gpt's layouts and flags (tests/programs, from tests/model_parallel) ran in main only;
  # so did train-hybrid against PyTorch's tutorial (the same PyTorch either way).
  main_stage_only+='|^train_gpt[.]|^TrainGptFlags[.]|^train_hybrid[.]'
  # Every test of these folders carries a label; tests/torch's multi-process suite, not built
  # here, stands for itself as one unlabelled *_NOT_BUILT test, which the label filter leaves out.
  stage_tests=$(tests_of "$ddp_build_dir" tests/torch "${pytorch_stage_dirs[@]}")
  run_ctest "$stage_tests" --output-on-failure --timeout 600 -j "$jobs" \
    -L '^(unit|multiprocess|slow)$' -E "$main_stage_only"
  # PyTorch's own distributed test suite, a fixed subset, on gloo and on ddp at world 2: every
  # test that passes on gloo must pass on ddp but for the listed ones (docs/pytorch-backend.md;
  # about two minutes; WORLDS="2 3" scripts/pytorch-dist-suite.sh adds world 3 by hand, and
  # tests/python trains at world 3).
  WORLDS=2 scripts/pytorch-dist-suite.sh ddp torch_ddp "$ddp_build_dir/pytorch-suite-ci" -- \
    --tests-file scripts/pytorch_dist_suite_ci.txt --start-method fork
  stage_end pytorch "$ddp_build_dir"
fi

# Sanitizer builds: ddp's own code instrumented, libtorch left out (it is not sanitizer-built).
# At the build type's -O2, like the other stages: -O1 for the library and -O0 for the tests' own
# code (tried) built a cold asan stage in 12 minutes but slowed its tests several times (a world-8
# allreduce test of every dtype and op: 90 s, against 3.8 s in the main stage), since the tests
# compute their expected values in loops of their own and -O1 does not vectorise the reduce
# kernels; and the CI's ccache holds the -O2 objects.
sanitized_build() {  # DIR "TARGET..." [cmake args...]
  local dir=$1 targets
  read -ra targets <<<"$2"
  shift 2
  cmake -S . -B "$dir" -G Ninja "${build_type[@]}" -DDDP_BUILD_TORCH=OFF \
    -DDDP_BUILD_BENCH=OFF "$@"
  cmake --build "$dir" --target "${targets[@]}"
}

# The sanitizer stages leave the tests labelled gpu out (by label: asan runs unit and
# multiprocess, tsan those in the engine's folders): the CUDA runtime and driver they load are
# not sanitizer-built (ASan needs protect_shadow_gap=0 for them, TSan does not see their threads'
# synchronisation), and there is no GPU here to run them on. The main stage reports them.

# The tests that start OpenMPI (MPI_Init under mpirun): the sanitizer stages treat them apart.
mpi_tests='^mpi\.|MpiBackendUnderMpirun|MpiBackendWithoutMpirun\.UnderMpirun'

if want asan; then
  stage_start asan
  # clang, as the fuzz stage: GCC 12 built this stage's ASan+UBSan objects 2.5 times slower (the
  # engine's tests and their library: 255 s against 101 s, no ccache), its longest cold step.
  sanitized_build build-asan all -DDDP_SANITIZE=address -DCMAKE_C_COMPILER=clang \
    -DCMAKE_CXX_COMPILER=clang++
  env "${sanitizer_env[@]}" ctest --test-dir build-asan --output-on-failure --timeout 900 \
    -j "$jobs" -L 'unit|multiprocess' -E "$mpi_tests"
  # The tests that run OpenMPI: its leaks are suppressed (tests/system/sanitizers/lsan.supp), which
  # needs whole stacks (slow unwinding) and its plug-ins kept loaded so their frames have names.
  # The conformance suite at four processes is left to the main stage (at np1 to np3 the same
  # collectives run the same code; the np4 pair took 80 s here, the slowest of the 42).
  env "${sanitizer_env[@]}" OMPI_MCA_mca_base_component_disable_dlclose=1 \
    PMIX_MCA_mca_base_component_disable_dlclose=1 \
    ASAN_OPTIONS="$asan_options:fast_unwind_on_malloc=0" \
    ctest --test-dir build-asan --output-on-failure --timeout 900 -j "$jobs" \
    -L 'unit|multiprocess' -R "$mpi_tests" -E '^mpi[.]conformance[.](blocking[.])?np4$'
  stage_end asan build-asan
fi

if want tsan; then
  stage_start tsan
  # The engine and the store (and the layers under them): where threads meet. Only their tests
  # (and what those start) are built. The tests that run
  # OpenMPI are left out: it is not TSan-instrumented, and TSan reports a lock-order inversion
  # inside its TCP transport during MPI_Init (docs/fuzzing.md). tests/nccl's CPU tests dlopen
  # libcudart (no GPU here) and pass under TSan; its GPU test (label gpu) is left out by -L.
  # The collectives' instances at worlds 6 to 8 are left to the main and asan stages: a rank's
  # threads (its caller, worker and the mesh's) are the same at every world, the algorithms are
  # chosen at worlds 2 to 5 as at 8, and those twelve took 180 s of this stage's 622 (TSan, 8
  # instrumented processes on 2 cores).
  tsan_left_out="$mpi_tests|_world[6-8]( |\$)"
  tsan_dirs=(net store comm shm init nccl rpc)
  tsan_targets=("${tsan_dirs[@]/#/tests/}")
  sanitized_build build-tsan "${tsan_targets[*]/%//all}" -DDDP_SANITIZE=thread
  env "${sanitizer_env[@]}" ctest --test-dir "$(tests_of build-tsan "${tsan_targets[@]}")" \
    --output-on-failure --timeout 900 -j "$jobs" -L 'unit|multiprocess' -E "$tsan_left_out"
  stage_end tsan build-tsan
fi

if want fuzz; then
  stage_start fuzz
  sanitized_build build-fuzz ddp_fuzzers -DDDP_FUZZ=ON -DCMAKE_C_COMPILER=clang \
    -DCMAKE_CXX_COMPILER=clang++
  env "${sanitizer_env[@]}" ctest --test-dir build-fuzz --output-on-failure -j "$jobs" -L fuzz
  stage_end fuzz build-fuzz
fi
