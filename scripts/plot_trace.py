#!/usr/bin/python3
"""Draws a merged timeline (ddp-trace merge) as a PNG: one row per rank and lane, a bar per event.

    python3 scripts/plot_trace.py merged.json -o timeline.png [--start MS] [--span MS]

For a quick look where Perfetto (ui.perfetto.dev) or chrome://tracing is not at hand. Complete
events ("X") become bars coloured by name, instant events ("i") ticks. --start and --span pick a
window in milliseconds from the earliest event (default: four training steps from the middle
of the run, found by their "optimizer step" events; else the last fifth of the trace). Needs matplotlib (python3-matplotlib).
"""
import argparse
import json
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="a merged trace (or one rank's trace_rank<R>.json)")
    parser.add_argument("-o", "--output", required=True, help="the PNG to write")
    parser.add_argument("--start", type=float, help="window start, ms from the first event")
    parser.add_argument("--span", type=float, help="window length in ms")
    args = parser.parse_args()

    try:
        with open(args.trace, encoding="utf-8") as f:
            trace = json.load(f)
        events = trace["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"plot_trace: {args.trace} is not a readable trace ({e})")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lane_names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            lane_names[(e["pid"], e["tid"])] = e["args"]["name"]
    timed = [e for e in events if e.get("ph") in ("X", "i") and "ts" in e]
    if not timed:
        sys.exit(f"plot_trace: {args.trace} has no events")
    t0 = min(e["ts"] for e in timed)
    t_end = max(e["ts"] + e.get("dur", 0) for e in timed)
    total_ms = (t_end - t0) / 1000.0
    # Default window: four training steps from the middle of the run (between "optimizer step"
    # events of the first rank), else the last fifth of the trace.
    steps = sorted(e["ts"] for e in timed if e["name"] == "optimizer step" and e["pid"] == timed[0]["pid"])
    if len(steps) >= 6:
        middle = len(steps) // 2
        default_start = (steps[middle - 2] - t0) / 1000.0
        default_span = (steps[middle + 2] - steps[middle - 2]) / 1000.0
    else:
        default_start, default_span = total_ms * 0.8, total_ms * 0.2
    start = args.start if args.start is not None else default_start
    span = args.span if args.span is not None else default_span
    lo, hi = t0 + start * 1000.0, t0 + (start + span) * 1000.0

    rows = sorted({(e["pid"], e["tid"]) for e in timed})
    row_of = {row: i for i, row in enumerate(rows)}
    names = sorted({e["name"] for e in timed if e["ph"] == "X"})
    cmap = plt.get_cmap("tab20")
    colour = {name: cmap(i % 20) for i, name in enumerate(names)}

    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.8))
    used = set()
    for e in timed:
        end = e["ts"] + e.get("dur", 0)
        if end < lo or e["ts"] > hi:
            continue
        y = row_of[(e["pid"], e["tid"])]
        x = (e["ts"] - t0) / 1000.0
        if e["ph"] == "X":
            ax.barh(y, max(e["dur"] / 1000.0, 0.01), left=x, height=0.7, color=colour[e["name"]],
                    label=e["name"] if e["name"] not in used else None, edgecolor="none")
            used.add(e["name"])
        else:
            ax.plot([x, x], [y - 0.4, y + 0.4], color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p} · {lane_names.get((p, t), t)}" for p, t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(start, start + span)
    ax.set_xlabel("ms (rank 0's clock, from the first event)")
    ax.set_title(f"{args.trace}: ticks = bucket ready")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=5, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
