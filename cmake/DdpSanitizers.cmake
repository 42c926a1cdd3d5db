# Sanitizer and fuzzing builds of ddp's own targets (docs/fuzzing.md, scripts/test.sh).
#
#   -DDDP_SANITIZE=address   ASan + UBSan (every UB check fatal), for the unit and multi-process suites
#   -DDDP_SANITIZE=thread    TSan
#   -DDDP_FUZZ=ON            libFuzzer harnesses in tests/system/fuzz (clang only; implies address)
#
# The flags are set for this directory tree, so they reach every target ddp builds (libraries,
# tools, tests) and nothing else: dependencies (libtorch, OpenMPI, GoogleTest) come prebuilt and
# uninstrumented. libtorch is not sanitizer-built, so configure these builds with
# -DDDP_BUILD_TORCH=OFF: ddp::comm, ddprun, ddp-bench and their tests.
set(DDP_SANITIZE "" CACHE STRING
    "Sanitizers for ddp's own targets: empty (none), 'address' (ASan+UBSan) or 'thread' (TSan)")
set_property(CACHE DDP_SANITIZE PROPERTY STRINGS "" address thread)
option(DDP_FUZZ "Build the libFuzzer harnesses in tests/system/fuzz (needs clang)" OFF)

if(DDP_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "DDP_FUZZ=ON needs clang (libFuzzer), not ${CMAKE_CXX_COMPILER_ID}: "
                        "configure a separate build with CC=clang CXX=clang++")
  endif()
  if(DDP_SANITIZE STREQUAL "")
    set(DDP_SANITIZE address CACHE STRING "" FORCE)
  elseif(NOT DDP_SANITIZE STREQUAL "address")
    message(FATAL_ERROR "DDP_FUZZ=ON runs under ASan+UBSan; DDP_SANITIZE='${DDP_SANITIZE}' "
                        "cannot be combined with it")
  endif()
endif()

if(DDP_SANITIZE STREQUAL "address")
  set(_ddp_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=undefined
                          -fno-omit-frame-pointer)
elseif(DDP_SANITIZE STREQUAL "thread")
  set(_ddp_sanitize_flags -fsanitize=thread -fno-omit-frame-pointer)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC warns that TSan does not model std::atomic_thread_fence. The shared-memory engine's
    # one fence orders accesses to memory shared between processes, which TSan (one process)
    # does not see either way; the warning would only make the build look unclean.
    add_compile_options(-Wno-tsan)
  endif()
elseif(NOT DDP_SANITIZE STREQUAL "")
  message(FATAL_ERROR "DDP_SANITIZE='${DDP_SANITIZE}': expected empty, 'address' or 'thread'")
endif()

if(_ddp_sanitize_flags)
  if(DDP_BUILD_TORCH)
    message(WARNING "DDP_SANITIZE=${DDP_SANITIZE} with DDP_BUILD_TORCH=ON: libtorch is not "
                    "sanitizer-built and reports from it are not ours; use -DDDP_BUILD_TORCH=OFF")
  endif()
  add_compile_options(${_ddp_sanitize_flags})
  add_link_options(${_ddp_sanitize_flags})
  message(STATUS "ddp: sanitizers for ddp's targets: ${_ddp_sanitize_flags}")
endif()
if(DDP_FUZZ)
  # Coverage instrumentation everywhere; only the harnesses link libFuzzer's main
  # (tests/system/fuzz).
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()
