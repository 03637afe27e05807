"""What the launcher's patches cost per training step, save and load (issue 14).

    python bench/step_overhead.py [--pairs 4] [--iters 25]

Runs the tiny MoE GPT of the CPU tests through pretrain_moe.py on one rank, alternately with
every patch and with every patch this machine does not need to run disabled
(MEGATRON_PATCHES_DISABLE), starting each pair with the other mode. Each run loads the same
checkpoint, trains --iters iterations and saves every 5. Step times are megatron's
"elapsed time per iteration" after the first 3 iterations of a run; save and load times are
megatron's own `save-checkpoint` / `load-checkpoint` timers. Prints the medians and ends with

    throughput ratio patched/unpatched: <step> save: <save> load: <load>

(unpatched time / patched time: 1.00 means free; goals step >= 0.99, save/load >= 0.95).
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
_STEP = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)")
_TIMER = re.compile(r"(save-checkpoint|load-checkpoint) \.+: \(([\d.]+), ([\d.]+)\)")


def registered_patches() -> list[str]:
    code = ("from megatron_patches import cpu_backend; cpu_backend.activate(); "
            "from megatron_patches import registry; registry.load_patches(); "
            "print(','.join(sorted(registry._REGISTRY)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": ROOT})
    return done.stdout.strip().splitlines()[-1].split(",")


def run(checkpoint: str, save: str, iters: int, disable: str) -> dict[str, list[float]]:
    shutil.rmtree(save, ignore_errors=True)
    shutil.copytree(checkpoint, save)
    log = launch(1, [*TINY_MODEL, "--train-iters", str(iters), "--load", save, "--save", save,
                     "--save-interval", "5", "--timing-log-level", "0"],
                 env={"MEGATRON_PATCHES_DISABLE": disable}, timeout=900).check().log
    steps = [float(ms) for it, ms in _STEP.findall(log) if int(it) > WARMUP + 2]
    timers = {"save-checkpoint": [], "load-checkpoint": []}
    for name, _, slowest in _TIMER.findall(log):
        timers[name].append(float(slowest))
    return {"step": steps, "save": timers["save-checkpoint"], "load": timers["load-checkpoint"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--iters", type=int, default=25)
    options = parser.parse_args()
    disable = ",".join(sorted(set(registered_patches()) - NEEDED_HERE))
    print(f"unpatched runs disable: {disable}", flush=True)
    with tempfile.TemporaryDirectory(prefix="step_overhead_") as work:
        checkpoint = os.path.join(work, "start")
        launch(1, [*TINY_MODEL, "--train-iters", str(options.iters + 2), "--exit-interval",
                   "2", "--save-interval", "2", "--save", checkpoint], timeout=900).check()
        times = {mode: {"step": [], "save": [], "load": []} for mode in ("patched", "unpatched")}
        for pair in range(options.pairs):
            order = ("patched", "unpatched") if pair % 2 == 0 else ("unpatched", "patched")
            for mode in order:
                one = run(checkpoint, os.path.join(work, mode), options.iters + 2,
                          "" if mode == "patched" else disable)
                for kind, values in one.items():
                    times[mode][kind] += values
                print(f"pair {pair} {mode}: median step {statistics.median(one['step']):.1f} ms "
                      f"({len(one['step'])}), saves {one['save']}, load {one['load']}",
                      flush=True)
    ratios = {}
    for kind in ("step", "save", "load"):
        patched, unpatched = (statistics.median(times[m][kind]) for m in ("patched", "unpatched"))
        ratios[kind] = unpatched / patched
        print(f"{kind}: median patched {patched:.1f} ms ({len(times['patched'][kind])}), "
              f"unpatched {unpatched:.1f} ms ({len(times['unpatched'][kind])})")
    print(f"throughput ratio patched/unpatched: {ratios['step']:.3f} save: {ratios['save']:.3f} "
          f"load: {ratios['load']:.3f}")


if __name__ == "__main__":
    main()
