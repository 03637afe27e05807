"""What the launcher's patches cost per training step, save and load (issue 14).

    python bench/step_overhead.py [--pairs 4] [--iters 90] [--load-pairs 16]

Runs the tiny MoE GPT of the CPU tests through pretrain_moe.py on one rank twice at once: with
every patch, and with every patch this machine does not need to run disabled
(MEGATRON_PATCHES_DISABLE). Both load the same checkpoint and train --iters iterations, saving
every SAVE_INTERVAL, on the same CPU core (the harness keeps the other), taking turns: the bench
pauses one run (SIGSTOP) after each of its iterations and resumes the other (SIGCONT), never in
the middle of a save. Each iteration of one run is thus measured within a second of the same
iteration of the other, on the same machine. This VM's speed drifts by 10-20% from minute to
minute (its host takes 3-18% of the CPU time, steal in /proc/stat); whole runs one after the
other gave 0.64-1.78 per pair, and runs side by side on the two cores 0.80-1.25.

* Step: the rank's CPU time (all its threads, /proc schedstat) per iteration, read between its
  iteration log lines (a paused run uses none), for the iterations after the first WARMUP that
  did not save. On one rank a step waits for nothing (no peer, mock data), so this is its
  whole cost.
* Save and load: megatron's own `save-checkpoint` / `load-checkpoint` timers (wall time: the
  commit's fsyncs wait for the disk). Saves run while the other run is paused (megatron's last
  one, after the loop, left out). Both runs are paused once megatron is initialised, so that
  each then builds its model and loads while the other waits: the two loads run seconds apart,
  one per run. A run loads once, so --load-pairs more pairs only load (each run is stopped
  once megatron has timed its load): 20 loads per mode by default, as many as the goal asks
  of steps. A single load varies by a third or more from run to run in either mode (250-540
  ms here, all of it CPU time) and a pair's two loads run seconds apart: hence many pairs and
  their median.

A pair gives one ratio per kind: the median, over the iterations (the saves) both runs measured,
of unpatched / patched; for the load its one ratio. The result is the median of the pairs'
ratios. Ends with

    throughput ratio patched/unpatched: <step> save: <save> load: <load>

(1.00 means free; goals step >= 0.99, save/load >= 0.95).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from _launch import TINY_MODEL, LiveRun, launch  # noqa: E402

# Without these the tiny model does not run here (no CUDA; megatron's dataset helpers), cannot
# load the checkpoint both modes start from (saved with the patches: moe-norm-checkpoint-key
# names the MoE norms' key, at model build, no cost per step), or logs no save and load timers
# (megatron-logging-setup: megatron's own INFO logging, which emerging-optimizers' absl import
# pre-empts; set once at start).
NEEDED_HERE = {"cpu", "dataset-helpers-prebuilt", "moe-norm-checkpoint-key",
               "megatron-logging-setup"}
WARMUP = 3
SAVE_INTERVAL = 3
INITIALIZED = "[after megatron is initialized]"  # megatron's line before the model is built
_STEP = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\)")
_TIMER = re.compile(r"(save-checkpoint|load-checkpoint) \.+: \(([\d.]+), ([\d.]+)\)")


def registered_patches() -> list[str]:
    code = ("from moe_launcher import cpu_backend; cpu_backend.activate(); "
            "from megatron_patches import registry; registry.load_patches(); "
            "print(','.join(sorted(registry._REGISTRY)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": ROOT})
    return done.stdout.strip().splitlines()[-1].split(",")


def cpu_jiffies() -> tuple[int, int]:
    """(all, stolen) CPU time of this machine so far, from /proc/stat ((0, 0) where absent)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def cpu_seconds(pid: int) -> float:
    """The time a process's threads have run on a CPU, in ns resolution (the first field of
    each thread's /proc/<pid>/task/<tid>/schedstat; user + system times tick in 10 ms)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    return total / 1e9


class TakingTurns:
    """One run that the bench pauses after each iteration (the one it saved in, after the next).
    A load_only run is stopped once megatron has timed its load."""

    def __init__(self, checkpoint: str, save: str, iters: int, disable: str, core: int,
                 load_only: bool = False):
        shutil.rmtree(save, ignore_errors=True)
        shutil.copytree(checkpoint, save)
        self.iters = iters
        self.load_only = load_only
        self.run = LiveRun([*TINY_MODEL, "--train-iters", str(iters), "--load", save, "--save",
                            save, "--save-interval", str(SAVE_INTERVAL), "--timing-log-level",
                            "0"], nproc=1, cores={core},
                           env={"MEGATRON_PATCHES_DISABLE": disable})
        self.cpu: dict[int, float] = {}  # iteration -> the rank's CPU seconds at its log line
        self.rank: psutil.Process | None = None
        self.paused = False
        self.seen = 0

    def turn(self) -> int | None:
        """Runs until the next pause: once megatron is initialised (before the model is built
        and the checkpoint loaded: 0), then after each iteration. The iteration it paused after
        (None: the run ended)."""
        if self.paused:
            self.rank.resume()
            self.paused = False
        while self.run.proc.poll() is None:
            lines = self.run.lines[self.seen:]
            self.seen += len(lines)
            for line in lines:
                if self.rank is None and line.startswith("[ranks] pids: "):
                    self.rank = self.run.rank(0)
                if self.rank is not None and line.startswith(INITIALIZED):
                    self.rank.suspend()
                    self.paused = True
                    return 0
                if self.load_only and (timer := _TIMER.search(line)) and \
                        timer.group(1) == "load-checkpoint":
                    self.run.stop()
                    return None
                if self.rank is not None and (step := _STEP.search(line)):
                    iteration = int(step.group(1))
                    self.cpu[iteration] = cpu_seconds(self.rank.pid)
                    if iteration % SAVE_INTERVAL or iteration == self.iters:
                        self.rank.suspend()
                        self.paused = True
                        return iteration
            time.sleep(0.001)
        return None

    def finish(self) -> dict:
        """The run's step CPU ms per iteration (after WARMUP, not saving), save times (megatron's
        last one, after the loop, left out) and load time, in ms; a load_only run's load time."""
        if self.paused:
            self.rank.resume()
        log = self.run.finish(300)
        timers = {"save-checkpoint": [], "load-checkpoint": []}
        for name, _, slowest in _TIMER.findall(log):
            timers[name].append(float(slowest))
        if self.load_only and timers["load-checkpoint"]:
            return {"load": timers["load-checkpoint"]}  # stopped by the bench: no exit status
        if self.load_only or self.run.proc.returncode != 0:
            sys.exit(f"step_overhead: a run failed (exit {self.run.proc.returncode}):\n"
                     f"{log[-3000:]}")
        first = min(self.cpu) + WARMUP
        steps = {i: 1000 * (self.cpu[i] - self.cpu[i - 1]) for i in self.cpu
                 if i - 1 in self.cpu and i - 1 >= first and (i - 1) % SAVE_INTERVAL}
        return {"step": steps, "save": timers["save-checkpoint"][:-1],
                "load": timers["load-checkpoint"]}


