#!/usr/bin/env bash
# Installs, from Debian's packages, everything the build, the tests, the examples and the peer
# comparisons need. Idempotent and quick when everything is already there: apt is only called
# for packages that are missing.
set -euo pipefail

packages=(
  g++ cmake ninja-build ccache pkg-config git clang-format
  clang libclang-rt-14-dev  # the fuzz stage of scripts/test.sh: clang and libFuzzer
  libtorch-dev libopenblas0-pthread
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist python3-torch
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libfmt-dev nlohmann-json3-dev zlib1g-dev libssl-dev
  iproute2 procps
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
if [[ $(id -u) -ne 0 ]]; then
  echo "install-deps: need root to install packages (run as root or with sudo)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
