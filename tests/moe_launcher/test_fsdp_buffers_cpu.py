"""Megatron-FSDP's communication buffers as the dry run prices them (moe_launcher/fsdp_buffers.py,
examples/moe/plan.py) against megatron's own bucket allocators in a real run: the most bytes of
gathered weights and unsharded gradients alive at once through the first step
(tests/_observed_launch.py's $FSDP_BUCKET_DIR), each kind's share at that moment too.

megatron's default communication unit is at least 10^9 elements, far beyond a CPU model, whose
units then all fit its windows; the runs that set a smaller one
(--suggested-communication-unit-size, as users set it; the dry run reads it from the same flags)
make the windows bind as they do for a real model's layers (the gather window prefetches two of
the four layers, the reduce-scatter queue frees the oldest): with a dense first layer, an MTP
layer and experts kept whole (expert-DP 1), a shared expert, fp32 main gradients, full
recompute, TP2 + SP with expert-DP 2 on 4 ranks, and deepseek_v3_fsdp's tiny CPU twin
(multi-latent attention, ETP2) on its 4 ranks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from _launch import REPO, TINY_MODEL, launch

sys.path.insert(0, str(REPO / "examples" / "moe"))
import plan  # noqa: E402  (examples/moe/plan.py)

FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
        "--data-parallel-sharding-strategy", "optim_grads_params", "--train-iters", "1"]
FOUR_LAYERS = ["--num-layers", "4"]
RUNS = {  # flags, communication unit (None: megatron's default)
    "windows-hold-the-model": ([], None),
    "four-layers-windows-bind": (FOUR_LAYERS, 250_000),
    "dense-first-layer-mtp-ep2": ([*FOUR_LAYERS, "--moe-layer-freq", "[0,1,1,1]",
                                   "--mtp-num-layers", "1", "--expert-model-parallel-size", "2"],
                                  120_000),
    "fp32-main-grads": ([*FOUR_LAYERS, "--megatron-fsdp-main-grads-dtype", "fp32"], 250_000),
    "full-recompute": ([*FOUR_LAYERS, "--recompute-granularity", "full", "--recompute-method",
                        "uniform", "--recompute-num-layers", "1"], 250_000),
    "shared-expert-fp32-main-grads": ([*FOUR_LAYERS, "--moe-shared-expert-intermediate-size",
                                       "64", "--megatron-fsdp-main-grads-dtype", "fp32"],
                                      250_000),
    # 4 ranks: DP2 for the dense part, expert-DP 2
    "tp2-sp-ep2": ([*FOUR_LAYERS, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
                  100_000),
}
RANKS = {"tp2-sp-ep2": 4}
# megatron pads each bucket to a multiple of DP x its parameters' row width: up to 0.8% of these
# tiny buckets (DP4, rows of 64: 256 elements), nothing at a real model's scale
PADDING = 1e-2


def planned(flags: list[str], ranks: int):
    flags, _ = plan.launcher_view(flags)
    with contextlib.redirect_stdout(io.StringIO()):
        args = plan.parse_megatron_flags(flags, ranks)
    return plan.fsdp_buffers_per_gpu(args, plan.count_parameters(args), plan.check_layout(args))


def with_unit(flags: list[str], unit: int | None) -> list[str]:
    return [*flags, "--suggested-communication-unit-size", str(unit)] if unit else flags


@pytest.mark.parametrize("run", RUNS)
def test_fsdp_buffers_are_megatrons(run, tmp_path):
    extra, unit = RUNS[run]
    flags = with_unit([*TINY_MODEL, *FSDP, *extra], unit)
    ranks = RANKS.get(run, 2)
    launch(ranks, flags, env={"FSDP_BUCKET_DIR": str(tmp_path)},
           script=REPO / "tests" / "_observed_launch.py", timeout=300).check()
    measured = [json.loads((tmp_path / f"fsdp_buckets_rank{rank}.json").read_text())
                for rank in range(ranks)]
    figure = planned(flags, ranks)
    assert figure.communication_unit == (unit or 1_000_000_000)
    for rank in measured:
        assert rank["peak"] == rank["weights"] + rank["grads"]
        assert rank["weights"] == pytest.approx(figure.weights, rel=PADDING), (rank, figure)
        assert rank["grads"] == pytest.approx(figure.grads, rel=PADDING), (rank, figure)



def twin_flags(recipe: str) -> list[str]:
    """A recipe's flags as train.sh gives them, without its checkpoint and run files, two steps
    (its warm-up is one)."""
    printed = subprocess.run(["bash", str(REPO / "examples" / "moe" / "train.sh"), "--print-args"],
                             env={**os.environ, "RECIPE": recipe, "PYTHON": sys.executable},
                             capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    flags, skip = [], {"--save", "--load", "--result-rejected-tracker-filename", "--train-iters"}
    for previous, flag in zip(["", *printed], printed):
        if flag not in skip and previous not in skip and flag != "--exit-signal-handler":
            flags.append(flag)
    return [*flags, "--train-iters", "2"]


def test_deepseek_v3_fsdp_twin_buffers_are_megatrons(tmp_path):
    """deepseek_v3_fsdp's tiny CPU twin on its 4 ranks: multi-latent attention, a dense first
    layer, a shared expert, the MTP layer, EP2 x ETP2 (experts whole: expert-DP 1) and full
    recompute, with a communication unit its layers outgrow."""
    flags = with_unit(twin_flags("deepseek_v3_fsdp_tiny_cpu"), 60_000)
    launch(4, flags, env={"FSDP_BUCKET_DIR": str(tmp_path)},
           script=REPO / "tests" / "_observed_launch.py", timeout=300).check()
    figure = planned(flags, 4)
    for rank in range(4):
        measured = json.loads((tmp_path / f"fsdp_buckets_rank{rank}.json").read_text())
        assert measured["weights"] == pytest.approx(figure.weights, rel=PADDING), (measured, figure)
        assert measured["grads"] == pytest.approx(figure.grads, rel=PADDING), (measured, figure)
