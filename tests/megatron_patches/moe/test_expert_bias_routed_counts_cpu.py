"""With a capacity factor the expert bias counts the tokens the router chose (patch
expert-bias-counts-routed-tokens): after a training forward of a megatron GPT with
`--moe-router-enable-expert-bias`, the count megatron's bias update reads equals DeepSeek's
(arXiv 2408.15664, Algorithm 1): per token, top-k over sigmoid(logits) + bias, counted here
from the logits the router computed. With the patch left out (megatron-core 0.19.2's own
`_apply_expert_bias`), padded to capacity every expert's count is its capacity (all equal: the
bias update's sign(mean - count) is 0), and dropping without padding the count of an overloaded
expert is capped at its capacity."""

import json

import pytest
import torch

import _megatron_cpu as cpu
import _unpatched

PATCH = "expert-bias-counts-routed-tokens"
BATCH, SEQ, EXPERTS, TOPK = 2, 64, 8, 2  # 128 tokens: capacity 32 an expert at factor 1

CAPACITY = {"padded": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
            "dropping": dict(moe_expert_capacity_factor=1.0)}


def _chosen(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """DeepSeek's count: each token's top-k experts by sigmoid score + bias."""
    scores = torch.sigmoid(logits.reshape(-1, EXPERTS).float()) + bias
    top = torch.topk(scores, TOPK, dim=-1).indices
    return torch.bincount(top.flatten(), minlength=EXPERTS).to(torch.float32)


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
@pytest.mark.parametrize("capacity", CAPACITY)
def test_expert_bias_counts_the_routed_tokens(capacity, patched, monkeypatch):
    from megatron.core.transformer.moe.router import TopKRouter

    _unpatched.apply_all()
    if not patched:
        _unpatched.leave_out(monkeypatch, PATCH, TopKRouter, "_apply_expert_bias")
    config = cpu.tiny_config(num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                             moe_router_enable_expert_bias=True,
                             moe_router_score_function="sigmoid",
                             moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                             **CAPACITY[capacity])
    torch.manual_seed(0)
    model = cpu.build_gpt(config, SEQ)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == 2
    for router in routers:
        # A bias that changes the choice: the count must follow score + bias, not the score.
        router.expert_bias.copy_(torch.linspace(-0.2, 0.2, EXPERTS))
    chosen, gating = {}, TopKRouter.gating

    def counted_gating(router, hidden):
        logits = gating(router, hidden)
        chosen[id(router)] = _chosen(logits.detach(), router.expert_bias)
        return logits

    monkeypatch.setattr(TopKRouter, "gating", counted_gating)
    cpu.train_step_loss(model, BATCH, SEQ)

    capacity_tokens = BATCH * SEQ * TOPK // EXPERTS
    for router in routers:
        counts, reference = router.local_tokens_per_expert, chosen[id(router)]
        assert reference.sum() == BATCH * SEQ * TOPK and reference.max() > capacity_tokens, (
            f"the test needs an expert over capacity: {reference.tolist()}")
        if patched:
            assert torch.equal(counts, reference), f"{counts.tolist()} != {reference.tolist()}"
        elif capacity == "padded":
            assert counts.tolist() == [capacity_tokens] * EXPERTS, counts.tolist()
        else:
            assert torch.equal(counts, reference.clamp(max=capacity_tokens)), (
                f"{counts.tolist()} != {reference.tolist()} capped at {capacity_tokens}")


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_launched_padded_run_counts_the_routed_tokens(patched, tmp_path):
    """pretrain_moe.py with expert bias padded to capacity (2 ranks, DP2, two micro-batches a
    rank): the counter megatron's expert-bias update reads at the first step equals the experts
    chosen by score + bias, counted beside it from the router's logits (tests/_observed_launch.py).
    With the patch left out (MEGATRON_PATCHES_DISABLE) the counter is the padded map's: every
    expert's count the same, so the update cannot move the bias."""
    from _launch import REPO, TINY_MODEL, launch

    args = [*TINY_MODEL, "--train-iters", "1",
            "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
            "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0",
            "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
    env = {"ROUTER_COUNT_DIR": str(tmp_path)}
    if not patched:
        env["MEGATRON_PATCHES_DISABLE"] = PATCH
    run = launch(2, args, env=env, script=REPO / "tests" / "_observed_launch.py",
                 timeout=300).check()
    said = f"{PATCH}: applied" if patched else f"{PATCH}: skipped (disabled by MEGATRON_PATCHES"
    assert said in run.log, run.log[-3000:]
    for rank in range(2):
        routers = json.loads((tmp_path / f"router_counts_rank{rank}.json").read_text())
        assert len(routers) == 2, routers
        for router in routers:
            chosen = router["chosen"]
            assert sum(chosen) == 2 * 2 * 64 * 2 and len(set(chosen)) > 1, router
            if patched:
                assert router["counts"] == chosen, router
            else:
                assert len(set(router["counts"])) == 1 and router["counts"] != chosen, router
