#!/usr/bin/env bash
# Installs the built project into a temporary prefix and builds and runs a separate project
# against it through find_package(ddp), with the libtorch the build used (DDP_LIBTORCH, read from
# its cache): Debian's once with libtorch's CMake package and once with it hidden (the path taken
# on systems whose libtorch ships no TorchConfig.cmake); PyPI's through its CMake package (it has
# no other). The consumer must get the same libtorch version that ddp::torch was built against.
set -euo pipefail
build_dir=$1
source_dir=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The consumer compiles through ccache where it is installed, as ddp's own build does: its three
# libtorch translation units took most of this test's minute. (One program on the old paths for
# both variants was slower cold: two of the heavier units in a row, not one beside a light one.) Its sources are copied next to the
# prefix so that every path the compiler sees lies under CCACHE_BASEDIR, and a later run (another
# temporary folder, another clone) finds the same objects; what the installed headers hold is
# hashed, so a changed header is compiled again.
consumer_source=$work/consumer
cp -r "$source_dir/tests/system/package/consumer" "$consumer_source"
launcher=()
if command -v ccache > /dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=$work CCACHE_NOHASHDIR=true
  export CCACHE_SLOPPINESS=time_macros,include_file_mtime,include_file_ctime
fi

cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$build_dir/CMakeCache.txt"; }
libtorch=$(cache_value DDP_LIBTORCH)
libtorch=${libtorch:-debian}

cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/ddp/ddpConfig.cmake"

variants=(torch-package)
if [[ $libtorch == debian ]]; then variants+=(system-headers); fi
for variant in "${variants[@]}"; do
  extra=()
  # The old header paths are checked with the first variant only (the same headers either way).
  if [[ $variant == system-headers ]]; then
    extra=(-DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON -DDDP_CONSUMER_OLD_PATHS=OFF)
  fi
  cmake -S "$consumer_source" -B "$work/$variant" -G Ninja \
    -DCMAKE_PREFIX_PATH="$work/prefix" "${launcher[@]}" "${extra[@]}" > "$work/$variant.log" 2>&1 ||
    { echo "consumer ($variant) failed to configure:"; cat "$work/$variant.log"; exit 1; }
  expected="Torch CMake package"
  if [[ $variant == system-headers ]]; then expected="system headers"; fi
  grep -q "ddp: libtorch .* (DDP_LIBTORCH=$libtorch) from $expected" "$work/$variant.log" ||
    { echo "consumer ($variant) did not find $libtorch's libtorch through $expected:"
      cat "$work/$variant.log"; exit 1; }
  cmake --build "$work/$variant" >> "$work/$variant.log" 2>&1 ||
    { echo "consumer ($variant) failed to build:"; cat "$work/$variant.log"; exit 1; }
  "$work/$variant/comm_consumer"
  # A program on the old header paths built (with -Werror) and runs.
  if [[ $variant == torch-package ]]; then "$work/$variant/old_paths_consumer"; fi
  out=$("$work/$variant/torch_consumer")
  echo "$variant: $out"
  # libstdc++ comes before libtorch among the consumer's libraries (cmake/DdpFindTorch.cmake: a
  # libtorch that exports std::filesystem must not capture the program's calls).
  needed=$(readelf -d "$work/$variant/torch_consumer" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  stdcxx_at=$(grep -n '^libstdc++' <<<"$needed" | head -1 | cut -d: -f1)
  torch_at=$(grep -n '^libtorch' <<<"$needed" | head -1 | cut -d: -f1)
  [[ -n $stdcxx_at && -n $torch_at && $stdcxx_at -lt $torch_at ]] ||
    { echo "consumer ($variant) lists libtorch before libstdc++:"; echo "$needed"; exit 1; }
  # The version ddp::torch reports is the one its consumer runs on.
  version=$(sed -n 's/.*ddp: libtorch \([0-9.]*\) .*/\1/p' "$work/$variant.log" | head -1)
  [[ $out == "libtorch $version sum 4"* ]] ||
    { echo "consumer ($variant) runs on '$out', expected libtorch $version"; exit 1; }
done
echo "package test ($libtorch libtorch): ${variants[*]} built and ran"
