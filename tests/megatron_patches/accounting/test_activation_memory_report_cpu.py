"""The log's `Theoretical memory footprints ... activation=` figure against what the ranks of a
real run hold for their backward (activation-memory-report).

The reference: through a run's first training step (megatron's pipeline schedule, its loss,
its recompute) each rank counts the bytes of the tensors autograd keeps for the backward, under
torch's saved-tensor hooks (tests/_observed_launch.py $ACTIVATION_DIR). The logits are not
among them: they live beside them while a micro-batch's loss is computed, so the busiest rank
holds between its saved bytes and those plus its logits. The patched figure lies there (2%,
and the log's two decimals); megatron-core 0.19.2's own dense formulas, which price no expert
tokens and no recompute, miss it by far: under at PP2 (a MoE layer's top-2 copies of every
token), over under full recompute."""

from __future__ import annotations

import json
import re

import pytest

from _launch import REPO, TINY_MODEL, launch

REPORT = re.compile(r"Theoretical memory footprints: weight and optimizer=[0-9.]+ MB, "
                    r"activation=([0-9.]+) MB")
MEGABYTE = 1024 * 1024
LAYOUTS = {
    # the first stage holds 2 micro-batches of 2 MoE layers, the last 1 and the loss
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    # each layer's input kept, one layer rebuilt at a time
    "full-recompute": (1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]),
}


def _logged_activations(log: str) -> float:
    found = REPORT.findall(log)
    assert found, log[-3000:]
    return float(found[-1]) * MEGABYTE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_logged_activations_are_what_the_busiest_rank_holds(layout, tmp_path):
    world, flags = LAYOUTS[layout]
    args = [*TINY_MODEL, "--num-layers", "4", "--train-iters", "1", *flags]
    run = launch(world, args, env={"ACTIVATION_DIR": str(tmp_path)},
                 script=REPO / "tests" / "_observed_launch.py").check()
    assert "[megatron_patches] activation-memory-report: applied" in run.log
    held = [json.loads((tmp_path / f"activation_rank{rank}.json").read_text())["peak"]
            for rank in range(world)]
    # the last rank's logits in bf16: sequence x micro-batch x vocabulary (512, unpadded at TP1)
    logits = [0] * (world - 1) + [64 * 2 * 512 * 2]
    low, high = max(held), max(h + lg for h, lg in zip(held, logits))
    rounding = 0.005 * MEGABYTE

    logged = _logged_activations(run.log)
    assert low * 0.98 - rounding <= logged <= high * 1.02 + rounding, (logged, low, high)

    unpatched = launch(world, args, env={"MEGATRON_PATCHES_DISABLE": "activation-memory-report"}
                       ).check()
    megatron = _logged_activations(unpatched.log)
    assert not low * 0.8 <= megatron <= high * 1.2, (megatron, low, high)
