"""--moe-router-load-balancing-type global_aux_loss trains at its coefficient at any data-parallel
size (patch global-aux-loss-dp-scale, Megatron-LM issue #3672): on the same weights and global
batch, the router gradients megatron finalizes with DP1 and with DP2 agree. Unpatched, DP2
takes half the global aux loss gradient (fp32, one micro-batch per rank, real pretrain() runs).

The CPU backend's initial weights depend on the world size, so the DP2 run starts from the
DP1 run's iteration-1 checkpoint and both compare their iteration-2 gradients."""

from pathlib import Path

import pytest
import torch

from _launch import TINY_MODEL, launch

REPO = Path(__file__).resolve().parents[3]
OBSERVED = REPO / "tests" / "_observed_launch.py"
GLOBAL_BATCH = 8


def flags(micro_batch_size: int) -> list[str]:
    args = [a for a in TINY_MODEL if a != "--bf16"]  # fp32: DP1 and DP2 agree to rounding
    args[args.index("--micro-batch-size") + 1] = str(micro_batch_size)
    args[args.index("--moe-aux-loss-coeff") + 1] = "1.0"  # the aux-loss share is not noise
    return [*args, "--moe-router-load-balancing-type", "global_aux_loss",
            "--moe-token-dispatcher-type", "alltoall"]


def run(tmp_path: Path, dp: int, args: list[str]) -> dict[str, torch.Tensor]:
    grad_dir = tmp_path / f"grads_dp{dp}"
    grad_dir.mkdir()
    log = launch(dp, [*flags(GLOBAL_BATCH // dp), *args], env={"GRAD_DIR": str(grad_dir)},
                 script=OBSERVED).check().log
    grads = torch.load(grad_dir / "grads_rank0.pt")  # the last iteration's
    assert len(grads) == 2, log[-3000:]  # one router per layer
    return grads


@pytest.mark.slow
def test_router_gradients_agree_between_dp1_and_dp2(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    dp1 = run(tmp_path, 1, ["--train-iters", "2", "--save", checkpoint, "--save-interval", "1"])
    dp2 = run(tmp_path, 2, ["--train-iters", "2", "--load", checkpoint, "--ckpt-step", "1"])
    for name, grad in dp1.items():
        torch.testing.assert_close(dp2[name], grad, rtol=1e-4, atol=1e-7,
                                   msg=lambda m: f"{name}: DP2 router gradient != DP1: {m}")
