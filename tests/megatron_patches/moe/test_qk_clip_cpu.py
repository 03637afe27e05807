"""Patches qk-clip-distributed-optimizer (Megatron-LM PR #7382), qk-clip-every-attention-layer and
qk-clip-negative-logits: megatron's QK-clip (`--qk-clip`, MuonClip's: Kimi K2). The worker (tests/_qk_clip_worker.py)
builds a bf16 model at DP2 with megatron's distributed optimizer (or MuonClip's layer-wise one),
sets the largest attention logits Transformer Engine's attention would report (the local spec
reports none; megatron takes `--qk-clip` with TE only, so no launched run can reach it here) and
calls `clip_qk` as megatron's train_step does. Reference: the Kimi K2 report's per-head scaling
of the fp32 masters before the clip.
"""

from __future__ import annotations

import math
import re

import pytest

from _launch import REPO, launch

WORKER = REPO / "tests" / "_qk_clip_worker.py"


def _clipped(run) -> dict[str, tuple[float, float]]:
    """weight -> (difference from the reference, change by the clip), from rank 0's lines."""
    found = re.findall(r"^qk-clip: (\S+): largest difference from the reference (\S+), changed "
                       r"by the clip (\S+)$", run.log, flags=re.M)
    return {name: (float(difference), float(changed)) for name, difference, changed in found}


def _largest_logit(run) -> float:
    return float(re.search(r"^qk-clip: largest logit (\S+)$", run.log, flags=re.M).group(1))


@pytest.mark.parametrize("attention, optimizer", [("mla", "adam"), ("gqa", "adam"),
                                                   ("mla", "muon"), ("mla-mtp", "adam")])
def test_clip_scales_the_fp32_masters_as_qk_clip_does(attention, optimizer):
    """Every clipped weight's whole master (the two ranks' shards, or the owner's whole one under
    MuonClip's optimizer, `--optimizer muon --use-distributed-optimizer`) is the reference's, bit
    for bit; the decoder layer whose heads stay under the threshold is left as it is; the MTP
    layer's attention is clipped and its logits counted in the logged maximum."""
    run = launch(2, [attention, optimizer], script=WORKER, timeout=240).check()
    clipped = _clipped(run)
    assert len(clipped) == {"mla": 4, "gqa": 2, "mla-mtp": 6}[attention], run.log[-3000:]
    for name, (difference, changed) in clipped.items():
        assert difference == 0.0, name
        assert (changed > 1e-3) == ("decoder.layers.1." not in name), name
    assert _largest_logit(run) == (20.0 if attention == "mla-mtp" else 12.0)


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_a_head_under_the_threshold_is_left_as_it_is_whatever_its_logits_sign(attention):
    """A head (MLA) or query group (GQA) whose largest logit is negative, in a layer that clips:
    its rows are left as they are, the others scaled as the report scales them, bit for bit."""
    run = launch(2, [attention, "adam", "negative"], script=WORKER, timeout=240).check()
    clipped = _clipped(run)
    assert clipped and all(difference == 0.0 for difference, _ in clipped.values()), clipped


def test_unpatched_a_head_with_negative_logits_gets_nan_weights():
    """megatron-core 0.19.2 scales it by min(1, threshold / logit), negative: its query and key
    rows become NaN (a negative number's fractional power), the layer's masters off the
    reference; the run's NaN check would stop it at the next step."""
    run = launch(2, ["mla", "adam", "negative"], script=WORKER, timeout=240,
                 env={"MEGATRON_PATCHES_DISABLE": "qk-clip-negative-logits"}).check()
    first_layer = {name: values for name, values in _clipped(run).items()
                   if "decoder.layers.0." in name}
    assert len(first_layer) == 2, run.log[-3000:]
    assert all(math.isnan(difference) for difference, _ in first_layer.values()), first_layer


def test_unpatched_every_rank_dies_at_the_first_clip_under_the_distributed_optimizer():
    """megatron-core 0.19.2's clip_qk reshapes the flat shard as the whole weight: the rank that
    owns no part of a weight fails on its None master, the other on the shard's size."""
    run = launch(2, ["mla", "adam"], script=WORKER, timeout=240,
                 env={"MEGATRON_PATCHES_DISABLE": "qk-clip-distributed-optimizer"})
    assert run.returncode != 0
    assert "'NoneType' object has no attribute 'data'" in run.log, run.log[-3000:]
    assert "must match the size of tensor b" in run.log, run.log[-3000:]
    assert not _clipped(run)


def test_unpatched_the_mtp_layers_attention_is_neither_clipped_nor_logged():
    """megatron-core 0.19.2's clip_qk walks the decoder's layers only: the MTP layer's weights
    are left as they were and its logit of 20 is missing from the logged maximum, silently."""
    run = launch(2, ["mla-mtp", "adam"], script=WORKER, timeout=240,
                 env={"MEGATRON_PATCHES_DISABLE": "qk-clip-every-attention-layer"}).check()
    mtp = {name: values for name, values in _clipped(run).items() if ".mtp." in name}
    assert len(mtp) == 2 and all(difference > 1e-3 and changed == 0.0
                                 for difference, changed in mtp.values()), mtp
    assert _largest_logit(run) == 12.0


def test_megatron_fsdp_dies_at_the_first_clip_so_the_launcher_refuses_it():
    """Under Megatron-FSDP (optim_grads_params) megatron's clip views each rank's uneven DTensor
    shard as the whole weight, and both ranks die (one holds none of the weight): why preflight
    qk-clip-megatron-fsdp refuses --qk-clip with --use-megatron-fsdp before work
    (test_preflight.py)."""
    run = launch(2, ["mla", "fsdp"], script=WORKER, timeout=240)
    assert run.returncode != 0
    assert "is invalid for input of size 0" in run.log, run.log[-3000:]
    assert "multi_latent_attention.py" in run.log and "_clip_q_proj_weight" in run.log
    assert not _clipped(run)
