"""The dry run's figures (examples/moe/plan.py, from the flags alone) against the model megatron
builds from the same flags.

The reference is the training log of a real run: its parameter census (the parameters and the
weight + gradient + optimizer bytes of the most loaded rank, counted on the model built,
itself judged against megatron's own count in test_parameter_census_cpu.py) and its
`FLOPs per iteration:` line (the layer census of the model built). The dry run must print the
same memory and FLOPs for the same command line and world size."""

from __future__ import annotations

import contextlib
import io
import re
import sys

import pytest

from _launch import REPO, TINY_MODEL, launch

sys.path.insert(0, str(REPO / "examples" / "moe"))
import plan  # noqa: E402  (examples/moe/plan.py)

CENSUS = re.compile(r"parameters of the model built: total (\d+), most loaded rank (\d+)")
MEMORY = re.compile(r"weight and optimizer memory on the most loaded rank: ([0-9.]+) MB")
FLOPS = re.compile(r"^FLOPs per iteration: (\d+)$", re.M)

RUNS = {
    # A multi-token-prediction layer on the last of 2 stages: megatron builds it with the last
    # decoder layer's spec (MoE here), with a copy of the embedding. Before, the dry run left
    # the MTP layer out of the memory and priced its MLP as a dense one in the FLOPs.
    "mtp-on-the-last-stage": (2, ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"]),
    # Two dense layers (and the embedding) on the first stage, one MoE layer on the last: the
    # first holds more parameters, but the distributed optimizer shards their state over DP 2,
    # while the experts' (expert-DP 1) stays whole, so the last stage needs more bytes. Before,
    # the dry run priced the stage with the most parameters.
    "experts-outweigh-more-parameters": (4, [
        "--num-layers", "3", "--moe-layer-freq", "([0]*2+[1]*1)",
        "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
        "--decoder-last-pipeline-num-layers", "1", "--expert-model-parallel-size", "2",
        "--use-distributed-optimizer"]),
}


@pytest.mark.parametrize("run", RUNS)
def test_the_dry_run_prints_the_memory_and_flops_of_the_model_built(run):
    world, extra = RUNS[run]
    flags = [*TINY_MODEL, "--train-iters", "1", *extra]
    log = launch(world, flags).check().log
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert plan.plan(flags, world) == 0
    dry_run = printed.getvalue()

    assert FLOPS.findall(dry_run) == FLOPS.findall(log) != []
    flags, _ = plan.launcher_view(flags)
    with contextlib.redirect_stdout(io.StringIO()):
        args = plan.parse_megatron_flags(flags, world)
    memory = plan.memory_per_gpu(args, plan.count_parameters(args), plan.check_layout(args))
    assert f"{memory.total / 2**20:.2f}" == MEMORY.search(log).group(1), (memory, log[-2000:])
    total, most_loaded = map(int, CENSUS.search(log).groups())
    if run == "mtp-on-the-last-stage":  # the busiest stage by bytes is also the one by parameters
        assert memory.dense_params + memory.expert_params == most_loaded
    else:
        assert memory.dense_params + memory.expert_params < most_loaded
    # the total, and what MTP layers add to it, each counted once (the last stage's copy of the
    # embedding for the MTP layer is megatron's shared embedding)
    counts, layout = plan.count_parameters(args), plan.check_layout(args)
    decoder, _ = plan.totals(args, counts, layout.moe_pattern)
    mtp = (args.mtp_num_layers or 0) * sum(plan.mtp_layer_parameters(args, counts, layout))
    assert decoder + mtp == total
    said = re.search(r"\[plan\] parameters: total (\S+)(?: \(\+ (\S+) in 1 MTP layer\))?,",
                     dry_run)
    assert said.groups() == (plan.human(decoder), plan.human(mtp) if mtp else None), dry_run
