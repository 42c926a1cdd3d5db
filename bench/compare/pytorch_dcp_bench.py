"""PyTorch's distributed checkpoint on the model bench/compare/dcp_bench.cc saves: the same
shapes (8 layers, each parameter and its two Adam moments), DTensors sharded by rows (Shard(0))
over a 1-D mesh of --world gloo ranks, and a step value. The peer of dcp-bench in
bench/compare/compare_dcp.py; the same phases, measured the same way, the same last line:

  pytorch_dcp_bench.py --phase save --world 4 --dir D --params N [--rounds R]
    dcp.save (sync) R times, dcp.async_save R times after an unmeasured one (the stall: until it
    returns; the total: to its future's result), and the copy bound (a clone of the rank's
    tensors)
  pytorch_dcp_bench.py --phase replicas --world 4 --dir D --params N [--rounds R]
    dcp.save (sync) R times of a replicated model (DDP's: every rank holds every tensor whole,
    N / world parameters with their moments, the bytes a rank holds in the sharded save)
  pytorch_dcp_bench.py --phase load --world 3 --dir D --params N [--rounds R]
    dcp.load of every tensor into DTensors sharded over this world (resharding when it differs
    from the save's), the peak memory it adds beyond its destination tensors (VmHWM)

Times are the slowest rank's per round, medians over the rounds.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

KINDS = ("weight", "exp_avg", "exp_avg_sq")


def shapes_for(params):
    layers = 8
    per_layer = max(params // layers, 1)
    width = max(1, min(1024, per_layer))
    rows = max(1, per_layer // width)
    return [(rows, width)] * layers


def name_of(layer, kind):
    if kind == 0:
        return f"model.layers.{layer}.weight"
    return f"optim.state.layers.{layer}.{KINDS[kind]}"


def status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def max_over_ranks(value, op=dist.ReduceOp.MAX):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def timed(f):
    start = time.perf_counter()
    result = f()
    return (time.perf_counter() - start) * 1000.0, result


def run(rank, args, store_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=args.world)
    mesh = init_device_mesh("cpu", (args.world,))
    shapes = shapes_for(args.params)

    def state_dict(fill):
        # Each rank makes only its rows (torch.chunk's split, as Shard(0) places them).
        state = {}
        for layer, (rows, width) in enumerate(shapes):
            per = (rows + args.world - 1) // args.world
            start = min(rows, per * rank)
            count = min(rows, start + per) - start
            for kind in range(3):
                value = float(layer * 3 + kind) if fill else 0.0
                local = torch.full((count, width), value)
                state[name_of(layer, kind)] = DTensor.from_local(
                    local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, width)),
                    stride=(width, 1))
        state["step"] = 1000
        return state

    if args.phase == "replicas":
        state = {name_of(layer, kind): torch.full(shape, float(layer * 3 + kind))
                 for layer, shape in enumerate(shapes_for(args.params // args.world))
                 for kind in range(3)}
        state["step"] = 1000
        sync = []
        for _ in range(args.rounds):
            dist.barrier()
            ms, _ = timed(lambda: dcp.save(state, checkpoint_id=args.dir))
            sync.append(max_over_ranks(ms))
        all_bytes = sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
        if rank == 0:
            print(f"pytorch-dcp-bench phase=replicas world={args.world} bytes={all_bytes:.0f} "
                  f"save_ms={statistics.median(sync):.1f}", flush=True)
    elif args.phase == "save":
        state = state_dict(fill=True)
        local_bytes = sum(v.to_local().nbytes for v in state.values() if hasattr(v, "to_local"))
        sync, stall, total, copy = [], [], [], []
        for _ in range(args.rounds):
            dist.barrier()
            ms, _ = timed(lambda: dcp.save(state, checkpoint_id=args.dir))
            sync.append(max_over_ranks(ms))
        # One unmeasured asynchronous save first, as dcp-bench does (a training loop's saves
        # after its first).
        dcp.async_save(state, checkpoint_id=args.dir).result()
        for _ in range(args.rounds):
            dist.barrier()
            start = time.perf_counter()
            stalled, future = timed(lambda: dcp.async_save(state, checkpoint_id=args.dir))
            future.result()
            whole = (time.perf_counter() - start) * 1000.0
            stall.append(max_over_ranks(stalled))
            total.append(max_over_ranks(whole))
        # The copy bound, into buffers already touched (as dcp-bench measures it).
        locals_ = [v.to_local() for v in state.values() if hasattr(v, "to_local")]
        buffers = [t.clone() for t in locals_]
        for _ in range(args.rounds):
            dist.barrier()
            ms, _ = timed(lambda: [b.copy_(t) for b, t in zip(buffers, locals_)])
            copy.append(max_over_ranks(ms))
        del buffers
        all_bytes = max_over_ranks(float(local_bytes), dist.ReduceOp.SUM)
        if rank == 0:
            print(f"pytorch-dcp-bench phase=save world={args.world} bytes={all_bytes:.0f} "
                  f"save_ms={statistics.median(sync):.1f} "
                  f"async_stall_ms={statistics.median(stall):.1f} "
                  f"async_total_ms={statistics.median(total):.1f} "
                  f"copy_ms={statistics.median(copy):.1f}", flush=True)
    else:
        load, peak_added = [], []
        local_bytes = 0
        for _ in range(args.rounds):
            state = state_dict(fill=False)
            dist.barrier()
            before = status_mib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            ms, _ = timed(lambda: dcp.load(state, checkpoint_id=args.dir))
            local_bytes = sum(v.to_local().nbytes for v in state.values()
                              if hasattr(v, "to_local"))
            # Its destination tensors existed before the load: what it adds is the peak over them.
            peak_added.append(max_over_ranks(status_mib("VmHWM") - before))
            load.append(max_over_ranks(ms))
            for layer in range(len(shapes)):
                for kind in range(3):
                    local = state[name_of(layer, kind)].to_local()
                    if local.numel() and not bool((local == layer * 3 + kind).all()):
                        sys.exit(f"pytorch-dcp-bench: {name_of(layer, kind)} read back wrong")
        all_bytes = max_over_ranks(float(local_bytes), dist.ReduceOp.SUM)
        if rank == 0:
            print(f"pytorch-dcp-bench phase=load world={args.world} bytes={all_bytes:.0f} "
                  f"load_ms={statistics.median(load):.1f} "
                  f"peak_added_mb={statistics.median(peak_added):.1f}", flush=True)
    dist.barrier()
    # Leave without gloo's teardown: PyTorch 2.15's gloo now and then aborts a rank in or after
    # destroy_process_group ("terminate called without an active exception", SIGABRT), under
    # load, after every result was checked and printed; seen in CI's runs of this script's
    # caller. Every collective is done (the barrier above); stdout is flushed first.
    sys.stdout.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("save", "replicas", "load"), required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--params", type=int, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pytorch-dcp-bench-") as store_dir:
        mp.spawn(run, args=(args, store_dir), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
