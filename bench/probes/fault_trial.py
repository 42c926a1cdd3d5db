#!/usr/bin/python3
"""Fault trial: kill a random worker (or a whole host) of a Fashion-MNIST run at a random moment
and check that ddprun --max-restarts and train-fashion-mnist --checkpoint-every-steps bring it to
the end.

    bench/probes/fault_trial.py [--runs 20] [--epochs 4] [--limit-train 0] [--limit-test 0]
                                [--nproc 2] [--checkpoint-every 100] [--max-restarts 3] [--kills 1]
                                [--kill worker|host] [--rejoin-after SECONDS] [--build-dir build]
                                [--seed 1] [--run-timeout 3600] [--json-out FILE]
                                [--global-batch-size N]
                                [--data-dir /usr/share/datasets/fashion-mnist]

--kill host: the job runs as 2 nodes, two ddprun agents on loopback with --nnodes 1:2 and
--nproc-per-node N each (default N = 1), and the kill takes a whole node: the second agent and its
workers, all SIGKILL at once (the first agent serves the rendezvous; losing it ends an elastic
job). The job goes on at the smaller world size (the training state resumes at another world
size); with --rejoin-after S the node is started again S seconds later and the job grows back
to 2 nodes in its next round (a membership change, which costs no restart but restarts the
workers from the last checkpoint: it is counted as one more interruption). Redone work is
measured in samples (the resume line says where it starts) and reported in steps of the world
that lost it.

First one uninterrupted run (the reference), then --runs runs of the same command, each under
`ddprun --standalone --nproc-per-node N --max-restarts K` with `--checkpoint FILE
--checkpoint-every-steps C --resume`. In each run, --kills times, one worker drawn at random
among ddprun's children gets SIGKILL at a random moment: when rank 0 has reported a step drawn
uniformly over the run's steps, plus a delay drawn uniformly over one step's time (the
reference's), so the kill may land in any phase of a step, a checkpoint write included. Rank 0 prints a progress line every step
(--log-every 1), so the step reached when the kill lands is known; the resumed attempt prints
the step it resumed from ("resumed from ... global step S"). Per run:
  finished        ddprun exited 0 and rank 0 printed "final test_accuracy="
  accuracy        the final test accuracy, and its difference to the reference's (points)
  redone          steps reached before the kill minus the step resumed from, per failure
                  (bounded by --checkpoint-every by construction; measured here)
The issue's target: 20 of 20 finish, |accuracy - reference| <= 0.3 points, redone <= 100 steps
per failure, with --epochs 4 --checkpoint-every 100. A resume at the same world size replays
the same steps (the sampler, schedule, optimizer and generators are restored), so the accuracy
is expected to equal the reference's exactly.

Prints a table (markdown) and, with --json-out, writes every run's numbers. Exit status 0 when
every run finished and met the bounds, 1 otherwise, 77 (skipped) without the dataset. Uses only the standard library.
"""
import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

PROGRESS = re.compile(r"^\[0\] epoch (\d+) \[(\d+)/(\d+)\] loss")
FROM_SCRATCH = re.compile(r"^\[0\] no checkpoint at .* yet; starting from scratch")
RESUMED = re.compile(r"^\[0\] resumed from .* global step (\d+) ")
RESUMED_AT = re.compile(r"^\[0\] resumed from .* at epoch (\d+), (\d+) samples into it, "
                        r"global step (\d+) \(saved at world size (\d+), now (\d+)\)")
ELASTIC_ROUND = re.compile(r"^ddprun: elastic round (\d+): (\d+) node\(s\).*world size (\d+);"
                           r".* (\d+) of (\d+) restarts used")
JOINING = re.compile(r"^ddprun: .*node\(s\) waiting to join")
FINAL = re.compile(r"^\[0\] final test_accuracy=([0-9.]+)")
SKIPPED = 77  # the exit status ctest's SKIP_RETURN_CODE expects
TRAINING = re.compile(r"^\[0\] training .* \((\d+) per rank, (\d+) batches of (\d+) per rank")


