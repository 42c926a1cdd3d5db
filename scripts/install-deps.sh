#!/usr/bin/env bash
# Installs, from Debian's packages and (PyTorch's current release) from PyPI, everything the
# build, the tests, the examples and the peer comparisons need. Idempotent and quick when
# everything is already there: apt is only called for packages that are missing, pip only when
# the pinned PyTorch is not in its environment yet.
set -euo pipefail

packages=(
  g++ cmake ninja-build ccache pkg-config git clang-format
  lld  # the linker CMakeLists.txt picks where it is installed (DDP_LINK_WITH_LLD)
  clang libclang-rt-14-dev  # the fuzz stage of scripts/test.sh: clang and libFuzzer
  libtorch-dev libopenblas0-pthread
  libgloo-dev  # gloo's headers: tests/torch builds c10d::ProcessGroupGloo (libtorch links libgloo0)
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist python3-torch
  python3-venv  # the PyTorch 2.x environment below
  libpython3-dev  # Python.h: torch_ddp, the extension in python/ (built in the pytorch stage)
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libfmt-dev nlohmann-json3-dev zlib1g-dev libssl-dev
  libdeflate-dev  # the CRC-32 of every zip record read (src/archive)
  iproute2 procps
  nftables  # scripts/cluster.sh --loss (this kernel has no netem)
  # the plots: scripts/plot_metrics.py, scripts/plot_trace.py, bench/cluster/plot_cluster.py
  python3-matplotlib
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
else
  echo "install-deps: installing ${missing[*]}"
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: need root to install packages (run as root or with sudo)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# PyTorch's current release from PyPI, beside Debian's 1.13: its libtorch is what
# DDP_LIBTORCH=pytorch builds against and its Python is the PyTorch 2.x peer of the comparisons.
# The environment lives outside the clone so that fresh clones and CI reuse it; the stamp file
# (written last) holds the pinned version, so a half-finished install is redone.
# shellcheck source=scripts/pytorch-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/pytorch-env.sh"
if [[ "$(cat "$DDP_PYTORCH_VENV/.ddp-installed" 2>/dev/null)" == "$DDP_PYTORCH_VERSION" ]]; then
  echo "install-deps: PyTorch $DDP_PYTORCH_VERSION present in $DDP_PYTORCH_VENV"
  exit 0
fi
echo "install-deps: installing PyTorch $DDP_PYTORCH_VERSION from PyPI into $DDP_PYTORCH_VENV"
rm -rf "$DDP_PYTORCH_VENV"
mkdir -p "$(dirname "$DDP_PYTORCH_VENV")"
/usr/bin/python3 -m venv "$DDP_PYTORCH_VENV"
"$DDP_PYTORCH_VENV/bin/python" -m pip install -q --no-cache-dir "torch==$DDP_PYTORCH_VERSION" numpy
"$DDP_PYTORCH_VENV/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$DDP_PYTORCH_VERSION', torch.__version__"
echo "$DDP_PYTORCH_VERSION" >"$DDP_PYTORCH_VENV/.ddp-installed"
