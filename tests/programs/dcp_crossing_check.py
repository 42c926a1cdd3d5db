#!/usr/bin/python3
"""A distributed checkpoint PyTorch saves now reads in ddp (issue 53, docs/checkpoints.md).

PYTHON (PyTorch 2.x) saves a sharded checkpoint at world 4 (tests/data/dcp/make_dcp_fixtures.py,
DTensors over a 2 x 2 mesh and 4 ranks, uneven, replicated, nested, non-tensor values), then:
  - `ddp-checkpoint verify` reads every chunk back, and `inspect` lists every entry;
  - `ddp-checkpoint dcp-to-torch` writes one torch.save file, which must equal what PyTorch's
    own format_utils.dcp_to_torch_save writes for the folder (loaded with weights_only=True:
    every key, dtype and element);
  - `ddp-checkpoint torch-to-dcp` writes a folder for a nested torch.save file (model, optimizer
    state with integer keys, param_groups, lists of tensors and values, a tuple, a scalar) that
    PyTorch's dcp.load and dcp_to_torch_save read, and whose metadata (entries, order, dtypes,
    shapes, chunks, planner paths) equals what PyTorch's own torch_save_to_dcp writes;
  - each hostile metadata variant the script writes is refused (exit 1) with its words.

usage: dcp_crossing_check.py BIN_DIR PYTHON
Exit 77 (skipped) where PYTHON's torch has no torch.distributed.checkpoint (PyTorch 1.x).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MAKE = os.path.join(REPO, "tests", "data", "dcp", "make_dcp_fixtures.py")

COMPARE = r"""
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
theirs = torch.load(sys.argv[2], weights_only=True)
ours = torch.load(sys.argv[3], weights_only=True)
def same(a, b, where):
    if type(a) is not type(b):
        sys.exit(f"FAILED: {where}: ddp wrote {type(b).__name__}, PyTorch {type(a).__name__}")
    if isinstance(a, dict):
        if list(a) != list(b):
            sys.exit(f"FAILED: {where}: keys {list(b)} from ddp, {list(a)} from PyTorch")
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        if len(a) != len(b):
            sys.exit(f"FAILED: {where}: {len(b)} items from ddp, {len(a)} from PyTorch")
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            sys.exit(f"FAILED: {where}: ddp {b.dtype} {tuple(b.shape)}, PyTorch {a.dtype} "
                     f"{tuple(a.shape)}, equal={a.shape == b.shape and torch.equal(a, b)}")
    elif a != b:
        sys.exit(f"FAILED: {where}: {b!r} from ddp, {a!r} from PyTorch")
same(theirs, ours, "state")
print(f"equal: {len(theirs)} top-level entries")
"""


NESTED = r"""
import sys, torch
torch.manual_seed(0)
state = {
    "model": {"w": torch.randn(3, 4), "b": torch.arange(3), "h": torch.randn(5).to(torch.bfloat16)},
    "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 4)}},
              "param_groups": [{"lr": 0.1, "params": [0], "name": "x"}]},
    "step": 7, "name": "run", "lrs": [0.1, 0.2], "tup": (1, 2.5), "scalar": torch.tensor(2.5),
    "mixed": [torch.zeros(2, dtype=torch.float64), 5, {"k": torch.ones(1, dtype=torch.int8)}],
}
torch.save(state, sys.argv[1])
"""

TO_DCP = COMPARE.replace("dcp_to_torch_save(sys.argv[1], sys.argv[2])", r"""
import pickle
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
import torch.distributed.checkpoint as dcp
ddp_folder, torch_file, pytorch_folder = sys.argv[1], sys.argv[4], sys.argv[5]
torch_save_to_dcp(torch_file, pytorch_folder)
ours_md = pickle.load(open(ddp_folder + "/.metadata", "rb"))
theirs_md = pickle.load(open(pytorch_folder + "/.metadata", "rb"))
if list(ours_md.state_dict_metadata) != list(theirs_md.state_dict_metadata):
    sys.exit(f"FAILED: entries {list(ours_md.state_dict_metadata)} from ddp, "
             f"{list(theirs_md.state_dict_metadata)} from PyTorch")
if ours_md.planner_data != theirs_md.planner_data:
    sys.exit(f"FAILED: planner_data {ours_md.planner_data} from ddp, {theirs_md.planner_data}")
for name, t in theirs_md.state_dict_metadata.items():
    o = ours_md.state_dict_metadata[name]
    if type(o) is not type(t):
        sys.exit(f"FAILED: {name}: {type(o).__name__} from ddp, {type(t).__name__} from PyTorch")
    if hasattr(t, "size") and (o.size != t.size or o.chunks != t.chunks
                               or o.properties.dtype != t.properties.dtype):
        sys.exit(f"FAILED: {name}: {o} from ddp, {t} from PyTorch")
