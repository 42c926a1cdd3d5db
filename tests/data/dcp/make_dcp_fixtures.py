#!/usr/bin/env python3
"""Writes the distributed checkpoints (torch.distributed.checkpoint, "DCP") that ddp's readers are
tested against, with PyTorch 2.x at world 4 on gloo (tests/data/dcp/README.md):

  sharded_w4/  a DTensor state dict as FSDP2 and tensor parallelism save it:
                 "grid"   float32 [6, 8], Shard(0) x Shard(1) over a 2 x 2 mesh: 4 chunks of [3, 4]
                 "rows"   float64 [10, 3], Shard(0) over the 4 ranks: chunks of 3, 3, 3 and 1 rows
                 "uneven" bfloat16 [5], Shard(0): chunks of 2, 2, 1 and an empty one
                 "replicated" int64 [2, 2], replicated (saved once)
                 "nested": {"scale": float16 [3] replicated}, "step": 7, "name": "dcp fixture",
                 "lrs": [0.5, 0.25]
Every element is its index in the tensor (arange), so a reader can check what it read.

  hostile/<case>.metadata  sharded_w4's metadata, each changed in one way a reader must refuse
                 (see HOSTILE below); the data files are sharded_w4's.

usage: make_dcp_fixtures.py OUT_DIR   (run with PyTorch 2.x's python; scripts/pytorch-python)
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def full_tensors():
    return {
        "grid": torch.arange(48, dtype=torch.float32).reshape(6, 8),
        "rows": torch.arange(30, dtype=torch.float64).reshape(10, 3),
        "uneven": torch.arange(5, dtype=torch.bfloat16),
        "replicated": torch.arange(4, dtype=torch.int64).reshape(2, 2),
        "scale": torch.arange(3, dtype=torch.float16),
    }


def worker(rank, world, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    full = full_tensors()
    mesh2 = init_device_mesh("cpu", (2, 2))
    mesh1 = init_device_mesh("cpu", (world,))
    state = {
        "grid": distribute_tensor(full["grid"], mesh2, [Shard(0), Shard(1)]),
        "rows": distribute_tensor(full["rows"], mesh1, [Shard(0)]),
        "uneven": distribute_tensor(full["uneven"], mesh1, [Shard(0)]),
        "replicated": distribute_tensor(full["replicated"], mesh1, [Replicate()]),
        "nested": {"scale": full["scale"]},
        "step": 7,
        "name": "dcp fixture",
        "lrs": [0.5, 0.25],
    }
    dcp.save(state, checkpoint_id=os.path.join(out, "sharded_w4"))
    dist.destroy_process_group()


def chunk_key(metadata, fqn, index):
    """The storage_data key of the index-th chunk of fqn."""
    offsets = metadata.state_dict_metadata[fqn].chunks[index].offsets
    return next(k for k in metadata.storage_data if k.fqn == fqn and k.offset == offsets)


def move_chunk(metadata, fqn, index, offsets):
    """Moves a chunk (and its storage record's key) to other offsets."""
    key = chunk_key(metadata, fqn, index)
    info = metadata.storage_data.pop(key)
    metadata.state_dict_metadata[fqn].chunks[index].offsets = torch.Size(offsets)
    metadata.storage_data[MetadataIndex(fqn, offsets)] = info


def drop_chunk(metadata, fqn, index):
    del metadata.storage_data[chunk_key(metadata, fqn, index)]
    del metadata.state_dict_metadata[fqn].chunks[index]


def set_path(metadata, fqn, path):
    metadata.storage_data[chunk_key(metadata, fqn, 0)].relative_path = path


def set_transform(metadata):
    metadata.storage_data[chunk_key(metadata, "rows", 0)].transform_descriptors = ["zstd"]


def set_dtype(metadata):
    metadata.state_dict_metadata["grid"].properties.dtype = torch.float64


def set_layout(metadata):
    metadata.state_dict_metadata["grid"].properties.layout = torch.sparse_coo


def grow_chunk(metadata):
    metadata.state_dict_metadata["rows"].chunks[3].sizes = torch.Size([2, 3])


# Each case: what is changed, and the words a reader's error must hold (tests/archive and
# tests/torch/checkpoint check them).
HOSTILE = {
    "overlap": (lambda m: move_chunk(m, "grid", 3, [2, 4]), "overlap"),
    "hole": (lambda m: drop_chunk(m, "rows", 3), "leave part of it unsaved"),
    "outside": (grow_chunk, "outside it"),
    "missing_record": (lambda m: m.storage_data.pop(chunk_key(m, "uneven", 1)),
                       "has no storage record"),
    "stray_record": (lambda m: m.state_dict_metadata["uneven"].chunks.pop(1),
                     "belongs to no chunk"),
    "path_outside": (lambda m: set_path(m, "grid", "../elsewhere.distcp"),
                     "not a plain file name"),
    "transform": (set_transform, "storage transforms"),
    "sparse": (set_layout, "not a strided"),
    "dtype": (set_dtype, "the metadata records Double"),
    "evil_global": (lambda m: setattr(m, "planner_data", {"grid": (os.system,)}), "system"),
    # Valid metadata that the torch layer refuses: a dtype libtorch 1.13 lacks, and an entry
    # whose path in the nested state dict runs through another entry's tensor.
    "float8": (lambda m: setattr(m.state_dict_metadata["grid"].properties, "dtype",
                                 torch.float8_e4m3fn), "float8_e4m3fn"),
    "crossing_paths": (lambda m: m.planner_data.__setitem__("nested.scale", ("grid", "scale")),
                       "crosses another entry"),
}


def write_hostile(out):
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    folder = os.path.join(out, "hostile")
    os.makedirs(folder, exist_ok=True)
    for name, (change, _) in HOSTILE.items():
        metadata = FileSystemReader(os.path.join(out, "sharded_w4")).read_metadata()
        change(metadata)
        with open(os.path.join(folder, f"{name}.metadata"), "wb") as f:
            pickle.dump(metadata, f)
    with open(os.path.join(folder, "not_dcp.metadata"), "wb") as f:
        pickle.dump({"state_dict_metadata": {}}, f)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    port = 29500 + os.getpid() % 1000
    mp.spawn(worker, args=(4, out, port), nprocs=4, join=True)
    write_hostile(out)
    print(f"wrote {out}/sharded_w4 and {out}/hostile with torch {torch.__version__}")


if __name__ == "__main__":
    main()
