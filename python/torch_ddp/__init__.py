"""ddp's collective engine as a torch.distributed backend.

``import torch_ddp`` registers the backend ``ddp`` for CPU tensors::

    import torch.distributed as dist
    import torch_ddp  # noqa: F401  (registers "ddp")

    dist.init_process_group("ddp")                   # CPU tensors through ddp's engine
    dist.init_process_group("cpu:ddp,cuda:nccl")     # and CUDA tensors through NCCL

Every process of the job imports it before ``init_process_group``; where the package is
pip-installed, PyTorch also loads it by itself on the first ``init_process_group("ddp")`` (an
entry point in the ``torch.distributed.backends`` group). Inside one host the
collectives run through shared memory, between hosts over TCP (docs/pytorch-backend.md).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from . import _C

__all__ = ["BACKEND_NAME", "transport"]

BACKEND_NAME = "ddp"


def _create_backend(dist_backend_opts, backend_options):
    # torch.distributed calls this once per group (init_process_group, new_group) with the
    # group's own prefix store, its ranks and its timeout.
    timeout = dist_backend_opts.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    return _C._create_backend(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout,
        str(dist_backend_opts.group_id),
    )


def transport(group=None) -> str:
    """How the ddp backend of ``group`` (default: the world) moves data: ``"shm"`` (one host,
    shared memory), ``"tcp"``, or ``"hierarchical(...)"``."""
    from torch.distributed.distributed_c10d import _get_default_group

    pg = group if group is not None else _get_default_group()
    return _C._transport(pg._get_backend(torch.device("cpu")))


def _register() -> None:
    """Registers the backend (once). Also the package's ``torch.distributed.backends`` entry
    point: an installed torch_ddp registers itself on the first ``init_process_group("ddp")`` of a
    process that never imported it."""
    if BACKEND_NAME.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"]
        )


_register()
