"""Patch qk-clip-distributed-optimizer (Megatron-LM PR #7382): megatron's QK-clip (`--qk-clip`,
MuonClip's: Kimi K2) under the distributed optimizer. The worker (tests/_qk_clip_worker.py) builds
a bf16 model at DP2 with megatron's distributed optimizer, sets the largest attention logits
Transformer Engine's attention would report (the local spec reports none; megatron takes
`--qk-clip` with TE only, so no launched run can reach it here) and calls megatron's own
`clip_qk`. Reference: the Kimi K2 report's per-head scaling of the fp32 masters before the clip.
"""

from __future__ import annotations

import re

import pytest

from _launch import REPO, launch

NAME = "qk-clip-distributed-optimizer"
WORKER = REPO / "tests" / "_qk_clip_worker.py"


@pytest.mark.parametrize("attention, optimizer", [("mla", "adam"), ("gqa", "adam"),
                                                   ("mla", "muon")])
def test_clip_scales_each_ranks_share_of_the_fp32_masters_as_qk_clip_does(attention, optimizer):
    """Patched: every clipped weight's whole master (the two ranks' shards) is the reference's,
    bit for bit; the layer whose heads stay under the threshold is left as it is. Also under
    MuonClip's optimizer (`--optimizer muon --use-distributed-optimizer`: megatron's layer-wise
    one, whole masters, which the patch leaves to megatron)."""
    run = launch(2, [attention, optimizer], script=WORKER, timeout=240).check()
    lines = [line for line in run.log.splitlines() if line.startswith("qk-clip:")]
    assert len(lines) == (4 if attention == "mla" else 2), run.log[-3000:]
    for line in lines:
        difference, changed = map(float, re.findall(r"(\d\.\d+e[-+]\d+)", line))
        assert difference == 0.0, line
        assert (changed > 1e-3) == ("layers.0." in line), line


def test_unpatched_every_rank_dies_at_the_first_clip():
    """megatron-core 0.19.2's clip_qk reshapes the flat shard as the whole weight: the rank that
    owns no part of a weight fails on its None master, the other on the shard's size."""
    run = launch(2, ["mla", "adam"], script=WORKER, timeout=240,
                 env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert run.returncode != 0
    assert "'NoneType' object has no attribute 'data'" in run.log, run.log[-3000:]
    assert "must match the size of tensor b" in run.log, run.log[-3000:]
    assert "qk-clip:" not in run.log
