#!/usr/bin/env python3
"""train-char-gpt (examples/char_gpt, the minGPT-ddp port of docs/porting.md) under ddprun with two
ranks: the loss falls over two epochs, rank 0 writes the snapshot, and a second run resumes at the
next epoch from it. Usage: char_gpt_check.py BUILD_BIN_DIR"""
import os
import re
import subprocess
import sys
import tempfile


def run(bin_dir, *args):
    command = [os.path.join(bin_dir, "ddprun"), "--standalone", "--nproc-per-node", "2",
               os.path.join(bin_dir, "train-char-gpt"), "--max-steps", "25", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main():
    bin_dir = sys.argv[1]
    with tempfile.TemporaryDirectory() as folder:
        snapshot = os.path.join(folder, "gpt.pt")
        first = run(bin_dir, "--epochs", "2", "--snapshot", snapshot)
        losses = [float(x) for x in re.findall(r"epoch \d+ steps 25 loss ([0-9.]+)", first)]
        if len(losses) != 2 or not losses[1] < losses[0]:
            sys.exit(f"expected two epochs with a falling loss, got {losses}:\n{first}")
        if not os.path.exists(snapshot):
            sys.exit("rank 0 wrote no snapshot")
        second = run(bin_dir, "--epochs", "3", "--snapshot", snapshot)
        if f"resuming from snapshot {snapshot} at epoch 2" not in second:
            sys.exit(f"the second run did not resume at epoch 2:\n{second}")
        if re.findall(r"epoch (\d+) steps", second) != ["2"]:
            sys.exit(f"the second run should train epoch 2 only:\n{second}")
    print(f"ok: losses {losses}, resumed at epoch 2")


if __name__ == "__main__":
    main()
