"""Megatron-FSDP keeps every micro-batch's weight gradients, checked on megatron-core 0.19.x
through pretrain_moe.py (2 CPU ranks, gloo).

Megatron-LM PR #6357 (merged after the 0.19 branch) found that Megatron-FSDP told Transformer
Engine to overwrite `main_grad` under every sharding strategy; under `optim` that is the
persistent, unsharded buffer gradients accumulate in, so with fused gradient accumulation only
the last micro-batch's weight gradients survive. Fused accumulation needs TE on a GPU
(test_fused_accumulation_keeps_every_micro_batch, skipped without CUDA). On CPU the launcher
runs the unfused path, where the same buffers add up `param.grad` after each backward. On it
megatron-core 0.19.2 loses nothing under `optim` and `no_shard`, but under `optim_grads` /
`optim_grads_params` a gradient buffer whose data-parallel group has one rank (here the
experts', EP2 on 2 ranks) is rescaled by 1/DP at every micro-batch (Megatron-LM #6660): the
patch fsdp-one-rank-grad-scaling. Without it the `optim_grads_params` case fails, each expert
gradient off by 0.2-0.3 of its norm (the first micro-batch's share halved), dense ones exact.

Each case trains one iteration on the same 8 sequences: as 2 micro-batches of 2 per rank and as
one micro-batch of 4 per rank. megatron's sampler gives rank 0 sequences 0,1,4,5 in the first
run and 0-3 in the second, so the per-rank gradients differ and only their data-parallel
reduction is the gradient of all 8: what is compared is what each rank's optimizer steps with
(its shard after megatron's reduction; tests/_observed_launch.py). The dense weights are
reduced over DP2, the expert weights (EP2) over their one-rank expert-DP group. The
one-micro-batch run reduces optim/no_shard gradients once after the backward pass (megatron's
default); the accumulating run reduces them in the backward hooks of the last micro-batch
(--overlap-grad-reduce; optim_grads_params always reduces there, after every backward).

* Same weights: megatron's JIT warm-up draws tensors sized by --micro-batch-size from the
  device's generator, which the CPU initialisation does not read, on the CPU backend as on a GPU
  (tests/moe_launcher/cpu_backend/test_device_generator_cpu.py).
* --moe-aux-loss-coeff 0: the load-balancing loss is computed per micro-batch from that
  micro-batch's routing statistics, so it is not additive over micro-batches and its gradient
  rightly differs between the two splits.
* fp32 (no --bf16), which needs the CPU backend's bridge for Megatron-FSDP's PREMUL_SUM gradient
  division: the two splits then differ only in summation order (two weight-gradient GEMMs over
  128 tokens added in fp32 against one over 256), measured at most 4e-7 of each gradient's norm;
  the tolerance is 1e-5. With --bf16 each micro-batch's gradient is rounded to bf16 (8 bits)
  before it is accumulated: 4e-3 measured (`optim`), which would allow only ~1e-2. A lost
  micro-batch moves a gradient by about half its norm or more (half the tokens' contribution),
  so either would show it.
"""

import json
from pathlib import Path

import pytest
import torch

from _launch import TINY_MODEL, launch
from _required import transformer_engine_missing

REPO = Path(__file__).resolve().parents[3]
OBSERVED = REPO / "tests" / "_observed_launch.py"
GLOBAL_BATCH = 8
TOLERANCE = 1e-5  # of each gradient's norm; see the module docstring


def reduced_grads(tmp_path: Path, tag: str, nproc: int, micro_batch: int, args: list[str],
                  torchrun: bool = False, env: dict | None = None) -> list[dict[str, torch.Tensor]]:
    """Per rank: parameter name -> the fp32 gradient megatron hands the optimizer at
    iteration 1 (and, in tmp_path/tag, each rank's overwrite_main_grad flags)."""
    flags = [a for a in TINY_MODEL if a != "--bf16"]
    flags[flags.index("--micro-batch-size") + 1] = str(micro_batch)
    flags[flags.index("--global-batch-size") + 1] = str(GLOBAL_BATCH)
    flags[flags.index("--moe-aux-loss-coeff") + 1] = "0"
    grad_dir = tmp_path / tag
    grad_dir.mkdir()
    log = launch(nproc, [*flags, "--use-megatron-fsdp", "--use-distributed-optimizer",
                         "--ckpt-format", "fsdp_dtensor", "--train-iters", "1", *args],
                 env={"GRAD_DIR": str(grad_dir), "GRAD_NAMES": ".", **(env or {})},
                 script=OBSERVED, torchrun=torchrun, timeout=300).check().log
    grads = [torch.load(grad_dir / f"grads_rank{rank}.pt") for rank in range(nproc)]
    assert all(len(rank_grads) > 20 for rank_grads in grads), log[-3000:]
    return grads


def assert_same_gradients(accumulated, one_batch, what: str, tolerance: float) -> None:
    for rank, (mine, reference) in enumerate(zip(accumulated, one_batch)):
        assert mine.keys() == reference.keys()
        for name, grad in reference.items():
            if grad.numel() == 0:  # an empty shard on this rank
                continue
            error = (mine[name].double() - grad.double()).norm() / grad.double().norm()
            assert error <= tolerance, (
                f"rank {rank} {name}: {what} differs from one micro-batch of the same tokens "
                f"by {error:.3g} of its norm (tolerance {tolerance:g})")


