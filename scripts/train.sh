#!/usr/bin/env bash
# The main job: installs what is missing, builds the launcher and the trainer, and trains the
# Fashion-MNIST cnn on 2 processes through ddprun (one thread each). Extra arguments go to
# train-fashion-mnist, e.g. `scripts/train.sh --model mlp --epochs 1`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build --target ddprun train-fashion-mnist
exec build/bin/ddprun --standalone --nproc-per-node 2 build/bin/train-fashion-mnist "$@"
