"""Exports a small model as a TorchScript archive, for the C++ tests and benchmarks of TorchScript
modules under ddp's DistributedDataParallel (issue 27).

    python3 export_torchscript_model.py --model cnn_bn --how script --out model.pt

--model cnn_bn: a cnn with a BatchNorm (a buffer that DDP broadcasts) on [batch, 1, 12, 12]
inputs, 4 classes (the tests). --model bench_cnn: ddp-train-bench's cnn
(bench/compare/ddp_train_bench.cc, make_model("cnn")) on [batch, 1, 28, 28] inputs, 10 classes, the
same layers in the same order, so its parameter and buffer names are the nn::Sequential's
("0.weight", "1.running_mean", ...).
--how script (torch.jit.script) or trace (torch.jit.trace on a random batch). The archive is
saved in training mode. Prints the torch version on stdout.
"""

import argparse

import torch
from torch import nn


class CnnWithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn(self.conv1(x))), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def bench_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Linear(128, 10))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["cnn_bn", "bench_cnn"], required=True)
    parser.add_argument("--how", choices=["script", "trace"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dict-out", help="also torch.save the model's state_dict() here")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if args.model == "cnn_bn":
        model, side = CnnWithBatchNorm(), 12
    else:
        model, side = bench_cnn(), 28
    model.train()
    if args.how == "script":
        exported = torch.jit.script(model)
    else:
        # Tracing runs the model once: in training mode that updates the BatchNorm's running
        # statistics, which the C++ side does not care about (DDP broadcasts rank 0's), but the
        # archive's values then depend on this batch. check_trace=False: a traced BatchNorm in
        # training mode is deterministic, yet the check would compare two runs that each moved
        # the running statistics.
        example = torch.randn(2, 1, side, side)
        exported = torch.jit.trace(model, example, check_trace=False)
    exported.save(args.out)
    if args.state_dict_out:
        torch.save(model.state_dict(), args.state_dict_out)
    print(torch.__version__)


if __name__ == "__main__":
    main()