def overwrite_flags(tmp_path: Path, tag: str, nproc: int) -> list[dict[str, bool | None]]:
    return [json.loads((tmp_path / tag / f"overwrite_rank{rank}.json").read_text())
            for rank in range(nproc)]


def sharded_grad_buffer(strategy: str, name: str) -> bool | None:
    """Whether the parameter's gradient buffer is sharded in this layout (None: Megatron-FSDP
    gathers nothing under no_shard, so no flag is set): the dense ones under optim_grads_params
    over DP2; the experts' never, their expert-DP group (EP2 on 2 ranks) having one rank."""
    if strategy == "no_shard":
        return None
    return strategy == "optim_grads_params" and ".experts." not in name


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim", "no_shard", "optim_grads_params"])
def test_micro_batches_accumulate_like_one_batch(strategy, tmp_path):
    """Also PR #6357's flag (fsdp-fused-wgrad-accumulation): with the patch each gathered
    parameter tells TE to overwrite `main_grad` only where its gradient buffer is sharded;
    megatron's own (the one-micro-batch run, without the patch: the flag changes nothing on
    the unfused CPU path) tells every one, so fused accumulation would keep only the last
    micro-batch of `optim`'s dense weights and of the experts under every strategy."""
    layout = ["--data-parallel-sharding-strategy", strategy,
              "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    one_batch = reduced_grads(tmp_path, "one", 2, GLOBAL_BATCH // 2, layout,
                              env={"MEGATRON_PATCHES_DISABLE": "fsdp-fused-wgrad-accumulation"})
    accumulated = reduced_grads(tmp_path, "two", 2, GLOBAL_BATCH // 4,
                                [*layout, "--overlap-grad-reduce"])
    assert_same_gradients(accumulated, one_batch, "2 micro-batches", TOLERANCE)

    for flags in overwrite_flags(tmp_path, "two", 2):
        assert len(flags) > 20
        assert flags == {name: sharded_grad_buffer(strategy, name) for name in flags}, flags
    for flags in overwrite_flags(tmp_path, "one", 2):
        assert set(flags.values()) == ({None} if strategy == "no_shard" else {True}), flags


def relative_errors(accumulated, one_batch) -> dict[str, float]:
    """Rank 0's parameters: how far the accumulated gradient is from one micro-batch's, as a
    fraction of its norm."""
    return {name: float((accumulated[0][name].double() - grad.double()).norm()
                        / grad.double().norm())
            for name, grad in one_batch[0].items() if grad.numel()}


@pytest.mark.slow
def test_without_one_rank_scaling_the_experts_lose_earlier_micro_batches(tmp_path):
    """fsdp-one-rank-grad-scaling left out (Megatron-LM #6660): under optim_grads_params the
    experts' one-rank gradient buffers are rescaled by 1/DP at every micro-batch, so with two
    micro-batches the first one's share is halved; the dense weights (DP2) are exact."""
    layout = ["--data-parallel-sharding-strategy", "optim_grads_params",
              "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    one_batch = reduced_grads(tmp_path, "one", 2, GLOBAL_BATCH // 2, layout)
    unpatched = reduced_grads(tmp_path, "two", 2, GLOBAL_BATCH // 4,
                              [*layout, "--overlap-grad-reduce"],
                              env={"MEGATRON_PATCHES_DISABLE": "fsdp-one-rank-grad-scaling"})
    errors = relative_errors(unpatched, one_batch)
    experts = {name: error for name, error in errors.items() if ".experts." in name}
    dense = {name: error for name, error in errors.items() if ".experts." not in name}
    assert experts and min(experts.values()) > 0.05, experts  # measured 0.2-0.3
    assert max(dense.values()) <= TOLERANCE, dense


@pytest.mark.gpu
@pytest.mark.skipif(transformer_engine_missing() is not None,
                    reason=transformer_engine_missing() or "")
@pytest.mark.parametrize("strategy", ["optim", "no_shard", "optim_grads_params"])
def test_fused_accumulation_keeps_every_micro_batch(strategy, tmp_path):
    """PR #6357's case, unverified so far: on one GPU the launcher picks TE layers with fused
    gradient accumulation (megatron's default), so TE writes weight gradients into `main_grad`
    itself. One rank, so 4 micro-batches of 2 against one of 8. fp32 like the CPU test; GPU
    GEMMs of other shapes may sum in another order, hence a looser tolerance (1e-4)."""
    layout = ["--data-parallel-sharding-strategy", strategy]
    one_batch = reduced_grads(tmp_path, "one", 1, GLOBAL_BATCH, layout, torchrun=True)
    accumulated = reduced_grads(tmp_path, "four", 1, GLOBAL_BATCH // 4, layout, torchrun=True)
    assert_same_gradients(accumulated, one_batch, "4 micro-batches (fused accumulation)", 1e-4)
