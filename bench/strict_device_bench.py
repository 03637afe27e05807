"""Per-op cost of the CPU backend's strict device mode (MEGATRON_PATCHES_STRICT_DEVICE).

    python bench/strict_device_bench.py

Times forward+backward steps of a tiny MoE GPT (megatron-core, 1 process, the CPU backend)
with strict device mode off and on, in alternating fresh processes (the mode is chosen when
the backend is activated), and prints the median step times and their ratio. Step times are
the process's CPU time, so that other work on a shared machine counts less.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS, WARMUP, STEPS = 4, 3, 20


def steps() -> None:
    """In a fresh process: print the median forward+backward step time in seconds."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from moe_launcher import cpu_backend

    cpu_backend.activate()
    import _megatron_cpu as cpu

    config = cpu.tiny_config(num_layers=2, num_moe_experts=8, moe_router_topk=2,
                             ffn_hidden_size=128, gated_linear_unit=True)
    model = cpu.build_gpt(config, seq_length=64)
    times = []
    for step in range(WARMUP + STEPS):
        start = time.process_time()
        cpu.train_step_loss(model, batch=2, seq_length=64).backward()
        if step >= WARMUP:
            times.append(time.process_time() - start)
    print(statistics.median(times))


def main() -> None:
    medians = {"0": [], "1": []}
    for _ in range(ROUNDS):
        for strict in medians:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                   "MEGATRON_PATCHES_STRICT_DEVICE": strict}
            out = subprocess.run([sys.executable, __file__, "--steps"], env=env, check=True,
                                 capture_output=True, text=True).stdout
            medians[strict].append(float(out.strip().splitlines()[-1]))
    off, on = statistics.median(medians["0"]), statistics.median(medians["1"])
    print(f"forward+backward step, tiny MoE GPT: strict off {off * 1000:.1f} ms, "
          f"strict on {on * 1000:.1f} ms, ratio {on / off:.3f}")


if __name__ == "__main__":
    steps() if sys.argv[1:] == ["--steps"] else main()
