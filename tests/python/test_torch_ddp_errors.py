"""What the `ddp` torch.distributed backend does with input it cannot take and with failures:
a Python exception that names the problem (RuntimeError, or DistBackendError for a failure of
the group), raised before anything is sent, never a crash or a hang. Real processes."""

from __future__ import annotations

import datetime
import os
import sys
import time
import unittest

import torch
import torch.distributed as dist

from world_harness import run_world


def expect_error(kind, fragment, call):
    try:
        call()
    except kind as e:
        if fragment not in str(e):
            raise AssertionError(f"error {type(e).__name__} lacks {fragment!r}: {e}") from e
        return str(e)
    raise AssertionError(f"no {kind.__name__} naming {fragment!r}")


def refused_inputs(rank, world):
    sparse = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))
    expect_error(RuntimeError, "SUM only", lambda: dist.all_reduce(sparse, op=dist.ReduceOp.MAX))
    expect_error(RuntimeError, "torch.int16", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)))
    expect_error(RuntimeError, "bitwise", lambda: dist.all_reduce(torch.ones(3),
                                                                op=dist.ReduceOp.BXOR))
    expect_error(RuntimeError, "PREMUL_SUM takes floating-point", lambda: dist.all_reduce(
        torch.ones(3, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0)))
    expect_error(RuntimeError, "(this rank's) has 3 elements", lambda: dist.all_gather(
        [torch.zeros(3) for _ in range(world)], torch.zeros(2)))
    expect_error(RuntimeError, "_split_sizes", lambda: dist.all_to_all_single(
        torch.zeros(4), torch.zeros(4), input_split_sizes=[1] * (world + 1)))
    # Nothing was sent by the refused calls: the group still works, on every rank alike.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(world))), t
    return "ok"


def collective_timeout(rank, world):
    # Rank 1 skips an allreduce: rank 0's must fail within its deadline (the group's timeout,
    # 3 s here), as a DistBackendError naming the call, not hang.
    if rank == 0:
        start = time.monotonic()
        message = expect_error(dist.DistBackendError, "allreduce", lambda: dist.all_reduce(torch.ones(4)))
        elapsed = time.monotonic() - start
        assert elapsed < 30, f"the allreduce failed after {elapsed:.1f} s, past its 3 s deadline"
        return message
    time.sleep(6)
    return "skipped"


def monitored_barrier_names_the_missing_rank(rank, world):
    if rank == 0:
        return expect_error(RuntimeError, "Rank 1 failed to pass monitoredBarrier",
                            lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=2)))
    time.sleep(4)
    return "absent"


class Errors(unittest.TestCase):
    def test_refused_inputs_world_2(self):
        run_world(refused_inputs, 2)

    def test_collective_timeout(self):
        messages = run_world(collective_timeout, 2, pg_timeout=3.0, timeout=90)
        self.assertIn("allreduce", messages[0])

    def test_monitored_barrier_names_the_missing_rank(self):
        run_world(monitored_barrier_names_the_missing_rank, 2, timeout=90)


def _only_rank_0_imports(rank, init_file):
    import torch.distributed as dist

    if rank == 0:
        import torch_ddp  # noqa: F401
    try:
        dist.init_process_group("ddp", init_method=f"file://{init_file}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=5))
    except Exception as e:  # noqa: BLE001  (reported to the parent)
        sys.exit(f"rank {rank}: {type(e).__name__}: {e}")
    import torch

    t = torch.ones(1)
    dist.all_reduce(t)
    if t.item() != 2.0:
        sys.exit(f"rank {rank}: all_reduce gave {t.item()}")
    dist.destroy_process_group()
    sys.exit(0)


class NotImportedEverywhere(unittest.TestCase):
    def test_a_rank_without_torch_ddp(self):
        """Where torch_ddp is pip-installed, its entry point registers the backend in a rank that
        never imported it, and both ranks work; where it is not (only on PYTHONPATH), that rank
        fails with PyTorch's own error and the other at its deadline. Either way, no hang."""
        import multiprocessing
        import tempfile
        from importlib.metadata import entry_points

        installed = any(e.name == "ddp" for e in entry_points(group="torch.distributed.backends"))
        ctx = multiprocessing.get_context("spawn")
        with tempfile.TemporaryDirectory() as folder:
            init_file = os.path.join(folder, "store")
            os.environ["DDP_DUMP_DIR"] = folder
            procs = [ctx.Process(target=_only_rank_0_imports, args=(r, init_file)) for r in (0, 1)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=120)
                self.assertFalse(p.is_alive(), "a rank hung")
        if installed:
            self.assertEqual([p.exitcode for p in procs], [0, 0])
        else:
            self.assertNotEqual(procs[1].exitcode, 0)
            self.assertNotEqual(procs[0].exitcode, 0)


if __name__ == "__main__":
    unittest.main()
