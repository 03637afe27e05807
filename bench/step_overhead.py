"""What the launcher's patches cost per training step, save and load (issue 14).

    python bench/step_overhead.py [--pairs 6] [--iters 25]

Runs the tiny MoE GPT of the CPU tests through pretrain_moe.py on one rank, alternately with
every patch and with every patch this machine does not need to run disabled
(MEGATRON_PATCHES_DISABLE), starting each pair with the other mode. Each run loads the same
checkpoint, trains --iters iterations and saves every 5. Step times are megatron's
"elapsed time per iteration" after the first 3 iterations of a run; save and load times are
megatron's own `save-checkpoint` / `load-checkpoint` timers.

A pair's two runs follow each other, so each pair gives one ratio per kind (unpatched median /
patched median); the result is the median of the pairs' ratios, which a machine whose speed
drifts between pairs moves far less than a ratio of overall medians. On a virtual machine the
host can take CPU time away (steal, /proc/stat): a pair in which either run lost more than
MAX_STEAL of it measures the neighbours, not the patches, and is left out (said so; if every
pair is, all are used and the line says so). Ends with

    throughput ratio patched/unpatched: <step> save: <save> load: <load>

(1.00 means free; goals step >= 0.99, save/load >= 0.95).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from _launch import TINY_MODEL, launch  # noqa: E402

# Without these the tiny model does not run here (no CUDA; megatron's dataset helpers).
NEEDED_HERE = {"cpu", "dataset-helpers-prebuilt"}
WARMUP = 3
MAX_STEAL = 0.02  # share of the machine's CPU time the hypervisor took during a run
_STEP = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)")
_TIMER = re.compile(r"(save-checkpoint|load-checkpoint) \.+: \(([\d.]+), ([\d.]+)\)")


def registered_patches() -> list[str]:
    code = ("from megatron_patches import cpu_backend; cpu_backend.activate(); "
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


def run(checkpoint: str, save: str, iters: int, disable: str) -> dict[str, list[float]]:
    shutil.rmtree(save, ignore_errors=True)
    shutil.copytree(checkpoint, save)
    before = cpu_jiffies()
    log = launch(1, [*TINY_MODEL, "--train-iters", str(iters), "--load", save, "--save", save,
                     "--save-interval", "5", "--timing-log-level", "0"],
                 env={"MEGATRON_PATCHES_DISABLE": disable}, timeout=900).check().log
    steps = [float(ms) for it, ms in _STEP.findall(log) if int(it) > WARMUP + 2]
    timers = {"save-checkpoint": [], "load-checkpoint": []}
    for name, _, slowest in _TIMER.findall(log):
        timers[name].append(float(slowest))
    (total, stolen), (total0, stolen0) = cpu_jiffies(), before
    return {"step": steps, "save": timers["save-checkpoint"], "load": timers["load-checkpoint"],
            "steal": (stolen - stolen0) / max(total - total0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--iters", type=int, default=25)
    options = parser.parse_args()
    disable = ",".join(sorted(set(registered_patches()) - NEEDED_HERE))
    print(f"unpatched runs disable: {disable}", flush=True)
    with tempfile.TemporaryDirectory(prefix="step_overhead_") as work:
        checkpoint = os.path.join(work, "start")
        launch(1, [*TINY_MODEL, "--train-iters", str(options.iters + 2), "--exit-interval",
                   "2", "--save-interval", "2", "--save", checkpoint], timeout=900).check()
        pair_ratios, quiet = {"step": [], "save": [], "load": []}, []
        for pair in range(options.pairs):
            order = ("patched", "unpatched") if pair % 2 == 0 else ("unpatched", "patched")
            medians, steal = {}, 0.0
            for mode in order:
                one = run(checkpoint, os.path.join(work, mode), options.iters + 2,
                          "" if mode == "patched" else disable)
                steal = max(steal, one.pop("steal"))
                medians[mode] = {kind: statistics.median(values) for kind, values in one.items()}
                print(f"pair {pair} {mode}: median step {medians[mode]['step']:.1f} ms "
                      f"({len(one['step'])}), saves {one['save']}, load {one['load']}",
                      flush=True)
            quiet.append(steal <= MAX_STEAL)
            print(f"pair {pair}: {steal:.1%} of the CPU time stolen"
                  f"{'' if quiet[-1] else ' (left out)'}", flush=True)
            for kind in pair_ratios:
                pair_ratios[kind].append(medians["unpatched"][kind] / medians["patched"][kind])
    used = [i for i, q in enumerate(quiet) if q] or list(range(len(quiet)))
    note = (f"{len(used)} of {len(quiet)} pairs" if any(quiet) else
            f"all {len(quiet)} pairs, none quiet (steal > {MAX_STEAL:.0%}): noisy")
    ratios = {}
    for kind, values in pair_ratios.items():
        ratios[kind] = statistics.median(values[i] for i in used)
        print(f"{kind}: unpatched/patched per pair {[round(v, 3) for v in values]}, median "
              f"of {note} {ratios[kind]:.3f}")
    print(f"throughput ratio patched/unpatched: {ratios['step']:.3f} save: {ratios['save']:.3f} "
          f"load: {ratios['load']:.3f}")

if __name__ == "__main__":
    main()
