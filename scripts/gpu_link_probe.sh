#!/usr/bin/env bash
# Which copy of std::filesystem a ddp test program binds to, on the machine that built it.
# PyPI's libtorch.so of PyTorch 2.11 exports its own std::filesystem, whose remove_all calls
# through a null pointer; ddp::libtorch lists libstdc++ first so that programs bind to libstdc++'s
# (cmake/DdpFindTorch.cmake, docs/gpu.md). Prints the program's NEEDED order, its remove_all
# references, the libraries it loads, and the dynamic linker's bindings of remove_all while
# Gpu.StdFilesystemRemoveAllBindsToLibstdcxxBesideLibtorch runs; exits with that test's status.
# scripts/gpu-check.sh runs it after the build, with the run-time LD_LIBRARY_PATH.
#
#   bash scripts/gpu_link_probe.sh BUILD/bin/torch_gpu_test
set -uo pipefail
program=${1:?usage: gpu_link_probe.sh PATH/TO/torch_gpu_test}
[[ -x $program ]] || { echo "gpu_link_probe: $program is not an executable" >&2; exit 2; }
bindings=$(mktemp -d)
trap 'rm -rf "$bindings"' EXIT

echo "the compiler's libstdc++: shared $(c++ -print-file-name=libstdc++.so), archive $(c++ -print-file-name=libstdc++.a)"
echo "linker: $(ld --version | head -n 1)"
echo "NEEDED, in the order the dynamic linker searches them:"
readelf -d "$program" | grep NEEDED
echo "the program's references to std::filesystem::remove_all:"
objdump -T "$program" | grep remove_all || echo "  (none)"
echo "loaded:"
ldd "$program" | grep -E 'libstdc\+\+|libtorch\.so|libtorch_cpu' || true
libstdcxx=$(ldd "$program" | awk '/libstdc\+\+/ {print $3}')
if [[ -n $libstdcxx ]]; then
  echo "$libstdcxx exports $(objdump -T "$libstdcxx" | grep -c remove_all) remove_all symbols"
fi

LD_DEBUG=bindings LD_DEBUG_OUTPUT=$bindings/ld "$program" \
  --gtest_filter=Gpu.StdFilesystemRemoveAllBindsToLibstdcxxBesideLibtorch
status=$?
echo "the dynamic linker's bindings of remove_all (count, from, to):"
cat "$bindings"/ld.* 2>/dev/null | grep remove_all | sed -E 's/^ *[0-9]+: *//' | sort | uniq -c ||
  echo "  (none recorded)"
exit "$status"
