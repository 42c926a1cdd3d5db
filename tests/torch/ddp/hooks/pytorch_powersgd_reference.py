"""PyTorch's powerSGD_hook on given gradients, for comm_hook_powersgd_test.cc.

Usage: pytorch_powersgd_reference.py DIR WORLD STEPS PORT RANK START BATCH SHAPES
Reads DIR/grad_r{rank}_s{step}.bin (float32, the bucket's flat gradients), runs PyTorch 2.x's
powerSGD_hook with PowerSGDState(matrix_approximation_rank=RANK, start_powerSGD_iter=START,
batch_tensors_with_same_shape=BATCH, defaults otherwise) on a bucket of those gradients (SHAPES:
'16x32,32,8x4x3x3'), one bucket per step on WORLD gloo ranks, and writes the averaged bucket to
DIR/out_r{rank}_s{step}.bin. The bucket is a stand-in object with the four methods the hook calls.
"""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd


class Bucket:
    def __init__(self, buffer, shapes):
        self._buffer = buffer
        self._grads = []
        at = 0
        for shape in shapes:
            n = int(np.prod(shape))
            self._grads.append(buffer[at:at + n].view(shape))
            at += n

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def index(self):
        return 0

    def is_last(self):
        return True


def run(rank, args):
    directory, world, steps, port, mrank, start, batch, shapes = args
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=mrank,
                               start_powerSGD_iter=start, batch_tensors_with_same_shape=batch)
    for step in range(steps):
        data = np.fromfile(os.path.join(directory, f"grad_r{rank}_s{step}.bin"), dtype=np.float32)
        buffer = torch.from_numpy(data.copy())
        out = psgd.powerSGD_hook(state, Bucket(buffer, shapes)).wait()
        out.numpy().astype(np.float32).tofile(os.path.join(directory, f"out_r{rank}_s{step}.bin"))
    # Tearing the gloo group down sometimes aborts PyTorch 2.x ("terminate called without an
    # active exception") once the outputs are written: meet, then leave without the teardown.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def main():
    directory, world, steps, port, mrank, start, batch = sys.argv[1:8]
    shapes = [tuple(int(d) for d in s.split("x")) for s in sys.argv[8].split(",")]
    args = (directory, int(world), int(steps), int(port), int(mrank), int(start), batch == "1",
            shapes)
    mp.spawn(run, args=(args,), nprocs=int(world), join=True)


if __name__ == "__main__":
    main()
