#!/usr/bin/env bash
# `pip install ./python` as the README says, into a throwaway folder (the environment itself is
# left as it was), reusing the build folder the test runs in (TORCH_DDP_BUILD_DIR); then a world
# of two processes imports the installed package from another folder and runs an allreduce.
#   pip_install_test.sh PYTHON SOURCE_DIR BUILD_DIR
set -euo pipefail
python=$1 source_dir=$2 build_dir=$3
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
TORCH_DDP_BUILD_DIR=$build_dir "$python" -m pip install --quiet --no-deps --no-build-isolation \
  --target "$target/site" "$source_dir/python"
ls "$target/site/torch_ddp"
test -f "$target/site/torch_ddp/libddp_comm.so.0" || { echo "libddp_comm.so.0 not installed" >&2; exit 1; }
cd "$target"
cat > world.py <<'PY'
import datetime, os, sys
import torch, torch.distributed as dist
import torch_ddp
assert torch_ddp.__file__.startswith(os.environ["TARGET_SITE"]), torch_ddp.__file__
rank = int(sys.argv[1])
dist.init_process_group("ddp", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((3,), 3.0)), t
dist.destroy_process_group()
print(f"rank {rank}: allreduce through the installed torch_ddp: {t.tolist()}")
PY
export PYTHONPATH=$target/site TARGET_SITE=$target/site
timeout 120 "$python" world.py 0 "$target/store" &
pid=$!
timeout 120 "$python" world.py 1 "$target/store"
wait "$pid"
# The entry point: a program that never imports torch_ddp still gets the backend.
cat > entry.py <<'PY'
import datetime, sys
import torch, torch.distributed as dist
dist.init_process_group("ddp", init_method=f"file://{sys.argv[2]}", rank=int(sys.argv[1]),
                        world_size=2, timeout=datetime.timedelta(seconds=60))
t = torch.ones(2)
dist.all_reduce(t)
assert torch.equal(t, torch.full((2,), 2.0)), t
assert "torch_ddp" in sys.modules, "the backend did not come from torch_ddp"
print(f"rank {sys.argv[1]}: registered through the entry point")
PY
timeout 120 "$python" entry.py 0 "$target/store2" &
pid=$!
timeout 120 "$python" entry.py 1 "$target/store2"
wait "$pid"
