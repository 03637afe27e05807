"""--hybrid-layer-pattern builds megatron's HybridModel through the launcher, with the guarantees
of the GPT path: the census counts the pattern's layer families as built, checkpoints pass the
audit and resume bit-exactly, and a GPT checkpoint of the same weights gives the same loss.

Real pretrain() on CPU processes joined by gloo (moe_launcher/model/hybrid_spec.py's local stack
spec). FLOPs of hybrid patterns against torch's flop counter: tests/megatron_patches/accounting/test_flops.py;
here, the FLOPs a real run logs and checkpoints against the counter.
"""

import pytest
import torch

from _launch import TINY_MODEL, launch, printed_losses, tensorboard_scalars
from moe_launcher.checkpoint_files import audit as checkpoint_audit

K = 2  # iterations before the checkpoint; the runs go to 2K


def with_layers(flags: list[str], layers: int) -> list[str]:
    i = flags.index("--num-layers")
    return [*flags[:i + 1], str(layers), *flags[i + 2:]]


BASE = [*with_layers(TINY_MODEL, 4), "--moe-token-dispatcher-type", "alltoall",
        "--use-distributed-optimizer", "--ckpt-format", "torch_dist"]

# layout: (ranks, pattern, flags, the census line's family counts)
LAYOUTS = {
    # `|` segments, one per pipeline stage, and an MTP block (on the last stage).
    "pp2-segments-mtp": (2, "*E|*E/*E", ["--pipeline-model-parallel-size", "2",
                                         "--mtp-num-layers", "1"],
                         "layers per pipeline stage (2, 2); 2 attention, 0 dense MLP, 2 MoE in "
                         "the decoder; 1 MTP (1 attention, 0 dense MLP, 1 MoE)"),
    "ep2-dense-first": (2, "*-*E", ["--expert-model-parallel-size", "2"],
                        "layers per pipeline stage (4,); 2 attention, 1 dense MLP, 1 MoE"),
    "etp2": (2, "*E*E", ["--expert-tensor-parallel-size", "2"],
             "layers per pipeline stage (4,); 2 attention, 0 dense MLP, 2 MoE"),
}


def counted_flops(pattern: str) -> int:
    """torch's FlopCounterMode count of one iteration of BASE's model as `pattern` (forward +
    backward of the global batch, 8 x 64 tokens), with megatron's causal convention (the
    flops-from-layer-census docstring): half of the S x S matmuls. In this model those are the
    only batched matmuls (bmm/baddbmm in core attention; every linear layer is an mm)."""
    import _megatron_cpu as cpu
    from torch.utils.flop_counter import FlopCounterMode

    config = cpu.tiny_config(num_layers=len(pattern), ffn_hidden_size=128,
                             gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                             normalization="RMSNorm", num_moe_experts=8, moe_router_topk=2,
                             moe_ffn_hidden_size=64)
    model = cpu.build_hybrid(config, pattern, 64, vocab=512)
    with FlopCounterMode(display=False) as counter:
        cpu.train_step_loss(model, 8, 64).backward()
    ops = {str(op): count for op, count in counter.get_flop_counts()["Global"].items()}
    squares = ops.get("aten.bmm", 0) + ops.get("aten.baddbmm", 0)
    assert squares and squares % 2 == 0, ops
    return counter.get_total_flops() - squares // 2


