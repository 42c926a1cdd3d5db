#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the 4-process demo through ddprun.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build
exec build/bin/ddprun --standalone --nproc-per-node 4 build/bin/ddp-demo "$@"
