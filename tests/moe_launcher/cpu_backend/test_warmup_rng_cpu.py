"""The CPU backend keeps megatron's JIT warm-up off the generator the CPU initialisation draws
from, so the initial weights do not depend on --micro-batch-size (as on a GPU, where the
warm-up's `device="cuda"` draws move only the CUDA generator).

The bug is shown on megatron's own set_jit_fusion_options (the function the backend wraps),
and its absence where users meet it: the first iteration's loss of two runs that differ only
in how the same global batch is cut into micro-batches."""

import types

import pytest
import torch

from _launch import TINY_MODEL, launch, tensorboard_scalars


def _warmup_args(micro_batch_size: int) -> types.SimpleNamespace:
    # What megatron's _warmup_jit_function reads of its arguments, for TINY_MODEL's shapes.
    return types.SimpleNamespace(
        bf16=False, fp16=False, swiglu=True, ffn_hidden_size=128, hidden_size=64,
        seq_length=64, micro_batch_size=micro_batch_size, tensor_model_parallel_size=1,
        context_parallel_size=1, sequence_parallel=False)


def _draw_after_warmup(set_jit_fusion_options, micro_batch_size: int) -> torch.Tensor:
    from megatron.training import global_vars

    saved = global_vars._GLOBAL_ARGS
    global_vars._GLOBAL_ARGS = _warmup_args(micro_batch_size)
    try:
        torch.manual_seed(1234)
        set_jit_fusion_options(tp_size=1)
        return torch.rand(8)
    finally:
        global_vars._GLOBAL_ARGS = saved


def test_the_warmup_leaves_the_cpu_generator_where_the_seed_put_it():
    from megatron.training import training

    megatron_warmup = training.set_jit_fusion_options.__wrapped__
    # megatron's warm-up alone moves the one generator, by an amount set by the micro-batch size
    assert not torch.equal(_draw_after_warmup(megatron_warmup, 1),
                           _draw_after_warmup(megatron_warmup, 2))
    torch.manual_seed(1234)
    seeded = torch.rand(8)
    for micro_batch_size in (1, 2):
        assert torch.equal(_draw_after_warmup(training.set_jit_fusion_options, micro_batch_size),
                           seeded)


def _first_loss(tmp_path, micro_batch_size: int) -> float:
    flags = [a for a in TINY_MODEL if a != "--bf16"]  # fp32: only summation order differs
    flags[flags.index("--micro-batch-size") + 1] = str(micro_batch_size)
    board = tmp_path / f"tb{micro_batch_size}"
    launch(1, [*flags, "--train-iters", "1", "--tensorboard-dir", str(board)]).check()
    return tensorboard_scalars(board, "lm loss")[1]


@pytest.mark.slow
def test_the_first_loss_does_not_depend_on_the_micro_batch_size(tmp_path):
    # The same 8 sequences as 4 micro-batches of 2 and as 1 of 8: the same weights give the
    # same mean loss up to fp32 rounding; other initial weights move it by ~1e-3 or more.
    two, eight = _first_loss(tmp_path, 2), _first_loss(tmp_path, 8)
    assert abs(two - eight) <= 1e-5 * abs(eight), (two, eight)
