#!/usr/bin/env bash
# The compiler launcher when ccache is installed (CMakeLists.txt): compiler-launcher.sh CCACHE
# COMPILER ARGS...
#  - Precompiled headers (outputs ending in .gch) go through ccache too. GCC writes a different
#    .gch every time it compiles the same header, and ccache hashes the .gch into every compile
#    that uses it: compiled afresh, it made every libtorch translation unit miss the cache on every
#    clean build (about 6 minutes of each CI stage that builds libtorch code). Restored from the
#    cache, it is the same bytes, so they hit. A restored .gch works in another build folder
#    (checked with -Winvalid-pch -H: "! .../cmake_pch.hxx.gch", valid and used).
#  - A compile that fails with "sorry, unimplemented: PCH allocation failure" is run again, twice
#    at most: GCC maps the header at an address that the kernel may already have given to
#    something else in that process, and a new process gets another layout. Any other failure is
#    reported at once, with its output.
set -u
ccache=$1
shift
command=("$ccache" "$@")
for attempt in 1 2 3; do
  errors=$(mktemp)
  "${command[@]}" 2>"$errors"
  status=$?
  if ((status != 0 && attempt < 3)) && grep -q "PCH allocation failure" "$errors"; then
    echo "compiler-launcher.sh: PCH allocation failure, compiling again (attempt $((attempt + 1)) of 3)" >&2
    rm -f "$errors"
    continue
  fi
  cat "$errors" >&2
  rm -f "$errors"
  exit "$status"
done