def pair(checkpoint: str, work: str, iters: int, disable: str, first: str,
         load_only: bool = False) -> dict[str, dict]:
    """Both modes taking turns, `first` first: each starts and is paused once megatron is
    initialised, then they alternate (model build, load and first iteration; then each
    iteration). A load_only pair's runs end after their load."""
    core = max(os.sched_getaffinity(0))
    runs = {}
    for mode in sorted(("patched", "unpatched"), key=lambda m: m != first):
        runs[mode] = TakingTurns(checkpoint, os.path.join(work, mode), iters,
                                 "" if mode == "patched" else disable, core, load_only)
        runs[mode].turn()
    while any([run.turn() is not None for run in runs.values()]):
        pass  # each run ends on its own turn (its last save and exit run alone)
    return {mode: run.finish() for mode, run in runs.items()}


def paired_ratio(unpatched, patched) -> float:
    """The median of unpatched/patched over what both measured at the same point (the same
    iteration, the n-th save): the two were measured moments apart."""
    if isinstance(unpatched, dict):
        keys = sorted(unpatched.keys() & patched.keys())
        unpatched, patched = [unpatched[k] for k in keys], [patched[k] for k in keys]
    return statistics.median(u / p for u, p in zip(unpatched, patched))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--iters", type=int, default=90)
    parser.add_argument("--load-pairs", type=int, default=16)
    options = parser.parse_args()
    if options.pairs < 1:
        parser.error("--pairs must be at least 1 (steps and saves come only from full pairs)")
    disable = ",".join(sorted(set(registered_patches()) - NEEDED_HERE))
    print(f"unpatched runs disable: {disable}", flush=True)
    start_iteration = 2
    with tempfile.TemporaryDirectory(prefix="step_overhead_") as work:
        checkpoint = os.path.join(work, "start")
        launch(1, [*TINY_MODEL, "--train-iters", str(options.iters + start_iteration),
                   "--exit-interval", str(start_iteration), "--save-interval",
                   str(start_iteration), "--save", checkpoint], timeout=900).check()
        pair_ratios = {"step": [], "save": [], "load": []}
        for index in range(options.pairs):
            before = cpu_jiffies()
            measured = pair(checkpoint, work, options.iters + start_iteration, disable,
                            "patched" if index % 2 == 0 else "unpatched")
            (total, stolen), (total0, stolen0) = cpu_jiffies(), before
            for mode, one in measured.items():
                print(f"pair {index} {mode}: step {statistics.mean(one['step'].values()):.1f} "
                      f"ms CPU (mean of {len(one['step'])}), save "
                      f"{statistics.median(one['save']):.1f} ms (median of {len(one['save'])}), "
                      f"load {one['load'][0]:.1f} ms", flush=True)
            print(f"pair {index}: the host took {(stolen - stolen0) / max(total - total0, 1):.1%} "
                  f"of the CPU time (steal)", flush=True)
            for kind in pair_ratios:
                pair_ratios[kind].append(paired_ratio(measured["unpatched"][kind],
                                                      measured["patched"][kind]))
        for index in range(options.load_pairs):
            measured = pair(checkpoint, work, options.iters + start_iteration, disable,
                            "patched" if index % 2 == 0 else "unpatched", load_only=True)
            print(f"load pair {index}: patched {measured['patched']['load'][0]:.1f} ms, "
                  f"unpatched {measured['unpatched']['load'][0]:.1f} ms", flush=True)
            pair_ratios["load"].append(paired_ratio(measured["unpatched"]["load"],
                                                    measured["patched"]["load"]))
    ratios = {}
    for kind, values in pair_ratios.items():
        ratios[kind] = statistics.median(values)
        print(f"{kind}: unpatched/patched per pair {[round(v, 3) for v in values]}, median "
              f"{ratios[kind]:.3f}")
    print(f"throughput ratio patched/unpatched: {ratios['step']:.3f} save: {ratios['save']:.3f} "
          f"load: {ratios['load']:.3f}")


if __name__ == "__main__":
    main()
