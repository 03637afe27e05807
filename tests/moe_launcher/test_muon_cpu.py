"""megatron's Muon (`--optimizer muon`, emerging-optimizers' Newton-Schulz orthogonalisation of
each weight matrix's update) on the launcher, and its update independent of the layout.

The reference is the same model trained on one rank, where every matrix is whole: a run whose
dense and expert matrices are split over two tensor-parallel ranks must log its losses. With
megatron-core 0.19.2's default `--muon-tp-mode blockwise` it does not (each rank orthogonalises
its own shard); the launcher's default `duplicated` (platform_defaults) does. fp32, with the
Newton-Schulz matmuls at full fp32 precision (`--muon-fp32-matmul-prec high`: the default
`medium` lets the CPU's matmuls round through bf16, which blurs a comparison at 1e-6)."""

from __future__ import annotations

import re

from _launch import TINY_MODEL, launch

MUON = [*[arg for arg in TINY_MODEL if arg != "--bf16"], "--optimizer", "muon",
        "--muon-fp32-matmul-prec", "high", "--lr", "1e-2", "--min-lr", "1e-2",
        "--train-iters", "4"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # experts at ETP 2 too
DEFAULT_LINE = "[pretrain_moe] default --muon-tp-mode duplicated:"


def _losses(log: str) -> list[float]:
    found = [float(value) for value in re.findall(r"iteration +\d+/ +4 \|.*? lm loss: ([0-9.E+-]+)",
                                                   log)]
    assert len(found) == 4, log[-4000:]
    return found


def test_muon_trains_the_same_model_at_tp2_as_on_one_rank():
    """TP2 x SP (dense and expert matrices split): the one-rank run's losses at every step
    (1e-6), with the default saying so; megatron's own blockwise default leaves them from the
    second update on (above 1e-3)."""
    reference = launch(1, MUON).check()
    assert DEFAULT_LINE not in reference.log  # nothing is split on one rank
    split = launch(2, [*MUON, *TP2]).check()
    assert DEFAULT_LINE in split.log, split.log[-4000:]
    blockwise = launch(2, [*MUON, *TP2, "--muon-tp-mode", "blockwise"]).check()
    assert DEFAULT_LINE not in blockwise.log  # the user's choice stands

    expected = _losses(reference.log)
    for got, want in zip(_losses(split.log), expected):
        assert abs(got - want) <= 1e-6 * abs(want), (_losses(split.log), expected)
    apart = [abs(got - want) / abs(want) for got, want in zip(_losses(blockwise.log), expected)]
    assert apart[0] == 0 and max(apart[2:]) > 1e-3, apart


def test_muon_under_the_distributed_optimizer_resumes_exactly(tmp_path):
    """bf16 with --use-distributed-optimizer, as GPU runs train (megatron then gives Muon's
    matrices its layer-wise distributed optimizer), at DP2 x EP2: a run stopped after its
    checkpoint at iteration 2 and resumed logs the uninterrupted run's losses at 3 and 4,
    bit for bit (Muon's momentum and the scalar parameters' Adam state come back)."""
    run = [*TINY_MODEL, "--optimizer", "muon", "--lr", "1e-2", "--min-lr", "1e-2",
           "--train-iters", "4", "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
           "--expert-model-parallel-size", "2"]
    uninterrupted = _losses(launch(2, run).check().log)
    saving = [*run, "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    launch(2, [*saving, "--exit-interval", "2"]).check()
    resumed = launch(2, [*saving, "--load", str(tmp_path / "ckpt")]).check()
    assert "loading distributed checkpoint from" in resumed.log, resumed.log[-3000:]
    losses = re.findall(r"iteration +(\d+)/ +4 \|.*? lm loss: ([0-9.E+-]+)", resumed.log)
    assert [int(i) for i, _ in losses] == [3, 4], resumed.log[-3000:]
    assert [float(value) for _, value in losses] == uninterrupted[2:]
