#!/usr/bin/env bash
# Run HERE (Debian 12), before a GPU check: fetches the libraries ddp's build needs beyond a CUDA
# toolkit and PyTorch (fmt, GoogleTest/GMock, CLI11, nlohmann-json, zlib, libdeflate), as Debian
# packages (`apt-get download`), and unpacks them (`dpkg -x`) into .gpu-deps/ (ignored by git), which the
# device tool carries to the GPU machine beside the working tree; scripts/gpu-check.sh builds
# against it there (CMAKE_PREFIX_PATH, LD_LIBRARY_PATH). That machine has no Debian packages and no
# network. What is turned off instead of carried: OpenMPI (DDP_WITH_MPI=OFF), OpenSSL (shared-
# secret authentication; a GPU check needs none), Google Benchmark (DDP_BENCH_MICRO=OFF: only
# ddp-train-bench is built), the fuzzers. docs/gpu.md says how the pieces fit.
#
#   bash scripts/gpu-deps.sh [DIR]     (default DIR: .gpu-deps in the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu-deps}

packages=(
  libfmt-dev libfmt9            # fmt: headers, CMake package, libfmt.so.9 (needed at run time)
  libgtest-dev libgmock-dev     # GoogleTest/GMock: static libraries, CMake package
  libcli11-dev                  # CLI11 (header-only): ddprun, ddp-train-bench
  nlohmann-json3-dev            # nlohmann-json (header-only)
  zlib1g-dev zlib1g             # zlib: ddp::torch's checkpoint CRCs; libz.so.1 beside its link
  libdeflate-dev libdeflate0    # libdeflate: the CRC-32 of the zip records ddp reads
)

if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  echo "gpu-deps: needs apt-get and dpkg (run it on the Debian 12 development machine, not on" \
       "the GPU machine)" >&2
  exit 1
fi
arch=$(dpkg --print-architecture)
if [[ $arch != amd64 ]]; then
  echo "gpu-deps: this machine is $arch; the GPU machine is x86-64 (amd64). Run it on an amd64" \
       "Debian 12 machine" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "gpu-deps: downloading ${packages[*]}"
# `apt-get download` needs the package lists; refresh them once if a download fails for want
# of them (bounded, like every network step).
if ! (cd "$work" && timeout 300 apt-get download -q "${packages[@]}" >"$work/download.log" 2>&1); then
  echo "gpu-deps: download failed ($(tail -1 "$work/download.log")); refreshing the package" \
       "lists and trying once more"
  timeout 300 apt-get update -qq
  (cd "$work" && timeout 300 apt-get download -q "${packages[@]}")
fi

rm -rf "$dest.new"
mkdir -p "$dest.new"
for deb in "$work"/*.deb; do
  dpkg -x "$deb" "$dest.new"
  # shellcheck disable=SC2016  # dpkg-deb's own ${field} syntax, not the shell's
  dpkg-deb -W --showformat='${Package} ${Version}\n' "$deb" >>"$dest.new/MANIFEST"
done
# Documentation and manual pages are not needed for the build.
rm -rf "$dest.new/usr/share/doc" "$dest.new/usr/share/man" "$dest.new/usr/share/lintian" \
  "$dest.new/usr/src"  # libgtest-dev: a link to the sources of another package
# zlib1g-dev's libz.so points at /lib/x86_64-linux-gnu/libz.so.1.2.13, which another system
# may not have (Ubuntu 24.04 has 1.3): point it at the copy carried beside it.
multiarch=usr/lib/x86_64-linux-gnu
zlib_so=$(cd "$dest.new/lib/x86_64-linux-gnu" && ls libz.so.1.*)
mv "$dest.new/lib/x86_64-linux-gnu/$zlib_so" "$dest.new/$multiarch/"
ln -sfn "$zlib_so" "$dest.new/$multiarch/libz.so"
ln -sfn "$zlib_so" "$dest.new/$multiarch/libz.so.1"
rm -rf "$dest.new/lib"
# Every link must resolve inside the folder: the device tool carries links as links.
broken=$(find "$dest.new" -xtype l)
if [[ -n $broken ]]; then
  echo "gpu-deps: links that do not resolve inside $dest.new: $broken" >&2
  exit 1
fi
outside=$(find "$dest.new" -type l -lname '/*')
if [[ -n $outside ]]; then
  echo "gpu-deps: absolute links (they would point outside the carried folder): $outside" >&2
  exit 1
fi
rm -rf "$dest"
mv "$dest.new" "$dest"
size=$(du -sh "$dest" | cut -f1)
echo "gpu-deps: $dest holds $(wc -l <"$dest/MANIFEST") packages, $size:"
sed 's/^/  /' "$dest/MANIFEST"
echo "gpu-deps: carry it with the device tool's run: carry [\"$dest\"] (docs/gpu.md)"