def checkpointed_flops(checkpoint) -> tuple[float, object]:
    """megatron's FLOPs so far saved in a torch_dist checkpoint, and the args saved with it."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(checkpoint))
    return common["num_floating_point_operations_so_far"], common["args"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_trains_saves_audits_and_resumes_bit_exact(layout, tmp_path):
    nproc, pattern, flags, census = LAYOUTS[layout]
    common = [*BASE, *flags, "--hybrid-layer-pattern", pattern, "--train-iters", str(2 * K),
              "--save-interval", str(K)]
    full = launch(nproc, [*common, "--save", str(tmp_path / "full"),
                          "--tensorboard-dir", str(tmp_path / "tb_full")]).check()
    assert f"[megatron_patches] layer census: {census}" in full.log
    assert "building GPT model" not in full.log
    if "|" not in pattern and "/" not in pattern:  # the in-process model has no stages, no MTP
        # The FLOPs the run logs and checkpoints (flops-from-layer-census) are torch's count.
        flops = counted_flops(pattern)
        assert f"FLOPs per iteration: {flops}\n" in full.log, full.log[-4000:]
        assert checkpointed_flops(tmp_path / "full" / f"iter_{K:07d}")[0] == K * flops

    assert checkpoint_audit.main([str(tmp_path / "full" / f"iter_{K:07d}")]) == \
        checkpoint_audit.EXIT_COMPLETE

    resumed = launch(nproc, [*common, "--load", str(tmp_path / "full"), "--ckpt-step", str(K),
                             "--save", str(tmp_path / "resumed"),
                             "--tensorboard-dir", str(tmp_path / "tb_resumed")]).check()
    assert f"successfully loaded checkpoint from {tmp_path / 'full'}" in resumed.log
    uninterrupted = tensorboard_scalars(tmp_path / "tb_full", "lm loss")
    after_resume = tensorboard_scalars(tmp_path / "tb_resumed", "lm loss")
    assert sorted(after_resume) == list(range(K + 1, 2 * K + 1))
    for iteration, loss in after_resume.items():
        assert loss == uninterrupted[iteration], (iteration, loss, uninterrupted[iteration])
    for run, written in ((full, uninterrupted), (resumed, after_resume)):
        assert printed_losses(run.log) == {i: f"{loss:.6E}" for i, loss in written.items()}


@pytest.mark.slow
def test_unpatched_run_logs_megatron_flops_and_averages_its_second_loss(tmp_path):
    """Two bugs of megatron-core 0.19.2 in one launch (each costs a run): without
    flops-from-layer-census a hybrid run counts FLOPs with megatron's formula (no router), and
    without first-log-interval-reset its second line prints the mean of iterations 1 and 2."""
    patches = ("flops-from-layer-census", "first-log-interval-reset")
    run = launch(1, [*BASE, "--hybrid-layer-pattern", "*E*E", "--train-iters", "2",
                     "--save-interval", "2", "--save", str(tmp_path / "ckpt"),
                     "--tensorboard-dir", str(tmp_path / "tb")],
                 env={"MEGATRON_PATCHES_DISABLE": ",".join(patches)}).check()
    for patch in patches:
        assert f"{patch}: skipped (disabled by MEGATRON_PATCHES_DISABLE)" in run.log

    from megatron.training import training

    from megatron_patches.registry import unwrapped
    saved, args = checkpointed_flops(tmp_path / "ckpt" / "iter_0000002")
    megatron = unwrapped(training.num_floating_point_operations)(args, args.global_batch_size)
    counted = counted_flops("*E*E")
    assert "FLOPs per iteration" not in run.log
    assert saved == 2 * megatron and megatron != counted, (saved, megatron, counted)

    losses = tensorboard_scalars(tmp_path / "tb", "lm loss")
    printed = printed_losses(run.log)
    mean = (torch.tensor([0.0]) + losses[1] + losses[2]).item() / 2  # megatron's float32 sums
    assert printed == {1: f"{losses[1]:.6E}", 2: f"{mean:.6E}"}, (printed, losses)
    assert printed[2] != f"{losses[2]:.6E}"


@pytest.mark.slow
def test_gpt_checkpoint_gives_the_hybrid_model_the_same_loss(tmp_path):
    """A 2-layer MoE GPT is the pattern *E*E: megatron's GPT-to-Hybrid loading
    (gpt_checkpoint_interop) reads the launcher's GPT checkpoint into the HybridModel, whose
    first loss (the weights at the checkpoint, on the same batch) equals the GPT run's."""
    common = [*TINY_MODEL, "--moe-token-dispatcher-type", "alltoall",
              "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
              "--train-iters", str(K + 1)]
    launch(1, [*common, "--save", str(tmp_path / "gpt"), "--save-interval", str(K),
               "--tensorboard-dir", str(tmp_path / "tb_gpt")]).check()
    # The optimizer state of a dp_reshardable checkpoint does not carry over (megatron refuses
    # it), so the hybrid run starts a fresh optimizer: only its first step's loss is comparable.
    hybrid = launch(1, [*with_layers(common, 4), "--hybrid-layer-pattern", "*E*E",
                        "--load", str(tmp_path / "gpt"), "--ckpt-step", str(K),
                        "--no-load-optim", "--tensorboard-dir", str(tmp_path / "tb_hybrid")]).check()
    assert "loading a GPT checkpoint into the hybrid model" in hybrid.log
    gpt_loss = tensorboard_scalars(tmp_path / "tb_gpt", "lm loss")[K + 1]
    hybrid_loss = tensorboard_scalars(tmp_path / "tb_hybrid", "lm loss")[K + 1]
    assert hybrid_loss == gpt_loss


def test_planner_prints_no_gpt_estimates_for_a_hybrid_pattern(capsys):
    """The dry-run planner's parameter/memory/FLOPs estimates count GPT layers: for a pattern it
    validates the flags with megatron and says the estimates are not modelled."""
    import sys

    from _launch import REPO
    sys.path.insert(0, str(REPO / "examples" / "moe"))
    import plan

    assert plan.main(["--world-size", "2", "--", *BASE, "--train-iters", "2",
                      "--hybrid-layer-pattern", "*E|*E", "--pipeline-model-parallel-size",
                      "2"]) == 0
    out = capsys.readouterr().out
    assert "not modelled for HybridModel" in out and "FLOPs per iteration" not in out


def test_census_of_a_built_hybrid_model_is_checked_against_the_pattern():
    import _megatron_cpu as cpu

    from moe_launcher.model.layer_layout import census_of_model, check_hybrid_census
    from moe_launcher.runtime.refusals import LayerLayoutError

    config = cpu.tiny_config(num_layers=4, num_moe_experts=4, moe_router_topk=2)
    census = census_of_model([cpu.build_hybrid(config, "*-*E", 32)])
    check_hybrid_census(census, "*-*E", pipeline=1)
    with pytest.raises(LayerLayoutError, match=r"dense: built 1, the pattern has 0"):
        check_hybrid_census(census, "*E*E", pipeline=1)
    with pytest.raises(LayerLayoutError, match=r"per stage: built \(4,\), the pattern has \(2, 2\)"):
        check_hybrid_census(census, "*-|*E", pipeline=2)

    mla = cpu.tiny_config(num_layers=2, num_moe_experts=4, moe_router_topk=2,
                          multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16,
                          qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
    check_hybrid_census(census_of_model([cpu.build_hybrid(mla, "+E", 32)]), "+E", pipeline=1)
