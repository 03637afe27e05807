"""--moe-router-load-balancing-type global_aux_loss trains at its coefficient at any data-parallel
size (patch global-aux-loss-dp-scale, Megatron-LM issue #3672): on the same weights and global
batch, the router gradients megatron finalizes with DP1 and with DP2 agree. With the patch left
out (MEGATRON_PATCHES_DISABLE) DP2 takes half the global aux loss gradient: its router gradient
is the main loss's plus 1/DP of DP1's aux-loss part, the aux-loss part being measured as DP1's
gradient minus that of the same step at --moe-aux-loss-coeff 0 (fp32, one micro-batch per rank,
real pretrain() runs).

The CPU backend's initial weights depend on the world size, so every run starts from the DP1
run's iteration-1 checkpoint and all compare their iteration-2 gradients."""

from pathlib import Path

import pytest
import torch

from _launch import TINY_MODEL, launch

REPO = Path(__file__).resolve().parents[3]
OBSERVED = REPO / "tests" / "_observed_launch.py"
PATCH = "global-aux-loss-dp-scale"
GLOBAL_BATCH = 8


def flags(micro_batch_size: int, coeff: str = "1.0") -> list[str]:
    args = [a for a in TINY_MODEL if a != "--bf16"]  # fp32: DP1 and DP2 agree to rounding
    args[args.index("--micro-batch-size") + 1] = str(micro_batch_size)
    args[args.index("--moe-aux-loss-coeff") + 1] = coeff  # 1.0: the aux-loss share is not noise
    return [*args, "--moe-router-load-balancing-type", "global_aux_loss",
            "--moe-token-dispatcher-type", "alltoall"]


def run(directory: Path, dp: int, args: list[str], coeff: str = "1.0",
        patched: bool = True) -> dict[str, torch.Tensor]:
    grad_dir = directory / f"grads_dp{dp}_coeff{coeff}_{'patched' if patched else 'unpatched'}"
    grad_dir.mkdir()
    env = {"GRAD_DIR": str(grad_dir), "MEGATRON_PATCHES_DISABLE": "" if patched else PATCH}
    log = launch(dp, [*flags(GLOBAL_BATCH // dp, coeff), *args], env=env,
                 script=OBSERVED).check().log
    status = "applied" if patched else "skipped (disabled by MEGATRON_PATCHES_DISABLE)"
    assert f"[megatron_patches] {PATCH}: {status}" in log, log[-3000:]
    grads = torch.load(grad_dir / "grads_rank0.pt")  # the last iteration's
    assert len(grads) == 2, log[-3000:]  # one router per layer
    return grads


@pytest.fixture(scope="module")
def dp1(tmp_path_factory):
    """The DP1 run: its iteration-2 router gradients and its iteration-1 checkpoint."""
    directory = tmp_path_factory.mktemp("global_aux_loss")
    checkpoint = str(directory / "ckpt")
    grads = run(directory, 1, ["--train-iters", "2", "--save", checkpoint, "--save-interval", "1"])
    return directory, grads, ["--train-iters", "2", "--load", checkpoint, "--ckpt-step", "1"]


@pytest.mark.slow
def test_router_gradients_agree_between_dp1_and_dp2(dp1):
    directory, dp1_grads, resume = dp1
    dp2 = run(directory, 2, resume)
    for name, grad in dp1_grads.items():
        torch.testing.assert_close(dp2[name], grad, rtol=1e-4, atol=1e-7,
                                   msg=lambda m: f"{name}: DP2 router gradient != DP1: {m}")


@pytest.mark.slow
def test_unpatched_dp2_takes_half_the_aux_loss_gradient(dp1):
    directory, dp1_grads, resume = dp1
    unpatched = run(directory, 2, resume, patched=False)
    main_only = run(directory, 1, resume, coeff="0")  # the same step without the aux loss
    for name, grad in dp1_grads.items():
        aux = grad - main_only[name]
        got = unpatched[name] - main_only[name]
        share = torch.dot(got.flatten(), aux.flatten()) / aux.square().sum()
        print(f"{name}: |aux grad| / |grad| {aux.norm() / grad.norm():.3f}, unpatched DP2 takes "
              f"{share:.4f} of it")
        assert aux.norm() > 0.1 * grad.norm()  # the aux loss is a real part of the gradient
        torch.testing.assert_close(got, aux / 2, rtol=1e-3, atol=1e-3 * aux.abs().max().item(),
                                   msg=lambda m: f"{name}: unpatched DP2 aux gradient != DP1/2: {m}")