# dcp.load into a state dict built afresh, as a training script resumes.
fresh = {k: torch.zeros_like(v) for k, v in torch.load(torch_file, weights_only=True)["model"].items()}
dcp.load({"model": fresh}, checkpoint_id=ddp_folder, no_dist=True)
original = torch.load(torch_file, weights_only=True)["model"]
for k in original:
    if not torch.equal(fresh[k], original[k]):
        sys.exit(f"FAILED: dcp.load of model.{k} from ddp's folder differs")
dcp_to_torch_save(sys.argv[1], sys.argv[2])
""")


def run(command, expect=0):
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != expect:
        sys.exit(f"FAILED: {' '.join(command)} exited {done.returncode}, expected {expect}:\n"
                 f"{done.stdout}\n{done.stderr}")
    return done


def main():
    bin_dir, python = sys.argv[1], sys.argv[2]
    probe = subprocess.run([python, "-c", "import torch.distributed.checkpoint.format_utils"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"SKIPPED: {python} has no torch.distributed.checkpoint: "
              f"{probe.stderr.strip()[-300:]}")
        return 77
    tool = os.path.join(bin_dir, "ddp-checkpoint")
    with tempfile.TemporaryDirectory(prefix="dcp_crossing_") as d:
        run([python, MAKE, d])
        folder = os.path.join(d, "sharded_w4")
        if "DIR is required" not in run([tool, "inspect"], expect=2).stderr:
            sys.exit("FAILED: ddp-checkpoint inspect without DIR did not name what is missing")
        verified = run([tool, "verify", folder]).stdout.strip().splitlines()[-1]
        if not verified.startswith("verified: 5 tensors in 14 chunks, 3 values, "):
            sys.exit(f"FAILED: ddp-checkpoint verify printed '{verified}'")
        listing = run([tool, "inspect", folder]).stdout
        for line in ("tensor grid Float [6, 8] chunks=4", "tensor uneven BFloat16 [5] chunks=4",
                     "tensor nested.scale Half [3] chunks=1", "value step "):
            if line not in listing:
                sys.exit(f"FAILED: ddp-checkpoint inspect lists no '{line}':\n{listing}")
        ours = os.path.join(d, "ddp.pt")
        wrote = run([tool, "dcp-to-torch", folder, ours]).stdout.strip().splitlines()[-1]
        if not wrote.startswith(f"wrote {ours}: 8 entries, "):
            sys.exit(f"FAILED: ddp-checkpoint dcp-to-torch printed '{wrote}'")
        print(run([python, "-c", COMPARE, folder, os.path.join(d, "pytorch.pt"), ours])
              .stdout.strip())
        # torch-to-dcp: the folder PyTorch's torch_save_to_dcp writes.
        nested = os.path.join(d, "nested.pt")
        run([python, "-c", NESTED, nested])
        converted = os.path.join(d, "ddp_dcp")
        wrote = run([tool, "torch-to-dcp", nested, converted]).stdout.strip().splitlines()[-1]
        if not wrote.startswith(f"wrote {converted}: 16 entries, "):
            sys.exit(f"FAILED: ddp-checkpoint torch-to-dcp printed '{wrote}'")
        back = os.path.join(d, "ddp_dcp_back.pt")
        run([tool, "dcp-to-torch", converted, back])
        print(run([python, "-c", TO_DCP, converted, os.path.join(d, "pytorch_back.pt"), back,
                   nested, os.path.join(d, "pytorch_dcp")]).stdout.strip())
        if "DIR is required" not in run([tool, "torch-to-dcp", nested], expect=2).stderr:
            sys.exit("FAILED: ddp-checkpoint torch-to-dcp without DIR did not name what is missing")
        error = run([tool, "torch-to-dcp", os.path.join(d, "absent.pt"), converted], expect=1).stderr
        if "absent.pt" not in error:
            sys.exit(f"FAILED: torch-to-dcp of a missing file did not name it: {error}")
        # Hostile metadata, refused before any data is read.
        words = {"overlap": "overlap", "path_outside": "not a plain file name",
                 "evil_global": "posix.system", "not_dcp": "not an object"}
        for case, expected in words.items():
            shutil.copy(os.path.join(d, "hostile", f"{case}.metadata"),
                        os.path.join(folder, ".metadata"))
            error = run([tool, "verify", folder], expect=1).stderr
            if expected not in error:
                sys.exit(f"FAILED: the {case} metadata was refused without '{expected}': {error}")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
