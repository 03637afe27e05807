"""The CPU backend's virtual CUDA device draws from a generator of its own, as a GPU does: the
CPU generator moves only for draws a GPU would make on the host, so a restore of one state
cannot pass for a restore of the other, and megatron's JIT warm-up (`device="cuda"` draws sized
by --micro-batch-size) leaves the CPU generator, which --use-cpu-initialization draws the
weights from, where the seed put it.

The reference is torch's own behaviour on a GPU: `torch.manual_seed` seeds both generators,
`torch.cuda.get/set_rng_state` touch only the device's, a `device="cuda"` draw or a dropout of a
device tensor moves only the device's, a draw into a tensor made without a device only the
CPU's. Where users meet it: the first iteration's loss of two runs that differ only in how the
same global batch is cut into micro-batches."""

import types

import pytest
import torch

from _launch import TINY_MODEL, launch, tensorboard_scalars


def _states():
    return torch.get_rng_state(), torch.cuda.get_rng_state()


def _moved(before, after):
    return tuple(not torch.equal(b, a) for b, a in zip(before, after))


def test_device_draws_move_only_the_device_generator():
    torch.manual_seed(7)
    before = _states()
    torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
    torch.randn(4, device=torch.cuda.current_device())
    torch.nn.init.normal_(torch.empty(4, 4, device="cuda"))
    torch.ones(8).cuda().uniform_()
    assert _moved(before, _states()) == (False, True)

    before = _states()
    torch.nn.init.normal_(torch.empty(4, 4))  # --use-cpu-initialization's master weights
    torch.rand(3)
    torch.ones(8).cuda().cpu().bernoulli_(0.5)
    assert _moved(before, _states()) == (True, False)


def test_each_state_restores_only_its_own_stream():
    torch.manual_seed(7)
    host, device = _states()
    first = torch.rand(4), torch.rand(4, device="cuda")
    assert not torch.equal(*first)  # one seed, two streams (two algorithms on a GPU)

    torch.cuda.set_rng_state(device)  # the device's state alone: its draws repeat, the host's not
    again = torch.rand(4), torch.rand(4, device="cuda")
    assert not torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])

    torch.set_rng_state(host)  # the host's state alone
    again = torch.rand(4), torch.rand(4, device="cuda")
    assert torch.equal(again[0], first[0]) and not torch.equal(again[1], first[1])


def _warmup_args(micro_batch_size: int) -> types.SimpleNamespace:
    # What megatron's _warmup_jit_function reads of its arguments, for TINY_MODEL's shapes.
    return types.SimpleNamespace(
        bf16=False, fp16=False, swiglu=True, ffn_hidden_size=128, hidden_size=64,
        seq_length=64, micro_batch_size=micro_batch_size, tensor_model_parallel_size=1,
        context_parallel_size=1, sequence_parallel=False)


def _states_after_warmup(micro_batch_size: int):
    from megatron.training import global_vars, training

    saved = global_vars._GLOBAL_ARGS
    global_vars._GLOBAL_ARGS = _warmup_args(micro_batch_size)
    try:
        torch.manual_seed(1234)
        training.set_jit_fusion_options(tp_size=1)  # megatron's own, unwrapped
        return _states()
    finally:
        global_vars._GLOBAL_ARGS = saved


def test_megatrons_warmup_moves_the_device_generator_only():
    torch.manual_seed(1234)
    seeded_host, seeded_device = _states()
    one, two = _states_after_warmup(1), _states_after_warmup(2)
    assert torch.equal(one[0], seeded_host) and torch.equal(two[0], seeded_host)
    # on the device by an amount set by the micro-batch size, as on a GPU
    assert not torch.equal(one[1], seeded_device) and not torch.equal(one[1], two[1])


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
