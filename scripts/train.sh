#!/usr/bin/env bash
# The main job: installs what is missing, builds the launcher and the trainer, and trains the
# Fashion-MNIST cnn on 2 processes through ddprun (one thread each). Extra arguments go to
# train-fashion-mnist, e.g. `scripts/train.sh --model mlp --epochs 1`.
# DDP_LIBTORCH=debian (default, build/) or pytorch (PyTorch 2.x from PyPI, build-pytorch/) picks
# the libtorch.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch-choice.sh

echo "train.sh: libtorch: $ddp_libtorch_line (DDP_LIBTORCH=$ddp_libtorch, $ddp_build_dir/)"
bash scripts/install-deps.sh
cmake -S . -B "$ddp_build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${ddp_cmake_libtorch[@]}"
cmake --build "$ddp_build_dir" --target ddprun train-fashion-mnist
exec "$ddp_build_dir/bin/ddprun" --standalone --nproc-per-node 2 \
  "$ddp_build_dir/bin/train-fashion-mnist" "$@"
