"""A stand-in third-party torch.distributed backend for scripts/pytorch_dist_suite.py.

`import pytorch_suite_fakegloo` registers the backend "fakegloo", registered exactly as a
third-party package such as torch_ddp registers itself
(`torch.distributed.Backend.register_backend(name, creator, extended_api=True,
devices=["cpu"])`), whose engine is PyTorch's own gloo. Running PyTorch's distributed suite
on "fakegloo" and on "gloo" therefore differs only through the backend's name and its
registration: every difference between the two runs is one that a third-party backend
meets whatever its engine does (docs/pytorch-backend.md lists them).
"""

import torch.distributed as dist

NAME = "fakegloo"


def _create(dist_backend_opts, backend_options):
    # extended_api=True: PyTorch passes c10d's _DistributedBackendOptions (store, group_rank,
    # group_size, timeout, group_id, global_ranks_in_group) and the ProcessGroup options.
    # The store is the prefix store of this group (the default group or a new_group).
    return dist.ProcessGroupGloo(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
    )


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
