"""What a run keeps per parameter for its optimizer, as the dry run's memory line
(examples/moe/plan.py) and the training log's (the parameter-census patch) price it
(moe_launcher/optimizer_state.py).

The reference is the run itself: tests/_observed_launch.py's $MEMORY_DIR counts, after megatron's
first step, the bytes of the model's parameters, their main gradients, the optimizer's main
copies and every state tensor megatron's optimizer made. On one rank with the replicated
optimizer nothing is sharded, so both figures must be that count exactly. Before, both priced
every run as Adam's (the log's also as bf16): 18 bytes per parameter, where a bf16 Muon run keeps
14 for each weight matrix (a momentum, no second moment) and an fp32 run has no main copy."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys

import pytest

from _launch import REPO, TINY_MODEL, launch

sys.path.insert(0, str(REPO / "examples" / "moe"))
import plan  # noqa: E402  (examples/moe/plan.py)

OBSERVED = REPO / "tests" / "_observed_launch.py"
MEMORY = re.compile(r"weight and optimizer memory on the most loaded rank: ([0-9.]+) MB")
FP32_MODEL = [flag for flag in TINY_MODEL if flag != "--bf16"]
RUNS = {
    "adam-bf16": [*TINY_MODEL, "--optimizer", "adam"],
    # weight matrices: Muon's momentum; embedding, output layer, norms: Adam's two moments
    "muon-bf16": [*TINY_MODEL, "--optimizer", "muon"],
    # no main copies; the embedding, output layer and norms: Lion's one moment
    "muon-lion-fp32": [*FP32_MODEL, "--optimizer", "muon", "--muon-scalar-optimizer", "lion"],
    # weight matrices: Lion's one moment; the rest: Adam's two (not --muon-scalar-optimizer)
    "lion-bf16": [*TINY_MODEL, "--optimizer", "lion"],
    # one momentum for every parameter
    "sgd-bf16": [*TINY_MODEL, "--optimizer", "sgd"],
}


def dry_run_bytes(flags: list[str]) -> float:
    flags, _ = plan.launcher_view(flags)
    with contextlib.redirect_stdout(io.StringIO()):
        args = plan.parse_megatron_flags(flags, 1)
    return plan.memory_per_gpu(args, plan.count_parameters(args), plan.check_layout(args)).total


@pytest.mark.parametrize("run", RUNS)
def test_both_memory_lines_price_what_the_optimizer_keeps(run, tmp_path):
    flags = [*RUNS[run], "--train-iters", "1"]
    log = launch(1, flags, env={"MEMORY_DIR": str(tmp_path)}, script=OBSERVED).check().log
    kept = json.loads((tmp_path / "memory_rank0.json").read_text())
    assert kept["without_state"] == 0
    assert MEMORY.search(log).group(1) == f"{kept['bytes'] / 2**20:.2f}", kept
    assert dry_run_bytes(flags) == kept["bytes"]
    adam_bf16 = 18 * kept["weights"]  # the rule both used for every run
    assert (adam_bf16 == kept["bytes"]) == (run == "adam-bf16"), (adam_bf16, kept)


def test_muons_layer_wise_distributed_optimizer_is_priced_as_the_even_share(tmp_path):
    """bf16 Muon with --use-distributed-optimizer on 2 data-parallel ranks: megatron gives the
    matrices its layer-wise distributed optimizer, which hands each rank whole parameters, so
    the ranks keep different bytes. Both lines print the ranks' mean (the even share) and say so
    in the log; before, the log's priced the run as unsharded (megatron turns the flag off for
    Muon), above every rank."""
    flags = [*RUNS["muon-bf16"], "--use-distributed-optimizer", "--train-iters", "1"]
    log = launch(2, flags, env={"MEMORY_DIR": str(tmp_path)}, script=OBSERVED).check().log
    kept = [json.loads((tmp_path / f"memory_rank{rank}.json").read_text())["bytes"]
            for rank in range(2)]
    line = MEMORY.search(log)
    assert line.group(1) == f"{sum(kept) / 2 / 2**20:.2f}", kept
    assert "the even share over data-parallel ranks" in log[line.end():line.end() + 200]
    assert kept[0] != kept[1] and max(kept) > float(line.group(1)) * 2**20
    flags_dp2, _ = plan.launcher_view(flags)
    with contextlib.redirect_stdout(io.StringIO()):
        args = plan.parse_megatron_flags(flags_dp2, 2)
    memory = plan.memory_per_gpu(args, plan.count_parameters(args), plan.check_layout(args))
    assert f"{memory.total / 2**20:.2f}" == line.group(1)


def test_an_optimizer_whose_state_is_not_modelled_is_priced_as_adam_and_said():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan.plan([*TINY_MODEL, "--train-iters", "1", "--optimizer", "soap"], 1) == 0
    notes = [line for line in out.getvalue().splitlines() if "not modelled" in line]
    assert notes == ["[plan] optimizer memory: --optimizer soap's matrix state is not "
                     "modelled; priced as fp32 Adam moments"], out.getvalue()
