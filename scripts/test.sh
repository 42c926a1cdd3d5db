#!/usr/bin/env bash
# Installs what is missing, builds everything and runs every test (CTest labels: unit,
# multiprocess, netns, slow). Extra arguments go to ctest, e.g. `scripts/test.sh -L unit`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build
ctest --test-dir build --output-on-failure --timeout 600 -j "$(nproc)" "$@"
