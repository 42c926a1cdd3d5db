"""Every collective of the `ddp` torch.distributed backend at worlds 2 and 3, against the values
it must produce (computed on each rank from what every rank sent), in real processes."""

from __future__ import annotations

import datetime
import sys
import unittest

import torch
import torch.distributed as dist

from world_harness import run_world


def value(rank, n, dtype=torch.float32, offset=0):
    # Distinct per rank and position, exact in every dtype used here.
    return (torch.arange(n, dtype=torch.int64) + 10 * rank + offset).to(dtype)


def check_equal(name, got, want):
    if not torch.equal(got, want):
        raise AssertionError(f"{name}: got {got.tolist()}, want {want.tolist()}")


def collectives(rank, world):
    ranks = range(world)
    import torch_ddp

    assert torch_ddp.transport() == "shm", torch_ddp.transport()

    # allreduce: every op, several dtypes, sync and async, non-contiguous, complex, bool
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
                  torch.int8, torch.float16, torch.bfloat16):
        for op, combine in ((dist.ReduceOp.SUM, lambda a, b: a + b),
                            (dist.ReduceOp.MAX, torch.maximum),
                            (dist.ReduceOp.MIN, torch.minimum),
                            (dist.ReduceOp.PRODUCT, lambda a, b: a * b)):
            if dtype in (torch.uint8, torch.int8) and op == dist.ReduceOp.PRODUCT:
                continue
            t = value(rank, 5, dtype) % 7 if dtype in (torch.uint8, torch.int8) else value(rank, 5, dtype)
            if op == dist.ReduceOp.PRODUCT:
                t = (torch.arange(5) % 3 + rank + 1).to(dtype)
            want = None
            for r in ranks:
                v = value(r, 5, dtype) % 7 if dtype in (torch.uint8, torch.int8) else value(r, 5, dtype)
                if op == dist.ReduceOp.PRODUCT:
                    v = (torch.arange(5) % 3 + r + 1).to(dtype)
                want = v if want is None else combine(want, v)
            dist.all_reduce(t, op=op)
            check_equal(f"all_reduce {dtype} {op}", t, want)
    # bitwise: integer and bool tensors, as gloo (the values have every bit pattern of a byte)
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool):
        for op, combine in ((dist.ReduceOp.BAND, torch.bitwise_and),
                            (dist.ReduceOp.BOR, torch.bitwise_or),
                            (dist.ReduceOp.BXOR, torch.bitwise_xor)):
            def mine(r):
                bits = (torch.arange(16) * 37 + r * 101) % 256
                return bits.to(torch.uint8).to(dtype) if dtype != torch.bool else bits % 3 == 0
            t = mine(rank)
            want = mine(0)
            for r in range(1, world):
                want = combine(want, mine(r))
            dist.all_reduce(t, op=op)
            check_equal(f"all_reduce {dtype} {op}", t, want)
    t = value(rank, 6).view(2, 3).t()  # non-contiguous
    dist.all_reduce(t)
    check_equal("all_reduce non-contiguous", t, sum(value(r, 6) for r in ranks).view(2, 3).t())
    t = value(rank, 8)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    work.wait()
    check_equal("all_reduce async", fut.wait()[0], sum(value(r, 8) for r in ranks))
    t = torch.complex(value(rank, 3), value(rank, 3, offset=1))
    dist.all_reduce(t)
    check_equal("all_reduce complex", t,
                sum(torch.complex(value(r, 3), value(r, 3, offset=1)) for r in ranks))
    t = torch.tensor([rank == 0, True, False])
    dist.all_reduce(t)  # SUM of bools is or
    check_equal("all_reduce bool", t, torch.tensor([True, True, False]))
    t = value(rank, 4, torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    check_equal("all_reduce avg", t, sum(value(r, 4, torch.float64) for r in ranks) / world)
    big = torch.full((1 << 20,), float(rank + 1))  # several shared-memory chunks
    dist.all_reduce(big)
    check_equal("all_reduce 4 MiB", big, torch.full((1 << 20,), float(sum(r + 1 for r in ranks))))

    # sparse allreduce (SUM): ranks hold different nonzeros, some shared
    sp = torch.sparse_coo_tensor([[rank, 4]], [float(rank + 1), 1.0], (6,))
    dist.all_reduce(sp)
    want = torch.zeros(6)
    for r in ranks:
        want[r] += r + 1
        want[4] += 1.0
    check_equal("sparse all_reduce", sp.to_dense(), want)

    # allreduce_coalesced
    ts = [value(rank, 3), value(rank, 2).view(1, 2)]
    dist.all_reduce_coalesced(ts)
    check_equal("all_reduce_coalesced 0", ts[0], sum(value(r, 3) for r in ranks))
    check_equal("all_reduce_coalesced 1", ts[1], sum(value(r, 2) for r in ranks).view(1, 2))

    # broadcast from every root, several dtypes
    for root in ranks:
        for dtype in (torch.float32, torch.int16, torch.bool, torch.complex64):
            t = value(rank, 5).to(dtype)
            dist.broadcast(t, src=root)
            check_equal(f"broadcast {dtype} from {root}", t, value(root, 5).to(dtype))

    # reduce to every root
    for root in ranks:
        t = value(rank, 4)
        dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
        if rank == root:
            check_equal(f"reduce to {root}", t, sum(value(r, 4) for r in ranks))

    # all_gather (list; equal and uneven sizes), into a tensor, coalesced
    out = [torch.zeros(3) for _ in ranks]
    dist.all_gather(out, value(rank, 3))
    for r in ranks:
        check_equal(f"all_gather block {r}", out[r], value(r, 3))
    out = [torch.zeros(r + 1) for r in ranks]
    dist.all_gather(out, value(rank, rank + 1))
    for r in ranks:
        check_equal(f"all_gather uneven block {r}", out[r], value(r, r + 1))
    flat = torch.zeros(world * 4, dtype=torch.int64)
    dist.all_gather_into_tensor(flat, value(rank, 4, torch.int64))
    check_equal("all_gather_into_tensor", flat, torch.cat([value(r, 4, torch.int64) for r in ranks]))
    outs = [torch.zeros(world * 2), torch.zeros(world * 3, dtype=torch.int32)]
    with dist._coalescing_manager(async_ops=False):
        dist.all_gather_into_tensor(outs[0], value(rank, 2))
        dist.all_gather_into_tensor(outs[1], value(rank, 3, torch.int32))
    check_equal("coalesced all_gather_into_tensor 0", outs[0], torch.cat([value(r, 2) for r in ranks]))
    check_equal("coalesced all_gather_into_tensor 1", outs[1],
                torch.cat([value(r, 3, torch.int32) for r in ranks]))
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in ranks], objs

    # gather and scatter to/from every root
    for root in ranks:
        out = [torch.zeros(3) for _ in ranks] if rank == root else None
        dist.gather(value(rank, 3), gather_list=out, dst=root)
        if rank == root:
            for r in ranks:
                check_equal(f"gather at {root} block {r}", out[r], value(r, 3))
        t = torch.zeros(2)
        dist.scatter(t, scatter_list=[value(r, 2, offset=100) for r in ranks] if rank == root else None,
                     src=root)
        check_equal(f"scatter from {root}", t, value(rank, 2, offset=100))

    # reduce_scatter (list, tensor), uneven blocks
    out = torch.zeros(2)
    dist.reduce_scatter(out, [value(rank, 2, offset=5 * j) for j in ranks])
    check_equal("reduce_scatter", out, sum(value(r, 2, offset=5 * rank) for r in ranks))
    out = torch.zeros(rank + 1)
    dist.reduce_scatter(out, [value(rank, j + 1) for j in ranks])
    check_equal("reduce_scatter uneven", out, sum(value(r, rank + 1) for r in ranks))
    out = torch.zeros(3)
    dist.reduce_scatter_tensor(out, torch.cat([value(rank, 3, offset=j) for j in ranks]),
                               op=dist.ReduceOp.MAX)
    check_equal("reduce_scatter_tensor max", out, value(world - 1, 3, offset=rank))
    # coalesced: one dtype (one engine call), and two dtypes (one call each)
    for second in (torch.float32, torch.int64):
        outs = [torch.zeros(2), torch.zeros(3, dtype=second)]
        with dist._coalescing_manager(async_ops=False):
            dist.reduce_scatter_tensor(outs[0], torch.cat([value(rank, 2, offset=j) for j in ranks]))
            dist.reduce_scatter_tensor(outs[1], torch.cat([value(rank, 3, second, offset=j)
                                                           for j in ranks]))
        check_equal(f"coalesced reduce_scatter_tensor 0 ({second})", outs[0],
                    sum(value(r, 2, offset=rank) for r in ranks))
        check_equal(f"coalesced reduce_scatter_tensor 1 ({second})", outs[1],
                    sum(value(r, 3, second, offset=rank) for r in ranks))

    # PREMUL_SUM (NCCL's, any backend here): each rank's input times its own factor, summed; the
    # factor a float or a one-element tensor; inputs of reduce and reduce_scatter left as they were
    def factor(r):
        return 0.5 + r
    op = (dist._make_nccl_premul_sum(factor(rank)) if rank % 2 == 0
          else dist._make_nccl_premul_sum(torch.tensor([factor(rank)], dtype=torch.float64)))
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = value(rank, 5, dtype)
        dist.all_reduce(t, op=op)
        check_equal(f"all_reduce PREMUL_SUM {dtype}", t,
                    sum(value(r, 5, dtype) * factor(r) for r in ranks))
    t = value(rank, 3, torch.float64)
    dist.reduce(t, dst=world - 1, op=op)
    check_equal("reduce PREMUL_SUM", t, sum(value(r, 3, torch.float64) * factor(r) for r in ranks)
                if rank == world - 1 else value(rank, 3, torch.float64))
    inp = torch.cat([value(rank, 2, torch.float64, offset=j) for j in ranks])
    out = torch.zeros(2, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, inp, op=op)
    check_equal("reduce_scatter_tensor PREMUL_SUM", out,
                sum(value(r, 2, torch.float64, offset=rank) * factor(r) for r in ranks))
    check_equal("reduce_scatter_tensor PREMUL_SUM input", inp,
                torch.cat([value(rank, 2, torch.float64, offset=j) for j in ranks]))
    out = torch.zeros(2, dtype=torch.float64)
    dist.reduce_scatter(out, [value(rank, 2, torch.float64, offset=j) for j in ranks], op=op)
    check_equal("reduce_scatter PREMUL_SUM", out,
                sum(value(r, 2, torch.float64, offset=rank) * factor(r) for r in ranks))

    # all_to_all_single (even and uneven splits), all_to_all (list)
    inp = torch.cat([value(rank, 2, offset=j) for j in ranks])
    out = torch.zeros(world * 2)
    dist.all_to_all_single(out, inp)
    check_equal("all_to_all_single", out, torch.cat([value(j, 2, offset=rank) for j in ranks]))
    # rank r sends j+1 rows of 2 to rank j
    inp = torch.cat([value(rank, (j + 1) * 2, offset=j).view(j + 1, 2) for j in ranks])
    out = torch.zeros(world * (rank + 1), 2)
    dist.all_to_all_single(out, inp, output_split_sizes=[rank + 1] * world,
                           input_split_sizes=[j + 1 for j in ranks])
    check_equal("all_to_all_single uneven", out,
                torch.cat([value(j, (rank + 1) * 2, offset=rank).view(rank + 1, 2) for j in ranks]))
    outs = [torch.zeros(j + 1, dtype=torch.int64) for j in ranks]
    dist.all_to_all(outs, [value(rank, rank + 1, torch.int64, offset=j) for j in ranks])
    for j in ranks:
        check_equal(f"all_to_all block {j}", outs[j], value(j, j + 1, torch.int64, offset=rank))

    # send/recv in a ring, tags, isend/irecv batches
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(4)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, value(rank, 4), nxt, tag=7),
                                   dist.P2POp(dist.irecv, got, prv, tag=7)])
    for r in reqs:
        r.wait()
    check_equal("batch_isend_irecv", got, value(prv, 4))
    if rank == 0:
        dist.send(value(0, 3, offset=1), dst=1, tag=2)
        dist.send(value(0, 3, offset=2), dst=1, tag=1)
    elif rank == 1:
        a, b = torch.zeros(3), torch.zeros(3)
        ra = dist.irecv(a, src=0, tag=1)
        rb = dist.irecv(b, src=0, tag=2)
        ra.wait(), rb.wait()
        check_equal("recv tag 1", a, value(0, 3, offset=2))
        check_equal("recv tag 2", b, value(0, 3, offset=1))

    # recv from any source: rank 0 hears from every other rank once, and each call names its sender
    if rank == 0:
        senders = set()
        for _ in range(world - 1):
            t = torch.zeros(5)
            sender = dist.recv(t, tag=4)
            check_equal(f"recv from any source (rank {sender})", t, value(sender, 5))
            senders.add(sender)
        work = dist.irecv(torch.zeros(5), tag=4)
        dist.barrier()  # the ranks send again after it
        work.wait()
        senders_async = work._source_rank()
        assert senders == set(range(1, world)), senders
        assert 1 <= senders_async < world, senders_async
        for _ in range(world - 2):
            dist.recv(torch.zeros(5), tag=4)
    else:
        dist.send(value(rank, 5), dst=0, tag=4)
        dist.barrier()
        dist.send(value(rank, 5), dst=0, tag=4)

    # barriers, subgroups
    dist.barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    evens = dist.new_group([r for r in ranks if r % 2 == 0])
    if rank % 2 == 0:
        t = torch.ones(2)
        dist.all_reduce(t, group=evens)
        check_equal("subgroup all_reduce", t, torch.full((2,), float(len(range(0, world, 2)))))
    sub, _ = dist.new_subgroups(group_size=1)
    t = value(rank, 2)
    dist.all_reduce(t, group=sub)
    check_equal("new_subgroups of one", t, value(rank, 2))
    return "ok"


class Collectives(unittest.TestCase):
    def test_world_2(self):
        self.assertEqual(run_world(collectives, 2, timeout=240), ["ok"] * 2)

    def test_world_3(self):
        self.assertEqual(run_world(collectives, 3, timeout=240), ["ok"] * 3)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[1:])
