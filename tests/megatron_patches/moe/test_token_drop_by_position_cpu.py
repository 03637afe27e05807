"""`--moe-token-drop-policy position` keeps each expert's first routed tokens and drops those at
the end of the batch, as megatron documents the policy (patch moe-token-drop-by-position): a
training forward of a megatron GPT with a capacity factor, dropping and padded to capacity;
the reference is each expert's first `capacity` tokens among those the router chose (each
token's top-k of the logits its gating computed, counted here). With the patch left out
(megatron-core 0.19.2's own apply_router_token_dropping) the kept tokens are whichever torch's
top-k picks among equal scores: not the first ones. A launched run shows the same both ways,
the patch left out with MEGATRON_PATCHES_DISABLE."""

import json

import pytest
import torch

import _megatron_cpu as cpu
import _unpatched
from megatron_patches.moe.token_drop_by_position import kept_by_position
from megatron_patches.registry import unwrapped

BATCH, SEQ, EXPERTS, TOPK = 2, 256, 8, 2  # 512 tokens: capacity 64 an expert at factor 0.5


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
@pytest.mark.parametrize("padded", [False, True], ids=["dropping", "padded"])
def test_position_policy_drops_the_last_tokens(padded, patched, monkeypatch):
    from megatron.core.transformer.moe import router as router_module
    from megatron.core.transformer.moe.router import TopKRouter

    statuses = _unpatched.apply_all()
    assert statuses["moe-token-drop-by-position"].applied
    if not patched:  # megatron's own function (the expert-bias patch's wrapper only annotates)
        monkeypatch.setattr(router_module, "apply_router_token_dropping",
                            unwrapped(router_module.apply_router_token_dropping))
    config = cpu.tiny_config(num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                             moe_expert_capacity_factor=0.5, moe_token_drop_policy="position",
                             moe_pad_expert_input_to_capacity=padded)
    torch.manual_seed(0)
    model = cpu.build_gpt(config, SEQ)
    chosen, kept, gating = {}, {}, TopKRouter.gating

    def chosen_by_gating(router, hidden):  # softmax routing: each token's top-k of the logits
        logits = gating(router, hidden)
        top = torch.topk(logits.reshape(-1, EXPERTS), TOPK, dim=-1).indices
        chosen[router.layer_number] = torch.zeros(
            top.shape[0], EXPERTS, dtype=torch.bool).scatter(1, top, True)
        return logits

    def keep(router, inputs, outputs):
        kept[router.layer_number] = outputs[1]

    monkeypatch.setattr(TopKRouter, "gating", chosen_by_gating)
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        router.register_forward_hook(keep)
    cpu.train_step_loss(model, BATCH, SEQ)

    capacity = BATCH * SEQ * TOPK // EXPERTS // 2
    assert sorted(kept) == [1, 2]
    for layer, routed in chosen.items():
        expected = kept_by_position(routed, capacity)
        real = kept[layer] & routed  # (padded to capacity the map holds padding too)
        assert routed.sum(dim=0).max() > capacity, "the test needs an expert over capacity"
        assert torch.equal(real.sum(dim=0), expected.sum(dim=0))  # as many kept either way
        if padded:
            assert (kept[layer].sum(dim=0) == capacity).all()
        if patched:
            assert torch.equal(real, expected), f"layer {layer}: not the first routed tokens"
        else:
            assert not torch.equal(real, expected), f"layer {layer}: megatron kept the first"


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_launched_run_drops_the_last_tokens(patched, tmp_path):
    """pretrain_moe.py with the position policy, capacity factor 0.5 (a sigmoid router with
    expert bias, whose choice tests/_observed_launch.py recounts from the router's logits): in
    every training forward each expert keeps its first chosen tokens; with the patch left out
    (MEGATRON_PATCHES_DISABLE) it keeps others."""
    from _launch import REPO, TINY_MODEL, launch

    args = [*TINY_MODEL, "--train-iters", "1",
            "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
            "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0",
            "--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "position"]
    env = {"ROUTER_COUNT_DIR": str(tmp_path)}
    if not patched:
        env["MEGATRON_PATCHES_DISABLE"] = "moe-token-drop-by-position"
    run = launch(1, args, env=env, script=REPO / "tests" / "_observed_launch.py",
                 timeout=300).check()
    said = ("moe-token-drop-by-position: applied" if patched else
            "moe-token-drop-by-position: skipped (disabled by MEGATRON_PATCHES")
    assert said in run.log, run.log[-3000:]
    routers = json.loads((tmp_path / "router_counts_rank0.json").read_text())
    assert len(routers) == 2 and all(r["routed"] != r["chosen"] for r in routers), routers
    kept_first = [router["kept_first_chosen"] for router in routers]
    if patched:
        assert kept_first == [True, True], routers
    else:
        assert False in kept_first, routers
