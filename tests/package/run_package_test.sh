#!/usr/bin/env bash
# Installs the built project into a temporary prefix and builds and runs a separate project
# against it through find_package(ddp): once with libtorch's CMake package, once with it hidden
# (the path taken on systems whose libtorch ships no TorchConfig.cmake).
set -euo pipefail
build_dir=$1
source_dir=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/ddp/ddpConfig.cmake"

for variant in torch-package system-headers; do
  extra=()
  if [[ $variant == system-headers ]]; then extra=(-DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON); fi
  cmake -S "$source_dir/tests/package/consumer" -B "$work/$variant" -G Ninja \
    -DCMAKE_PREFIX_PATH="$work/prefix" "${extra[@]}" > "$work/$variant.log"
  expected="Torch CMake package"
  if [[ $variant == system-headers ]]; then expected="system headers"; fi
  grep -q "ddp: libtorch from $expected" "$work/$variant.log" ||
    { echo "consumer ($variant) did not find libtorch through $expected:"; cat "$work/$variant.log"; exit 1; }
  cmake --build "$work/$variant" >> "$work/$variant.log"
  "$work/$variant/comm_consumer"
  "$work/$variant/torch_consumer"
done
echo "package test: both variants built and ran"
