"""Runs tests/_ckpt_worker.py scenarios once per pytest process and shares their outputs.

Making real checkpoints takes two gloo processes and ~15 s of CPU, so the audit and guard tests
share one set (a module-level cache). Scenarios run under the suite's harness (_launch.launch).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

from _launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "_ckpt_worker.py")
TIMEOUT_S = 300  # a hung rank fails the test instead of hanging pytest
WORLD = 2


def run_scenario(scenario: str, out: str) -> list[dict]:
    """Runs one 2-rank scenario into `out`; returns each rank's result."""
    run = launch(WORLD, [scenario, out], timeout=TIMEOUT_S, script=Path(WORKER))
    if run.returncode != 0:
        raise RuntimeError(f"{scenario} failed ({run.returncode}):\n{run.log[-4000:]}")
    results = []
    for rank in range(WORLD):
        with open(os.path.join(out, f"result_rank{rank}.json")) as f:
            results.append(json.load(f))
        os.remove(os.path.join(out, f"result_rank{rank}.json"))
    for rank, result in enumerate(results):
        if "crash" in result:
            raise RuntimeError(f"{scenario} rank {rank} crashed:\n{result['crash']}")
    return results


@functools.cache
def checkpoints() -> str:
    """Directory holding etp1/, etp2/ and damaged/ save roots (see _ckpt_worker.scenario_make)."""
    out = tempfile.mkdtemp(prefix="ckpt_audit_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    run_scenario("make", out)
    return out


@functools.cache
def guard_results() -> tuple[str, list[dict]]:
    """Per-rank results of _ckpt_worker.scenario_guards, run against checkpoints()."""
    out = checkpoints()
    return out, run_scenario("guards", out)
