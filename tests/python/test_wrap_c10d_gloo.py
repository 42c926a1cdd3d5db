"""ddp::wrap_c10d over PyTorch's own c10d gloo (issue 26): torch.distributed builds the gloo group
in Python (PyPI's libtorch has no gloo headers, so C++ cannot), and the test extension
ddp_c10d_wrap_check hands the C++ object to ddp. Over the wrapped group, as a c10d ProcessGroup
and as its CPU Backend: every ddp collective gives the values worked out by hand, and ddp's
DistributedDataParallel, ZeroRedundancyOptimizer, SyncBatchNorm and Join train to the same
parameters as over ddp's own ring group, to 1e-6. Real processes, world 2 (the checks'
c10d_process_group_test.cc runs the same over a gloo group built in C++ with Debian's libtorch)."""

from __future__ import annotations

import socket
import unittest

import torch
import torch.distributed as dist

from world_harness import run_world

TRAININGS = ("ddp", "zero", "sync_batch_norm", "join")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_rank(rank, world, ring_port):
    import ddp_c10d_wrap_check as ext

    torch.set_num_threads(1)
    group = dist.group.WORLD
    assert dist.get_backend(group) == "gloo", dist.get_backend(group)
    over_group = ext.wrap_group(group)
    over_backend = ext.wrap_backend(group._get_backend(torch.device("cpu")))
    assert (over_group.rank(), over_group.size()) == (rank, world)
    ext.check_every_operation(over_group)
    ext.check_every_operation(over_backend)
    ring = ext.ring_group(rank, world, ring_port)
    differences, moved = {}, {}
    for training in TRAININGS:
        over_gloo = ext.train(over_group, training)
        over_ring = ext.train(ring, training)
        assert len(over_gloo) == len(over_ring), (training, len(over_gloo), len(over_ring))
        differences[training] = max((a.double() - b.double()).abs().max().item()
                                    for a, b in zip(over_gloo, over_ring))
        initial = ext.initial_parameters(training == "sync_batch_norm")
        moved[training] = max((a - b).abs().max().item() for a, b in zip(over_gloo, initial))
    return differences, moved


class WrapC10dOverPyTorchsGloo(unittest.TestCase):
    def test_every_operation_and_training_equal_the_ring_group(self):
        results = run_world(check_rank, 2, backend="gloo", args=(free_port(),), timeout=300)
        for rank, (differences, moved) in enumerate(results):
            for training in TRAININGS:
                self.assertLessEqual(differences[training], 1e-6,
                                     f"rank {rank}, {training}: over gloo and over the ring "
                                     f"differ by {differences[training]}")
                # The comparison is of trained models, not of two untouched ones.
                self.assertGreater(moved[training], 1e-3, f"rank {rank}, {training}")


if __name__ == "__main__":
    unittest.main()
