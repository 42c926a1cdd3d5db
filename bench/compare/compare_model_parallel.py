#!/usr/bin/env python3
"""train-gpt (examples/gpt: ddp's DeviceMesh, tensor-parallel layers, Pipeline with a dp group)
against PyTorch 2.x's own model parallelism on the same GPT
(bench/compare/pytorch_model_parallel_bench.py: tensor.parallel on a DeviceMesh,
torch.distributed.pipelining, FSDP2's fully_shard), CPU, world 4, in alternated rounds on this
machine. Prints one table: per layout the median step time of each, ddp's speed-up and the
largest rank's peak resident memory of each (the median over the rounds).

  python3 bench/compare/compare_model_parallel.py --build build [--rounds 3] [--steps 20]

Layouts: TP 2 x DP 2, PP 2 x DP 2 (1F1B, 4 micro-batches) and FSDP x TP (FULL_SHARD over dp 2,
tp 2: train-gpt --fsdp against fully_shard over parallelize_module); --layouts
pp2xdp2-interleaved adds PP 2 x DP 2 with the interleaved schedule (2 chunks per rank, 4
micro-batches, against ScheduleInterleaved1F1B), dp4 plain
data parallelism over the same driver. Both sides: float32, AdamW, one torch thread per rank, the
gradients averaged over dp once per step, the same sizes (--hidden, --heads, --layers,
--block-size, --batch-size, vocabulary 96).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # bench/compare/ -> the repository
LAYOUTS = {
    "tp2xdp2": ["--dp", "2", "--tp", "2"],
    "pp2xdp2": ["--dp", "2", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b"],
    "pp2xdp2-interleaved": ["--dp", "2", "--pp", "2", "--microbatches", "4", "--schedule",
                            "interleaved", "--virtual-stages", "2"],
    "dp4": ["--dp", "4"],
    "fsdp-tp2xdp2": ["--dp", "2", "--tp", "2", "--fsdp"],
}
VOCAB = 96


def median_ms(command, env, timeout):
    """(median step ms, the largest rank's peak resident MiB) of one run."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    match = re.search(r"median_step_ms=([0-9.]+).*peak_rss_mb=([0-9.]+)", done.stdout)
    if done.returncode != 0 or not match:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return float(match.group(1)), float(match.group(2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--layouts", default="tp2xdp2,pp2xdp2,fsdp-tp2xdp2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timeout", type=int, default=600)
    args = parser.parse_args()
    sizes = ["--hidden", str(args.hidden), "--heads", str(args.heads), "--layers",
             str(args.layers), "--block-size", str(args.block_size), "--batch-size",
             str(args.batch_size)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = {}
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            parser.error(f"unknown layout {name!r}: {', '.join(LAYOUTS)}")
        layout = LAYOUTS[name]
        ddp_command = [os.path.join(args.build, "bin", "ddprun"), "--standalone",
                       "--nproc-per-node", "4", os.path.join(args.build, "bin", "train-gpt"),
                       *layout, *sizes, "--steps", str(args.warmup + args.steps), "--time-after",
                       str(args.warmup), "--vocab-at-least", str(VOCAB), "--log-every",
                       str(10 ** 6)]
        torch_command = [os.path.join(ROOT, "scripts", "pytorch-python"), "-m",
                         "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                         os.path.join(HERE, "pytorch_model_parallel_bench.py"), *layout, *sizes,
                         "--steps", str(args.steps), "--warmup", str(args.warmup), "--vocab",
                         str(VOCAB)]
        ddp_runs, torch_runs = [], []
        for _ in range(args.rounds):  # alternated: both see the same machine load
            ddp_runs.append(median_ms(ddp_command, env, args.timeout))
            torch_runs.append(median_ms(torch_command, env, args.timeout))
        results[name] = (ddp_runs, torch_runs)

    print("| layout (world 4) | ddp train-gpt ms/step | PyTorch ms/step | ddp speed-up | "
          "peak MiB per rank, ddp / PyTorch |")
    print("|---|---|---|---|---|")
    for name, (ddp_runs, torch_runs) in results.items():
        ddp_ms, torch_ms = [r[0] for r in ddp_runs], [r[0] for r in torch_runs]
        ddp_median, torch_median = statistics.median(ddp_ms), statistics.median(torch_ms)
        ddp_peak = statistics.median(r[1] for r in ddp_runs)
        torch_peak = statistics.median(r[1] for r in torch_runs)
        print(f"| {name} | {ddp_median:.2f} ({', '.join(f'{t:.1f}' for t in ddp_ms)}) | "
              f"{torch_median:.2f} ({', '.join(f'{t:.1f}' for t in torch_ms)}) | "
              f"{torch_median / ddp_median:.2f}x | {ddp_peak:.0f} / {torch_peak:.0f} |")


if __name__ == "__main__":
    main()
