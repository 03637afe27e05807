"""Checkpoint bytes across expert tensor parallelism, and the save guard's cost (Megatron-LM #1836).

    python bench/checkpoint_bench.py

Saves one tiny MoE GPT (2 gloo ranks on CPU, tests/_ckpt_worker.py) at ETP=1 and ETP=2 and
prints the ETP=2/ETP=1 ratio of tensor bytes (goal 1.00: #1836 made it 1/ETP), then times
interleaved ETP=2 saves with and without the checkpoint-completeness-guard (goal <= 1.05).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from _checkpoints import run_scenario  # noqa: E402

from moe_launcher.checkpoint_files import audit as checkpoint_audit  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as out:
        results = run_scenario("bench", out)
        etp1 = checkpoint_audit.audit(os.path.join(out, "etp1")).to_json()
        etp2 = checkpoint_audit.audit(os.path.join(out, "etp2")).to_json()
    print(f"tensor bytes   ETP=2 / ETP=1: {etp2['saved_bytes']} / {etp1['saved_bytes']} = "
          f"{etp2['saved_bytes'] / etp1['saved_bytes']:.2f}  (goal 1.00)")
    print(f"expert bytes   ETP=2 / ETP=1: {etp2['expert_saved_bytes']} / "
          f"{etp1['expert_saved_bytes']} = "
          f"{etp2['expert_saved_bytes'] / etp1['expert_saved_bytes']:.2f}  (goal 1.00)")
    print(f".distcp bytes  ETP=2 / ETP=1: {etp2['payload_bytes_on_disk']} / "
          f"{etp1['payload_bytes_on_disk']} = "
          f"{etp2['payload_bytes_on_disk'] / etp1['payload_bytes_on_disk']:.2f}  "
          "(goal 1.00 up to per-chunk framing)")
    for name, report in (("ETP=1", etp1), ("ETP=2", etp2)):
        framing = (report["payload_bytes_on_disk"] - report["saved_bytes"]) / report["chunks"]
        print(f"  {name}: {report['chunks']} chunks, ~{framing:.0f} bytes of file framing and "
              "common state per chunk")
    # A save ends when its slowest rank does.
    times = {mode: [max(ts) for ts in zip(*(r["times"][mode] for r in results))]
             for mode in ("without_guard", "with_guard")}
    without, with_guard = (statistics.median(times[m]) for m in ("without_guard", "with_guard"))
    check = statistics.median(max(ts) for ts in zip(*(r["check_times"] for r in results)))
    print(f"save time (median of {len(times['with_guard'])}) with / without guard: "
          f"{with_guard * 1e3:.1f} ms / {without * 1e3:.1f} ms = {with_guard / without:.3f}  "
          "(goal <= 1.05)")
    print(f"guard check itself: {check * 1e3:.2f} ms per save = {check / without:.1%} of a save")


if __name__ == "__main__":
    main()
