#!/usr/bin/python3
"""Plots train-fashion-mnist --metrics files (JSON lines) as PNGs.

    python3 scripts/plot_metrics.py run.jsonl [more.jsonl ...] -o plots/

Writes, into the output folder:
  loss.png      loss against step, one curve per file (step lines, epoch means as markers)
  accuracy.png  test accuracy against epoch, one curve per file
  scaling.png   samples/s (epoch lines, median over epochs) against world size, when the files
                cover more than one world size, with the ideal linear scaling from the smallest

Needs matplotlib (Debian: python3-matplotlib; scripts/install-deps.sh installs it). Exits 2 with a
message naming the file and line for input that is not a metrics file.
"""
import argparse
import json
import os
import statistics
import sys

REQUIRED = ("kind", "epoch", "step", "loss", "samples_per_s", "world_size")


def read_metrics(path):
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"plot_metrics: {path}:{number}: not JSON ({e})")
                missing = [k for k in REQUIRED if k not in record]
                if missing:
                    sys.exit(f"plot_metrics: {path}:{number}: not a metrics line (no {', '.join(missing)})")
                records.append(record)
    except OSError as e:
        sys.exit(f"plot_metrics: cannot read {path}: {e.strerror}")
    if not records:
        sys.exit(f"plot_metrics: {path} has no metrics lines")
    return records


def label_of(path, records):
    return f"{os.path.basename(path)} (world {records[0]['world_size']})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="metrics files (JSON lines)")
    parser.add_argument("-o", "--output", required=True, help="folder for the PNGs")
    args = parser.parse_args()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(path, read_metrics(path)) for path in args.files]
    os.makedirs(args.output, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for path, records in runs:
        steps = [r for r in records if r["kind"] == "step" and r["loss"] is not None]
        epochs = [r for r in records if r["kind"] == "epoch" and r["loss"] is not None]
        line, = ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label=label_of(path, records))
        ax.plot([r["step"] for r in epochs], [r["loss"] for r in epochs], "o", color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_title("Loss (lines: logged steps, dots: epoch means)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(os.path.join(args.output, "loss.png"))
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    any_accuracy = False
    for path, records in runs:
        epochs = [r for r in records if r["kind"] == "epoch" and r.get("accuracy") is not None]
        if epochs:
            any_accuracy = True
            ax.plot([r["epoch"] for r in epochs], [r["accuracy"] for r in epochs], "o-", label=label_of(path, records))
    if any_accuracy:
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.set_title("Test accuracy after each epoch")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(os.path.join(args.output, "accuracy.png"))
        fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    by_world = {}
    for _, records in runs:
        rates = [r["samples_per_s"] for r in records if r["kind"] == "epoch" and r["samples_per_s"]]
        if rates:
            by_world.setdefault(records[0]["world_size"], []).append(statistics.median(rates))
    if len(by_world) > 1:
        worlds = sorted(by_world)
        rates = [statistics.median(by_world[w]) for w in worlds]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(worlds, rates, "o-", label="measured")
        ax.plot(worlds, [rates[0] * w / worlds[0] for w in worlds], "--", color="gray", label="linear")
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("samples/s (median over epochs)")
        ax.set_xticks(worlds)
        ax.set_title("Scaling")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(os.path.join(args.output, "scaling.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