class Run:
    """One ddprun process whose output lines are read on a thread, with their arrival times."""

    started = []  # every Run, so that the script's exit stops what is still running

    def __init__(self, argv, log_path):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines = []  # (time, line)
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        Run.started.append(self)

    def _read(self):
        for line in self.proc.stdout:
            with self.lock:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def snapshot(self):
        with self.lock:
            return list(self.lines)

    def wait(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.reader.join(5)
            return None
        self.reader.join(5)
        self.log.close()
        return self.proc.returncode


def workers_of(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def global_step(line, steps_per_epoch, per_step):
    """The step rank 0 finished when it printed progress `line` (fixed world size)."""
    m = PROGRESS.match(line)
    if not m:
        return None
    epoch, seen = int(m.group(1)), int(m.group(2))
    return (epoch - 1) * steps_per_epoch + (seen + per_step - 1) // per_step


def command(args, checkpoint):
    return [os.path.join(args.build_dir, "bin", "ddprun"), "--standalone", "--nproc-per-node",
            str(args.nproc), "--max-restarts", str(args.max_restarts),
            os.path.join(args.build_dir, "bin", "train-fashion-mnist"), "--epochs",
            str(args.epochs), "--limit-train", str(args.limit_train), "--checkpoint", checkpoint,
            "--checkpoint-every-steps", str(args.checkpoint_every), "--resume", "--log-every", "1",
            "--seed", "42", "--data-dir", args.data_dir] + (
                ["--global-batch-size", str(args.global_batch_size)] if args.global_batch_size
                else []) + (["--limit-test", str(args.limit_test)] if args.limit_test else [])


def free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_commands(args, checkpoint, run_id):
    """The two agents of an elastic 2-node job on loopback (--kill host)."""
    master_port, agent_port = free_port(), free_port()
    while agent_port == master_port:
        agent_port = free_port()
    ddprun = [os.path.join(args.build_dir, "bin", "ddprun"), "--nnodes", "1:2",
              "--nproc-per-node", str(args.nproc), "--master-addr", "127.0.0.1",
              "--master-port", str(master_port), "--agent-port", str(agent_port),
              "--max-restarts", str(args.max_restarts), "--rdzv-last-call", "2",
              "--rdzv-id", run_id]
    program = command(args, checkpoint)[command(args, checkpoint).index("--max-restarts") + 2:]
    return ddprun + ["--node-rank", "0"] + program, ddprun + program


class HostJob:
    """--kill host: agent 0 (serves the rendezvous, runs global rank 0) and agent 1, the node
    that is killed (and maybe started again)."""

    def __init__(self, args, checkpoint, log_prefix, run_id):
        self.argv0, self.argv1 = host_commands(args, checkpoint, run_id)
        self.log_prefix = log_prefix
        self.agent0 = Run(self.argv0, log_prefix + ".node0.log")
        self.agent1 = Run(self.argv1, log_prefix + ".node1.log")
        self.rejoined = None

    def kill_node(self):
        """SIGKILL to the second agent and all its workers at once: a host that vanished."""
        victims = workers_of(self.agent1.proc.pid) + [self.agent1.proc.pid]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return victims

    def rejoin(self):
        self.rejoined = Run(self.argv1, self.log_prefix + ".node1-rejoined.log")

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        code = self.agent0.wait(timeout)
        others = [self.agent1] + ([self.rejoined] if self.rejoined else [])
        for other in others:
            other.wait(max(1.0, deadline - time.monotonic()))
        return code


def shape_of(lines):
    for _, line in lines:
        m = TRAINING.match(line)
        if m:
            return int(m.group(2)), int(m.group(3))
    raise RuntimeError("no 'training ...' line from rank 0")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--limit-train", type=int, default=60000)
    parser.add_argument("--limit-test", type=int, default=0,
                        help="evaluate on the first N test samples only (0: all; tiny forms)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="workers per node (default 2, or 1 per node with --kill host)")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--kills", type=int, default=1, help="kills per run (<= --max-restarts)")
    parser.add_argument("--kill", choices=["worker", "host"], default="worker",
                        help="what a kill takes: one worker, or a whole node (agent + workers)")
    parser.add_argument("--rejoin-after", type=float, default=None,
                        help="--kill host: start the killed node again this many seconds later")
    parser.add_argument("--build-dir", default="build")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--run-timeout", type=float, default=3600.0)
    parser.add_argument("--accuracy-tolerance", type=float, default=0.3, help="points")
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--global-batch-size", type=int, default=0,
                        help="passed to train-fashion-mnist: samples per optimizer step over all "
                             "ranks, so a job that loses a node (--kill host) keeps its batch by "
                             "accumulating micro-batches (e.g. 128 for 2 ranks of 64)")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.data_dir, "train-images-idx3-ubyte.gz")):
        print(f"fault_trial: SKIP: no Fashion-MNIST in {args.data_dir} (scripts/install-deps.sh "
              "installs it; or give --data-dir)")
        return SKIPPED
    if args.kills > args.max_restarts:
        parser.error(f"--kills {args.kills} exceeds --max-restarts {args.max_restarts}")
    if args.nproc is None:
        args.nproc = 1 if args.kill == "host" else 2
    if args.kill == "host" and args.kills != 1:
        parser.error("--kill host kills the one node that can leave (2 nodes, the first serves "
                     "the rendezvous): use --kills 1")
    if args.kill == "worker" and args.rejoin_after is not None:
        parser.error("--rejoin-after goes with --kill host")
    if args.kill == "host":
        return host_trial(args)
    rng = random.Random(args.seed)
    folder = tempfile.mkdtemp(prefix="ddp-fault-trial-")
    print(f"fault_trial: logs and checkpoints in {folder}", flush=True)
    # The flight-recorder dumps of the ranks that fail when their peer is killed go there too,
    # not into the working directory.
    os.environ.setdefault("DDP_DUMP_DIR", folder)

    # The reference: the same command, never interrupted.
    reference = Run(command(args, os.path.join(folder, "reference.pt")),
                    os.path.join(folder, "reference.log"))
    code = reference.wait(args.run_timeout)
    lines = reference.snapshot()
    final = [FINAL.match(l) for _, l in lines if FINAL.match(l)]
    if code != 0 or not final:
        print(f"fault_trial: the reference run failed (exit {code}); see {folder}/reference.log")
        return 1
    reference_accuracy = float(final[0].group(1))
    steps_per_epoch, batch = shape_of(lines)
    per_step = batch * args.nproc
    progress_times = [t for t, l in lines if PROGRESS.match(l)]
    train_start, train_end = progress_times[0], progress_times[-1]
    step_seconds = (train_end - train_start) / max(1, len(progress_times) - 1)
    print(f"fault_trial: reference accuracy {reference_accuracy:.4f}, {steps_per_epoch} steps per "
          f"epoch, training {train_end - train_start:.0f} s ({step_seconds:.2f} s per step)",
          flush=True)

    results = []
    for index in range(args.runs):
        checkpoint = os.path.join(folder, f"run{index}.pt")
        run = Run(command(args, checkpoint), os.path.join(folder, f"run{index}.log"))
        # Each kill lands at a random moment of the run: once rank 0 reported a step drawn
        # uniformly over the run's steps (later kills: over the steps after the previous one),
        # plus a delay drawn uniformly over one step's time, so that it may hit any phase of a
        # step (forward, the allreduce, the optimizer, a checkpoint being written).
        total_steps = steps_per_epoch * args.epochs
        targets = sorted(rng.randint(1, total_steps - 1) for _ in range(args.kills))
        failures = []  # per kill: victim, step reached, then step resumed from and steps redone
        kill_at = None  # monotonic time of the next kill, once its target step was reached
        deadline = time.monotonic() + args.run_timeout
        while run.proc.poll() is None and time.monotonic() < deadline and targets:
            lines = run.snapshot()
            steps = [global_step(l, steps_per_epoch, per_step) for _, l in lines]
            steps = [s for s in steps if s is not None]
            if kill_at is None and steps and steps[-1] >= targets[0]:
                kill_at = time.monotonic() + rng.uniform(0.0, step_seconds)
            if kill_at is not None and time.monotonic() >= kill_at:
                workers = workers_of(run.proc.pid)
                if workers:
                    victim = rng.choice(workers)
                    try:
                        os.kill(victim, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    failures.append({"victim_pid": victim, "target_step": targets[0],
                                     "step_reached": steps[-1], "lines_before": len(lines)})
                    targets.pop(0)
                    kill_at = None
                    # A later target already passed by the restarted run moves past the kill.
                    targets = [max(t, steps[-1] + 1) for t in targets]
            time.sleep(0.02)
        code = run.wait(max(1.0, deadline - time.monotonic()))
        lines = [l for _, l in run.snapshot()]
        # The attempt after each kill says where it starts: "resumed from ... global step S", or
        # "no checkpoint at ... yet; starting from scratch" (step 0) when the kill came before
        # the first checkpoint. Only its own lines count (up to the next kill).
        bounds = [f["lines_before"] for f in failures] + [len(lines)]
        for k, failure in enumerate(failures):
            attempt = lines[failure.pop("lines_before"):bounds[k + 1]]
            starts = [int(RESUMED.match(l).group(1)) if RESUMED.match(l) else 0
                      for l in attempt if RESUMED.match(l) or FROM_SCRATCH.match(l)]
            failure["resumed_from"] = starts[0] if starts else None
            failure["redone"] = (None if failure["resumed_from"] is None else
                                 failure["step_reached"] - failure["resumed_from"])
        final = [FINAL.match(l) for l in lines if FINAL.match(l)]
        accuracy = float(final[0].group(1)) if final else None
        result = {
            "run": index,
            "exit": code,
            "finished": code == 0 and accuracy is not None,
            "accuracy": accuracy,
            "accuracy_diff_points": None if accuracy is None else
            round(100.0 * (accuracy - reference_accuracy), 4),
            "failures": failures,
            "restarts": sum(1 for l in lines if "ddprun: restart " in l),
        }
        results.append(result)
        print(f"fault_trial: run {index}: {json.dumps(result)}", flush=True)

    return report(args, results, reference_accuracy, steps_per_epoch)


def position(line_match, samples):
    """Global sample position (epochs before + samples into the epoch) of a progress line."""
    return (int(line_match.group(1)) - 1) * samples + int(line_match.group(2))


def host_trial(args):
    """--kill host: the same checks, with whole nodes of an elastic job as the victims."""
    rng = random.Random(args.seed)
    folder = tempfile.mkdtemp(prefix="ddp-fault-trial-host-")
    print(f"fault_trial: logs and checkpoints in {folder}", flush=True)
    # The flight-recorder dumps of the ranks that fail when their peer is killed go there too,
    # not into the working directory.
    os.environ.setdefault("DDP_DUMP_DIR", folder)
    reference = HostJob(args, os.path.join(folder, "reference.pt"),
                        os.path.join(folder, "reference"), "reference")
    code = reference.wait(args.run_timeout)
    lines = reference.agent0.snapshot()
    final = [FINAL.match(l) for _, l in lines if FINAL.match(l)]
    rounds = [ELASTIC_ROUND.match(l) for _, l in lines if ELASTIC_ROUND.match(l)]
    if code != 0 or not final or not rounds or int(rounds[0].group(2)) != 2:
        print(f"fault_trial: the reference run failed or did not run on 2 nodes (exit {code}); "
              f"see {folder}/reference.node0.log")
        return 1
    reference_accuracy = float(final[0].group(1))
    steps_per_epoch, batch = shape_of(lines)
    world = 2 * args.nproc
    samples = None
    progress = [(t, PROGRESS.match(l)) for t, l in lines if PROGRESS.match(l)]
    samples = int(progress[0][1].group(3))
    train_start, train_end = progress[0][0], progress[-1][0]
    step_seconds = (train_end - train_start) / max(1, len(progress) - 1)
    print(f"fault_trial: reference accuracy {reference_accuracy:.4f} (2 nodes, world {world}), "
          f"{steps_per_epoch} steps per epoch, training {train_end - train_start:.0f} s "
          f"({step_seconds:.2f} s per step)", flush=True)

    results = []
    total_steps = steps_per_epoch * args.epochs
    for index in range(args.runs):
        job = HostJob(args, os.path.join(folder, f"run{index}.pt"),
                      os.path.join(folder, f"run{index}"), f"run{index}")
        target = rng.randint(1, total_steps - 1)
        interruptions = []  # kill, then maybe the rejoin: where each one stood
        kill_at = None
        rejoin_at = None
        deadline = time.monotonic() + args.run_timeout
        while job.agent0.proc.poll() is None and time.monotonic() < deadline:
            lines = job.agent0.snapshot()
            steps = [global_step(l, steps_per_epoch, batch * world) for _, l in lines]
            steps = [x for x in steps if x is not None]
            if not interruptions:
                if kill_at is None and steps and steps[-1] >= target:
                    kill_at = time.monotonic() + rng.uniform(0.0, step_seconds)
                if kill_at is not None and time.monotonic() >= kill_at:
                    positions = [position(PROGRESS.match(l), samples) for _, l in lines
                                 if PROGRESS.match(l)]
                    victims = job.kill_node()
                    interruptions.append({"what": "host killed", "victim_pids": victims,
                                          "target_step": target, "step_reached": steps[-1],
                                          "samples_reached": positions[-1], "world": world,
                                          "lines_before": len(lines)})
                    if args.rejoin_after is not None:
                        rejoin_at = time.monotonic() + args.rejoin_after
                    else:
                        break
            elif rejoin_at is not None and job.rejoined is None and time.monotonic() >= rejoin_at:
                job.rejoin()
            elif job.rejoined is not None and len(interruptions) == 1:
                # The round change that takes the node back in: where rank 0 was when it came.
                marks = [i for i, (_, l) in enumerate(lines) if JOINING.match(l)]
                if marks:
                    before = [position(PROGRESS.match(l), samples) for _, l in lines[:marks[0]]
                              if PROGRESS.match(l)]
                    rounds = [ELASTIC_ROUND.match(l) for _, l in lines[:marks[0]]
                              if ELASTIC_ROUND.match(l)]
                    interruptions.append({"what": "host rejoined",
                                          "samples_reached": before[-1] if before else 0,
                                          "world": int(rounds[-1].group(3)),
                                          "lines_before": marks[0]})
                    break
            time.sleep(0.02)
        code = job.wait(max(1.0, deadline - time.monotonic()))
        lines = [l for _, l in job.agent0.snapshot()]
        bounds = [f["lines_before"] for f in interruptions] + [len(lines)]
        for k, event in enumerate(interruptions):
            attempt = lines[event.pop("lines_before"):bounds[k + 1]]
            start = None
            for l in attempt:
                m = RESUMED_AT.match(l)
                if m:
                    start = (int(m.group(1)) - 1) * samples + int(m.group(2))
                    event["resumed_from_step"] = int(m.group(3))
                    event["resumed_at_world"] = int(m.group(5))
                    break
                if FROM_SCRATCH.match(l):
                    start = 0
                    break
            event["samples_resumed_from"] = start
            # The last progress line is a lower bound of where rank 0 was (the kill lands up to
            # a step later, maybe after a checkpoint it had not printed yet): never below 0.
            event["redone_samples"] = (None if start is None else
                                       max(0, event["samples_reached"] - start))
            # In steps of the world that lost the work.
            event["redone"] = (None if start is None else
                               -(-event["redone_samples"] // (batch * event["world"])))
        final = [FINAL.match(l) for l in lines if FINAL.match(l)]
        accuracy = float(final[0].group(1)) if final else None
        rounds = [ELASTIC_ROUND.match(l) for l in lines if ELASTIC_ROUND.match(l)]
        result = {
            "run": index,
            "exit": code,
            "finished": code == 0 and accuracy is not None,
            "accuracy": accuracy,
            "accuracy_diff_points": None if accuracy is None else
            round(100.0 * (accuracy - reference_accuracy), 4),
            "failures": interruptions,
            "worlds": [int(r.group(3)) for r in rounds],
            "restarts": int(rounds[-1].group(4)) if rounds else None,
        }
        results.append(result)
        print(f"fault_trial: run {index}: {json.dumps(result)}", flush=True)
    return report(args, results, reference_accuracy, steps_per_epoch)


def report(args, results, reference_accuracy, steps_per_epoch):
    finished = sum(r["finished"] for r in results)
    diffs = [abs(r["accuracy_diff_points"]) for r in results if r["accuracy_diff_points"] is not None]
    redone = [f["redone"] for r in results for f in r["failures"] if f["redone"] is not None]
    unmeasured = sum(1 for r in results for f in r["failures"] if f["redone"] is None)
    killed = sum(len(r["failures"]) for r in results)
    ok = (finished == len(results) and all(d <= args.accuracy_tolerance for d in diffs)
          and all(x <= args.checkpoint_every for x in redone) and unmeasured == 0)
    print()
    print("| runs | kill | epochs | limit-train | ranks | checkpoint every | interruptions | "
          "finished | reference acc | max abs acc diff (points) | redone steps per interruption: "
          "median / max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    kind = args.kill if args.rejoin_after is None else f"host, rejoin after {args.rejoin_after:g} s"
    ranks = args.nproc if args.kill == "worker" else f"2 x {args.nproc}"
    print(f"| {len(results)} | {kind} | {args.epochs} | {args.limit_train} | {ranks} | "
          f"{args.checkpoint_every} | {killed} | {finished}/{len(results)} | "
          f"{reference_accuracy:.4f} | {max(diffs) if diffs else float('nan'):.2f} | "
          f"{statistics.median(redone) if redone else 0} / {max(redone) if redone else 0} |")
    print(f"\nfault_trial: {'PASS' if ok else 'FAIL'} (target: all finish, |diff| <= "
          f"{args.accuracy_tolerance} points, redone <= {args.checkpoint_every} steps per failure)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "reference_accuracy": reference_accuracy,
                       "steps_per_epoch": steps_per_epoch, "runs": results, "pass": ok}, f,
                      indent=1)
    return 0 if ok else 1


def stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    # A run in progress (its own session) is stopped with the script, by Ctrl-C or SIGTERM.
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        sys.exit(main())
    finally:
        for run in Run.started:
            if run.proc.poll() is None:
                os.killpg(run.proc.pid, signal.SIGTERM)
