"""exit-signal-one-sync: megatron's per-iteration `--exit-signal-handler` check copies one value
per rank to the host (a device sync each on a GPU, ~1,000 per step at 1,024 ranks); patched it
copies one. Real 4-rank gloo runs of megatron's DistributedSignalHandler
(tests/_exit_signal_worker.py), with the patch left out (MEGATRON_PATCHES_DISABLE) and with it;
the reference for "one rank received the signal" is the answer megatron's own check gives."""

import json
import re

import pytest

from _launch import REPO, launch

WORLD = 4
PATCH = "exit-signal-one-sync"


def _check(disable: str) -> list[dict]:
    run = launch(WORLD, [], env={"MEGATRON_PATCHES_DISABLE": disable},
                 script=REPO / "tests" / "_exit_signal_worker.py", timeout=120)
    assert run.returncode == 0, run.log[-3000:]
    # Four ranks write to one pipe, so a rank's line may land inside another's: take each
    # rank's JSON object wherever it stands (it holds no braces of its own).
    lines = [json.loads(found) for found in re.findall(r"exit-signal (\{[^{}]*\})", run.log)]
    assert sorted(line["rank"] for line in lines) == list(range(WORLD)), run.log[-3000:]
    return lines


@pytest.mark.slow
def test_one_host_read_per_check_and_the_same_answer():
    unpatched, patched = _check(PATCH), _check("")
    assert all("skipped (disabled" in line["patch"] for line in unpatched)
    assert all(f"{PATCH}: applied" in line["patch"] for line in patched)
    # Every rank learns that rank 2 received the signal, with and without the patch.
    assert all(line["received"] for line in unpatched + patched)
    # megatron-core 0.19.2: one `.item()` per rank of the world, on every rank.
    assert {line["host_reads"] for line in unpatched} == {WORLD}
    assert {line["host_reads"] for line in patched} == {1}
