"""Parameter totals and weight+optimizer memory come from the model built (#1778): the same
total in every layout, and an uneven pipeline split reports its real most loaded stage, where
megatron's estimate assumes --num-layers / PP layers per stage.

The reference is megatron's own count of the model it built: its model builder prints, on each
data-parallel rank 0, the sum of `nelement()` over that rank's parameters. At one rank that is
the whole model; with PP x EP every rank of a stage holds as many parameters (the experts split
evenly), so the most loaded rank is the largest of the stages' lines."""

import re

from _launch import TINY_MODEL, launch

CENSUS = re.compile(r"parameters of the model built: total (\d+), most loaded rank (\d+)")
MEMORY = re.compile(r"weight and optimizer memory on the most loaded rank: ([0-9.]+) MB")
MEGATRON_REPORT = re.compile(r"Theoretical memory footprints: weight and optimizer=([0-9.]+) MB")
# (megatron's model builders print "gtp_remat", training.get_model "gtp_weight_remat")
MEGATRON_RANK_COUNT = re.compile(r"number of parameters on \(tensor, gtp_(?:weight_)?remat, "
                                 r"pipeline\) model parallel rank \((\d+), (\d+), (\d+)\): (\d+)")


def census(nproc, layout):
    log = launch(nproc, [*TINY_MODEL, "--train-iters", "1", *layout]).check().log
    total, most = map(int, CENSUS.search(log).groups())
    # One record of the model built, read by every consumer: each reports once.
    for line in ("[megatron_patches] layer census:", "FLOPs per iteration:",
                 "parameters of the model built:"):
        assert log.count(line) == 1, line
    # megatron's own memory report now carries the counted figure.
    assert MEMORY.search(log).group(1) == MEGATRON_REPORT.search(log).group(1)
    per_stage = {int(m.group(3)): int(m.group(4)) for m in MEGATRON_RANK_COUNT.finditer(log)}
    return total, most, per_stage


def test_totals_agree_across_layouts_and_uneven_stages_are_reported():
    one_rank_total, one_rank_most, one_rank_count = census(1, ["--num-layers", "4"])
    assert one_rank_total == one_rank_most == one_rank_count[0]
    pp = ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
          "--expert-model-parallel-size", "2"]
    even = census(4, [*pp, "--decoder-first-pipeline-num-layers", "2",
                      "--decoder-last-pipeline-num-layers", "2"])
    uneven = census(4, [*pp, "--decoder-first-pipeline-num-layers", "3",
                        "--decoder-last-pipeline-num-layers", "1"])
    assert even[0] == uneven[0] == one_rank_total
    for _, most, per_stage in (even, uneven):
        assert sorted(per_stage) == [0, 1] and most == max(per_stage.values())
    assert uneven[1] > even[1]  # the 3-layer stage holds more than an even split would
