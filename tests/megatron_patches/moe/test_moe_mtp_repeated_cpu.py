"""A repeated MTP layer (--mtp-use-repeated-layer) with MoE, on a real megatron-core GPT on CPU:
the logged aux loss is averaged over the MoE layers built, the repeated one counted once
(moe-aux-loss-per-built-layer), and its router's z-loss gradient is the logged z-loss's, i.e.
divided by the depths (moe-mtp-repeated-z-loss). megatron-core 0.19.2 divides by 2 decoder
layers + mtp_num_layers, and applies the full z-loss gradient once per depth: with moe-mtp-repeated-z-loss left
out (megatron's own TopKRouter.apply_z_loss) the MTP router's gradient is DEPTHS times the one
of the logged z-loss."""

from pathlib import Path

import pytest
import torch

import _unpatched

import _megatron_cpu as cpu
from megatron_patches import registry
from moe_launcher.model import built_model

DEPTHS = 2
SEQ = 16


def _repeated_mtp_model(**overrides):
    registry.load_patches()
    config = cpu.tiny_config(num_layers=2, num_moe_experts=4, moe_router_topk=2,
                             mtp_num_layers=DEPTHS, mtp_use_repeated_layer=True, **overrides)
    model = cpu.build_gpt(config, seq_length=SEQ)
    statuses = {s.name: s for s in registry.apply_patches(registry.current_context(True))}
    return model, statuses


def test_logged_aux_loss_counts_a_repeated_mtp_layer_once(monkeypatch):
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker, get_moe_metrics_tracker

    model, statuses = _repeated_mtp_model()
    assert statuses["moe-aux-loss-per-built-layer"].applied
    built = built_model.make_record([model])
    assert (built.layers.moe, built.layers.mtp, built.layers.mtp_moe) == (2, DEPTHS, DEPTHS)
    registry.record_of("layer-census").keep(built)  # as the layer-census patch does

    cpu.train_step_loss(model, batch=2, seq_length=SEQ)
    tracker = get_moe_metrics_tracker()
    per_layer = tracker.metrics["load_balancing_loss"].values.clone()
    total_loss = {}
    tracker.report(loss_scale=1.0, iteration=1, force_initialize=True,
                   track_names=["load_balancing_loss"], num_layers=2, moe_layer_freq=1,
                   mtp_num_layers=DEPTHS, total_loss_dict=total_loss)
    recorded = per_layer[per_layer != 0]
    assert recorded.numel() == 3, "2 decoder layers and one slot for the repeated MTP layer"
    torch.testing.assert_close(total_loss["load_balancing_loss"], recorded.mean())

    # megatron's own divisor, the patch left out: 2 decoder layers + DEPTHS, for 3 slots filled
    patched_count = MoEMetricsTracker._count_moe_layers
    monkeypatch.setattr(MoEMetricsTracker, "_count_moe_layers",
                        staticmethod(patched_count.__wrapped__))
    tracker.metrics["load_balancing_loss"].values.copy_(per_layer)
    megatron_loss = {}
    tracker.report(loss_scale=1.0, iteration=1, force_initialize=True,
                   track_names=["load_balancing_loss"], num_layers=2, moe_layer_freq=1,
                   mtp_num_layers=DEPTHS, total_loss_dict=megatron_loss)
    torch.testing.assert_close(megatron_loss["load_balancing_loss"], recorded.sum() / (2 + DEPTHS))


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_repeated_mtp_router_z_loss_gradient_is_divided_by_the_depths(patched, monkeypatch):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter

    coeff = 1e-2
    # Only the z-loss reaches the MTP router: no load-balancing loss, MTP and LM losses scaled 0.
    model, statuses = _repeated_mtp_model(moe_router_load_balancing_type="none",
                                          moe_aux_loss_coeff=0.0, moe_z_loss_coeff=coeff,
                                          mtp_loss_scaling_factor=0.0)
    assert statuses["moe-mtp-repeated-z-loss"].applied
    if not patched:
        _unpatched.leave_out(monkeypatch, "moe-mtp-repeated-z-loss", TopKRouter, "apply_z_loss")
    router = model.mtp.layers[0].mtp_model_layer.mlp.router
    logits_per_depth = []
    apply_z_loss = router.apply_z_loss

    def capture(logits, *args, **kwargs):
        logits_per_depth.append(logits)
        return apply_z_loss(logits, *args, **kwargs)

    router.apply_z_loss = capture
    loss = cpu.train_step_loss(model, batch=2, seq_length=SEQ)
    assert len(logits_per_depth) == DEPTHS
    # The z-loss of one layer, averaged over the depths that apply it (ST-MoE: mean of the
    # squared logsumexp of the logits, times the coefficient). Depth 2 reads depth 1's output,
    # so its gradient passes depth 1's router too; megatron's attached losses stay out of this
    # gradient (their backward scale 0) and go into the real backward (scale 1).
    z_loss = sum(torch.logsumexp(logits, -1).square().mean() for logits in logits_per_depth)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.0))
    (expected,) = torch.autograd.grad(coeff * z_loss / DEPTHS, router.weight, retain_graph=True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    (loss * 0).backward()
    # megatron's own attaches the full z-loss at every depth: DEPTHS times the logged one's
    applied = expected if patched else expected * DEPTHS
    print(f"{'patched' if patched else 'unpatched'}: |MTP router z-loss grad| "
          f"{router.weight.grad.norm():.4g}, of the logged z-loss {expected.norm():.4g}")
    assert expected.norm() > 0
    torch.testing.assert_close(router.weight.grad, applied)


@pytest.mark.slow
def test_launched_without_the_patch_the_mtp_router_z_loss_gradient_is_depths_times(tmp_path):
    """The same through pretrain_moe.py (1 rank, fp32, aux loss off): the z-loss's share of the
    repeated MTP router's weight gradient (the run with --moe-z-loss-coeff minus the run
    without; z-loss changes no forward value, and the decoder routers' z-loss reaches no MTP
    weight) is, with MEGATRON_PATCHES_DISABLE=moe-mtp-repeated-z-loss, DEPTHS times the
    patched run's."""
    from _launch import TINY_MODEL, launch

    flags = [a for a in TINY_MODEL if a != "--bf16"]
    flags[flags.index("--moe-aux-loss-coeff") + 1] = "0"
    flags += ["--mtp-num-layers", str(DEPTHS), "--mtp-use-repeated-layer", "--train-iters", "1"]
    observed = Path(__file__).resolve().parents[3] / "tests" / "_observed_launch.py"

    def mtp_router_grads(tag: str, coeff: str, env: dict | None = None) -> dict:
        folder = tmp_path / tag
        folder.mkdir()
        run = launch(1, [*flags, "--moe-z-loss-coeff", coeff], script=observed,
                     env={"GRAD_DIR": str(folder), "GRAD_NAMES": r"mtp\..*router\.weight",
                          **(env or {})}).check()
        grads = torch.load(folder / "grads_rank0.pt")
        assert grads, run.log[-3000:]
        return grads

    without = mtp_router_grads("without", "0")
    patched = mtp_router_grads("patched", "1e-1")
    unpatched = mtp_router_grads("unpatched", "1e-1",
                                 {"MEGATRON_PATCHES_DISABLE": "moe-mtp-repeated-z-loss"})
    for name, base in without.items():
        share, megatron = patched[name] - base, unpatched[name] - base
        assert share.norm() > 1e-3 * base.norm(), name  # the z-loss moves the gradient
        torch.testing.assert_close(megatron, DEPTHS * share, rtol=1e-4, atol=1e-7)
