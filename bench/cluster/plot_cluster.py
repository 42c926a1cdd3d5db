#!/usr/bin/python3
"""Plots of the simulated-cluster benchmarks, from their JSON files.

    bench/cluster/plot_cluster.py [--train cluster_train.json] [--allreduce cluster_allreduce.json]
                                  [--out-dir docs/img]

--train (bench/cluster/cluster_train.py --json): training-step time against link rate, one line per
configuration (ddp's comm hooks and PyTorch's), and the compute-only bound as a dashed line;
writes OUT_DIR/cluster_train_step_time.png.
--allreduce (bench/cluster/cluster_allreduce.py --json-out): busbw per host link against message
size, one panel per link rate, one line per engine, the shaped rate as a dashed line; writes
OUT_DIR/cluster_allreduce_busbw.png.
Needs matplotlib (Debian's python3-matplotlib, installed by scripts/install-deps.sh; run it with
/usr/bin/python3). Exit 0 when it wrote what was asked, 2 for bad arguments or files.
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # bench_common
from bench_common import REPO, parse_rate  # noqa: E402

# One style per configuration: ddp solid, PyTorch dashed; the same colour for the same hook.
HOOK_COLOURS = {"none": "tab:gray", "fp16": "tab:blue", "int8": "tab:green",
                "powersgd": "tab:red", "batched-powersgd": "tab:purple"}
ENGINE_STYLES = {"ddp-ring": ("tab:red", "-"), "ddp-hier": ("tab:purple", "-"),
                 "gloo": ("tab:blue", "--"), "openmpi-tcp": ("tab:green", "--")}


def rate_label(bits):
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def size_label(nbytes):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g}{unit}"
    return f"{nbytes}"


def plot_train(data, out):
    rates = data["rates"]
    bits = [data["rate_bits"][r] for r in rates]
    configs = []
    for rate in rates:
        for config in data["results"].get(rate, {}):
            if config not in configs:
                configs.append(config)
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for config in configs:
        side, hook = config.split("-", 1)
        points = [(b, data["results"][r][config]["step_ms"]) for r, b in zip(rates, bits)
                  if config in data["results"].get(r, {})]
        if not points:
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o" if side == "ddp" else "s",
                linestyle="-" if side == "ddp" else "--",
                color=HOOK_COLOURS.get(hook, "black"),
                label=f"{'ddp' if side == 'ddp' else 'PyTorch ' + data.get('torch', '2.x')} {hook}")
    bound = data.get("compute_bound")
    if bound:
        ax.axhline(bound["step_ms"], color="black", linestyle=":", linewidth=1,
                   label=f"compute only ({data['hosts']} processes, no network)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(bits)
    ax.set_xticklabels([rate_label(b) for b in bits])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))
    ax.set_xlabel("link rate per host (tbf)")
    ax.set_ylabel("training step, median (ms, log scale)")
    ax.set_title(f"{data['model']} DDP step, {data['hosts']} hosts × 1 rank, batch "
                 f"{data['batch_size']}/rank, PowerSGD rank {data['powersgd_rank']}\n"
                 f"{data['cpus']} CPUs ({data['cpu_model']}) shared by all hosts",
                 fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_allreduce(data, out):
    hosts = data["hosts"]
    rates = [r for r in data["results"] if r != "none"]
    if not rates:
        raise SystemExit("plot_cluster: the allreduce JSON has no shaped rate")
    fig, axes = plt.subplots(1, len(rates), figsize=(5.2 * len(rates), 4.4), dpi=110,
                             squeeze=False)
    for ax, rate in zip(axes[0], rates):
        res = data["results"][rate]
        for engine, rows in res.items():
            if engine == "link" or not rows:
                continue
            points = sorted((int(b), row["bytes"] / (row["time_us"] * 1e-6) / 1e9
                             * 2 * (hosts - 1) / hosts) for b, row in rows.items())
            xs, ys = zip(*points)
            colour, style = ENGINE_STYLES.get(engine, ("black", "-"))
            ax.plot(xs, ys, marker="o", markersize=3, color=colour, linestyle=style, label=engine)
        bits = parse_rate(rate)
        ax.axhline(bits / 8e9, color="black", linestyle=":", linewidth=1, label="shaped rate")
        ax.set_xscale("log", base=2)
        sizes = sorted({int(b) for e, rows in res.items() if e != "link" for b in rows})
        ax.set_xticks(sizes)
        ax.set_xticklabels([size_label(s) for s in sizes], rotation=45, fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("message size (bytes, float32)")
        ax.set_ylabel("busbw per host link (GB/s)")
        ax.set_title(f"allreduce, {hosts} hosts at {rate_label(bits)}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7.5)
    fig.suptitle(f"{data['cpus']} CPUs ({data['cpu_model']}) shared by all hosts", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--train", help="bench/cluster/cluster_train.py's JSON")
    parser.add_argument("--allreduce", help="bench/cluster/cluster_allreduce.py's JSON")
    parser.add_argument("--out-dir", default=str(REPO / "docs" / "img"))
    args = parser.parse_args()
    if not args.train and not args.allreduce:
        parser.error("give --train FILE, --allreduce FILE or both")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path, plot, name in ((args.train, plot_train, "cluster_train_step_time.png"),
                             (args.allreduce, plot_allreduce, "cluster_allreduce_busbw.png")):
        if not path:
            continue
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            parser.error(f"{path}: cannot read the benchmark's JSON ({e})")
        try:
            plot(data, out_dir / name)
        except KeyError as e:
            parser.error(f"{path}: not the JSON this plot reads (no field {e}); give "
                         f"{'cluster_train.py --json' if plot is plot_train else 'cluster_allreduce.py --json-out'}'s file")
        print(f"plot_cluster: wrote {out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
