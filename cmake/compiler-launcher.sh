#!/usr/bin/env bash
# The compiler launcher when ccache is installed (CMakeLists.txt): compiler-launcher.sh CCACHE
# COMPILER ARGS...
#  - A precompiled header (an output ending in .gch) is compiled without ccache: its bytes depend
#    on the build folder, and one restored into another folder has failed its every use ("sorry,
#    unimplemented: PCH allocation failure").
#  - A compile that fails with that message is run again, twice at most: GCC maps the header at
#    an address that the kernel may already have given to something else in that process, and a
#    new process gets another layout. Any other failure is reported at once, with its output.
set -u
ccache=$1
shift
command=("$ccache" "$@")
for arg in "$@"; do
  if [[ $arg == *.gch ]]; then command=("$@"); fi
done
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
