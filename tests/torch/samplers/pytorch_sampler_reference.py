"""Prints the indices PyTorch's own DistributedSampler gives, for sampler_pytorch_test.

Usage: pytorch_sampler_reference.py CASE...  with CASE = N,WORLD,SHUFFLE,SEED,EPOCH,DROP_LAST
(SHUFFLE and DROP_LAST are 0 or 1). Prints, for each case and each rank, one line:
    CASE RANK: i0 i1 i2 ...
"""
import sys

import torch
from torch.utils.data.distributed import DistributedSampler


def main():
    for case in sys.argv[1:]:
        n, world, shuffle, seed, epoch, drop_last = (int(v) for v in case.split(","))
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank,
                                         shuffle=bool(shuffle), seed=seed,
                                         drop_last=bool(drop_last))
            sampler.set_epoch(epoch)
            print(f"{case} {rank}: " + " ".join(str(i) for i in sampler))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
