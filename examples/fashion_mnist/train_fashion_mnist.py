#!/usr/bin/python3
"""train-fashion-mnist's twin in PyTorch: the same cnn and mlp, data, order and schedule.

It trains Fashion-MNIST in one process exactly as `train-fashion-mnist` does at world size 1 (the
same architectures under the same parameter names, pixels normalised the same way, PyTorch's
DistributedSampler with the same seed, which ddp's sampler follows index for index, SGD with
momentum and weight decay, the same cosine schedule over the whole run), so that a run can cross
between the two with state dicts (docs/interop.md):

  # Python makes the initial model and trains epoch 1 of 2, and hands its model and optimizer
  # to C++ ...
  train_fashion_mnist.py --epochs 2 --stop-after-epoch 1 \\
      --export-state-dict model.pt --export-optimizer-state optim.pt
  # ... which trains epoch 2 and hands the model back ...
  train-fashion-mnist --epochs 2 --start-epoch 2 --init-from-state-dict model.pt \\
      --init-optimizer-state optim.pt --export-state-dict model2.pt
  # ... for Python to evaluate.
  train_fashion_mnist.py --evaluate model2.pt

Runs under PyTorch 1.13 (Debian's python3-torch) and 2.x. The last line is
`final test_accuracy=<fraction>`, as train-fashion-mnist prints it.
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

PIXEL_MEAN = 0.2860  # of x / 255 over the training set, as train.cc's kPixelMean
PIXEL_STD = 0.3530


class Net(nn.Module):
    """train.cc's NetImpl: one Sequential named `layers`, so the names are `layers.<i>.<name>`."""

    def __init__(self, kind):
        super().__init__()
        if kind == "cnn":
            self.layers = nn.Sequential(
                nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                nn.MaxPool2d(2), nn.Flatten(),
                nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
        elif kind == "mlp":
            self.layers = nn.Sequential(nn.Flatten(), nn.Linear(784, 4096), nn.ReLU(),
                                        nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
        else:
            raise SystemExit(f"--model {kind}: unknown model; use cnn or mlp")

    def forward(self, x):
        return self.layers(x)


def read_idx(path, magic, item_shape):
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SystemExit(f"cannot read {path}: {e} (Debian: apt install dataset-fashion-mnist)")
    dims = len(item_shape) + 1
    header = struct.unpack(f">{dims + 1}I", data[:4 * (dims + 1)])
    if header[0] != magic or tuple(header[2:]) != tuple(item_shape):
        raise SystemExit(f"{path}: not an IDX file of {item_shape} items (header {header})")
    body = torch.frombuffer(bytearray(data[4 * (dims + 1):]), dtype=torch.uint8)
    return body.reshape(header[1], *item_shape)


def load_split(data_dir, prefix, limit):
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"), 2051, (28, 28))
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"), 2049, ())
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = images.to(torch.float32).div_(255.0).sub_(PIXEL_MEAN).div_(PIXEL_STD).unsqueeze(1)
    return x, labels.to(torch.int64)


def evaluate(model, test):
    images, labels = test
    model.eval()
    correct = 0
    with torch.no_grad():
        # Batches of 100, as train-fashion-mnist: larger ones map and fault in their buffers anew.
        for start in range(0, len(labels), 100):
            logits = model(images[start:start + 100])
            correct += int(logits.argmax(1).eq(labels[start:start + 100]).sum())
    model.train()
    return correct / len(labels)


def learning_rate(args, step, total_steps):
    if args.lr_schedule == "constant" or total_steps <= 0:
        return args.lr
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))


def load(path, what):
    # Optimizer state holds numbers that 1.13's weights_only unpickler refuses; both are ours.
    kwargs = {"weights_only": True} if what == "model" or torch.__version__ >= "2" else {}
    return torch.load(path, **kwargs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    p.add_argument("--epochs", type=int, default=4, help="epochs of the whole run")
    p.add_argument("--start-epoch", type=int, default=1, help="first epoch this run trains")
    p.add_argument("--stop-after-epoch", type=int, default=None,
                   help="last epoch this run trains (default: --epochs; 0: none, e.g. to export "
                        "the initial model)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant"])
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--limit-train", type=int, default=0)
    p.add_argument("--limit-test", type=int, default=0, help="evaluate on the first N (0 = all)")
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--init-from-state-dict", help="a model state dict (C++ or Python) to start from")
    p.add_argument("--init-optimizer-state", help="an optimizer state dict to start from")
    p.add_argument("--export-state-dict", help="write the model's state dict here at the end")
    p.add_argument("--export-optimizer-state", help="write the optimizer's state dict here")
    p.add_argument("--evaluate", metavar="STATE_DICT",
                   help="only evaluate this state dict on the test set")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)

    test = load_split(args.data_dir, "t10k", args.limit_test)
    model = Net(args.model)
    if args.evaluate:
        model.load_state_dict(load(args.evaluate, "model"))
        print(f"final test_accuracy={evaluate(model, test):.4f}")
        return
    images, labels = load_split(args.data_dir, "train", args.limit_train)
    if args.init_from_state_dict:
        model.load_state_dict(load(args.init_from_state_dict, "model"))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    if args.init_optimizer_state:
        optimizer.load_state_dict(load(args.init_optimizer_state, "optimizer"))

    sampler = DistributedSampler(range(len(labels)), num_replicas=1, rank=0, shuffle=True,
                                 seed=args.seed)
    batches = (len(sampler) + args.batch_size - 1) // args.batch_size
    total_steps = batches * args.epochs
    last = args.epochs if args.stop_after_epoch is None else args.stop_after_epoch
    step = (args.start_epoch - 1) * batches
    for epoch in range(args.start_epoch, last + 1):
        sampler.set_epoch(epoch - 1)
        order = torch.tensor(list(sampler), dtype=torch.int64)
        loss_sum = 0.0
        for b in range(batches):
            rows = order[b * args.batch_size:(b + 1) * args.batch_size]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, step, total_steps)
            step += 1
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images[rows]), labels[rows])
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
        print(f"epoch {epoch} loss {loss_sum / batches:.4f} "
              f"test_accuracy {evaluate(model, test):.4f}", flush=True)
    if args.export_state_dict:
        torch.save(model.state_dict(), args.export_state_dict)
    if args.export_optimizer_state:
        torch.save(optimizer.state_dict(), args.export_optimizer_state)
    print(f"final test_accuracy={evaluate(model, test):.4f}")


if __name__ == "__main__":
    sys.exit(main())
