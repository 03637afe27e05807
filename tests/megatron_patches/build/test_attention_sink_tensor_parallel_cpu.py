"""Patch attention-sink-tensor-parallel (issue 43, Megatron-LM #7452 finding 8): a model with
learnable attention sinks (`--softmax-type learnable`, gpt-oss) saves at TP2 + SP and resumes at
TP2 and at TP1 with the uninterrupted run's losses. Without the patch the checkpoint guard, which
takes the parameter's tensor-parallel mark as the truth, refuses the first save although the
checkpoint would be complete: a save interval's work lost, and no checkpoint above TP1.
"""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, tensorboard_scalars
from _unpatched import apply_all, leave_out

NAME = "attention-sink-tensor-parallel"
K = 2
SINKS = [*TINY_MODEL, "--softmax-type", "learnable", "--train-iters", str(2 * K),
         "--save-interval", str(K), "--ckpt-format", "torch_dist"]  # (plain optimizer: its
# state reshards to TP1; megatron's distributed one saved dp_reshardable does not)
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def offsets(model) -> list:
    return [p for name, p in model.named_parameters() if name.endswith("softmax_offset")]


def test_the_built_offsets_carry_the_mark_their_sharding_declares(monkeypatch):
    import _megatron_cpu as cpu
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    apply_all()
    config = cpu.tiny_config(softmax_type="learnable")
    built = offsets(cpu.build_gpt(config, seq_length=16))
    assert len(built) == 2
    assert all((p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 0, 1)
               for p in built)
    leave_out(monkeypatch, NAME, DotProductAttention, "__init__")
    assert not any(getattr(p, "tensor_model_parallel", False)
                   for p in offsets(cpu.build_gpt(config, seq_length=16)))


def test_unpatched_a_tp2_run_that_saves_is_refused_before_iteration_1(tmp_path):
    run = launch(2, [*SINKS, *TP2, "--train-iters", str(K), "--save", str(tmp_path / "ckpt")],
                 env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert run.exit_codes == [1, 1], run.log[-3000:]
    errors = [line for line in run.log.splitlines() if "pretrain_moe: error:" in line]
    assert len(errors) == 1 and "softmax_offset" in errors[0], run.log[-3000:]
    assert "refusing to checkpoint" in errors[0]
    # judged when megatron built the model (checkpoint-completeness-guard), not at the save
    assert "iteration        1/" not in run.log and not (tmp_path / "ckpt").exists()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("sinks")
    launch(2, [*SINKS, *TP2, "--save", str(root / "ckpt"),
               "--tensorboard-dir", str(root / "tb")]).check()
    return root


@pytest.mark.parametrize("nproc,layout", [(2, TP2), (1, [])], ids=["tp2", "tp1"])
def test_a_tp2_checkpoint_resumes_with_the_uninterrupted_losses(uninterrupted, nproc, layout,
                                                                tmp_path):
    launch(nproc, [*SINKS, *layout, "--load", str(uninterrupted / "ckpt"), "--ckpt-step", str(K),
                   "--tensorboard-dir", str(tmp_path / "tb")]).check()
    before = tensorboard_scalars(uninterrupted / "tb", "lm loss")
    after = tensorboard_scalars(tmp_path / "tb", "lm loss")
    assert sorted(after) == list(range(K + 1, 2 * K + 1))
    if nproc == 2:  # the same layout: to the last bit (each rank's own offsets came back)
        assert after == {i: before[i] for i in after}
    else:  # one rank sums in another order (bf16): the same to 1e-5
        assert all(after[i] == pytest.approx(before[i], rel=1e-5) for i in after), (after, before)
