"""Expert-load metrics (patch expert-load-metrics, Megatron-LM issue #2398) equal a direct count
of the routing decisions of a real megatron GPT: tokens per expert (min/max/mean/cv), experts
with no token, tokens dropped by the capacity factor and the tokens the router chose before the
drop, per layer; the summary line and the per-layer TensorBoard scalars carry them; the counts
restart after each report."""

import math
import types

import pytest
import torch

import _megatron_cpu as cpu
from _launch import tensorboard_scalars

BATCH, SEQ, EXPERTS, TOPK = 2, 64, 8, 2


CAPACITY = {"dropless": {}, "dropping": dict(moe_expert_capacity_factor=0.5),
            "padded": dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)}


@pytest.mark.parametrize("capacity", CAPACITY)
def test_expert_load_equals_a_direct_count(capacity, tmp_path, monkeypatch):
    """Padded to capacity the router's map holds the padding: the direct count is then of its
    entries the router chose, each token's top-k of the logits the router's gating computed;
    under a capacity factor those top-k are also the chosen tokens reported beside the kept."""
    from megatron.core.transformer.moe.router import TopKRouter
    from torch.utils.tensorboard import SummaryWriter

    from megatron_patches import registry
    from megatron_patches.moe import expert_load_metrics

    registry.load_patches()
    registry.apply_patches(registry.current_context(cpu_backend=True))
    config = cpu.tiny_config(num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                             moe_token_drop_policy="probs", **CAPACITY[capacity])
    torch.manual_seed(0)
    model = cpu.build_gpt(config, SEQ)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    routed = {r.layer_number: torch.zeros(EXPERTS, dtype=torch.int64) for r in routers}
    top_k_counts = {r.layer_number: torch.zeros(EXPERTS, dtype=torch.int64) for r in routers}
    chosen, gating = {}, TopKRouter.gating

    def chosen_by_gating(router, hidden):  # softmax routing: top-k of the logits
        logits = gating(router, hidden).reshape(-1, EXPERTS)
        top = torch.topk(logits, TOPK, dim=-1).indices
        chosen[router.layer_number] = torch.zeros_like(logits, dtype=torch.bool).scatter(
            1, top, True)
        return logits

    monkeypatch.setattr(TopKRouter, "gating", chosen_by_gating)

    def count(router, inputs, outputs):
        if torch.is_grad_enabled():
            real = outputs[1] & chosen[router.layer_number]
            if capacity != "padded":
                assert torch.equal(real, outputs[1])  # the map holds only chosen tokens
            routed[router.layer_number] += real.sum(dim=0)
            top_k_counts[router.layer_number] += chosen[router.layer_number].sum(dim=0)

    for router in routers:
        router.register_forward_hook(count)
    expert_load_metrics.interval_loads(config.num_layers, EXPERTS)  # earlier tests' counts
    for _ in range(2):
        cpu.train_step_loss(model, BATCH, SEQ).backward()
    with torch.no_grad():
        cpu.train_step_loss(model, BATCH, SEQ)  # evaluation-like: not counted

    args = types.SimpleNamespace(num_layers=config.num_layers, mtp_num_layers=None,
                                 num_experts=EXPERTS)
    lines = []
    writer = SummaryWriter(str(tmp_path))
    loads = expert_load_metrics.interval_loads(config.num_layers, EXPERTS)
    assert [load.layer for load in loads] == [1, 2]
    for load in loads:
        direct = routed[load.layer].tolist()
        assert list(load.tokens_per_expert) == direct
        mean = sum(direct) / EXPERTS
        assert load.mean == mean and min(direct) == load.scalars()["tokens_min"]
        std = math.sqrt(sum((n - mean) ** 2 for n in direct) / EXPERTS)
        assert load.cv == pytest.approx(std / mean)
        assert load.idle_experts == direct.count(0)
        assigned_before_drops = 2 * BATCH * SEQ * TOPK
        assert load.dropped == assigned_before_drops - sum(direct)
        if capacity == "dropless":
            assert load.chosen is None and "chosen_tokens_max" not in load.scalars()
        else:
            assert load.dropped > 0
            assert list(load.chosen) == top_k_counts[load.layer].tolist()
            assert sum(load.chosen) == assigned_before_drops
            assert max(load.chosen) > max(direct) and load.chosen_cv > load.cv  # capped
    expert_load_metrics.write_scalars(loads, 7, writer, None)
    writer.flush()
    assert tensorboard_scalars(tmp_path, "expert_load/tokens_max/layer_2") == {
        7: max(routed[2].tolist())}
    assert tensorboard_scalars(tmp_path, "expert_load/dropped_tokens/layer_1") == {
        7: loads[0].dropped}

    line = expert_load_metrics.summary_line(7, loads)
    every = [n for counts in routed.values() for n in counts.tolist()]
    assert f"tokens/expert min {min(every)} max {max(every)} " in line
    assert f"experts with no token {every.count(0)} |" in line
    assert f"dropped tokens {sum(load.dropped for load in loads)} " in line
    if capacity != "dropless":
        chose = max(n for counts in top_k_counts.values() for n in counts.tolist())
        assert f"chosen before the drop: max {chose} |" in line
        assert tensorboard_scalars(tmp_path, "expert_load/chosen_tokens_max/layer_1") == {
            7: max(top_k_counts[1].tolist())}
    else:
        assert "chosen" not in line

    expert_load_metrics.report(8, args, None, None, lines.append)
    assert lines == []  # nothing routed since the last report


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_pretrain_logs_expert_load_only_with_the_patch(patched, tmp_path):
    """A real pretrain() run (1 rank, 2 iterations, the tiny MoE): with the patch every log
    interval prints the expert-load line and TensorBoard gets the per-layer scalars, whose mean
    is the tokens routed per expert (global batch x sequence x top-k / experts; no capacity
    factor, so none dropped). With MEGATRON_PATCHES_DISABLE=expert-load-metrics megatron-core
    0.19.2 logs neither (the missing feature, Megatron-LM #2398)."""
    from _launch import TINY_MODEL, launch

    tensorboard = tmp_path / "tb"
    log = launch(1, [*TINY_MODEL, "--train-iters", "2", "--tensorboard-dir", str(tensorboard)],
                 env={"MEGATRON_PATCHES_DISABLE": "" if patched else "expert-load-metrics"}
                 ).check().log
    status = "applied" if patched else "skipped (disabled by MEGATRON_PATCHES_DISABLE)"
    assert f"[megatron_patches] expert-load-metrics: {status}" in log, log[-3000:]
    flag = lambda name: int(TINY_MODEL[TINY_MODEL.index(name) + 1])  # noqa: E731
    tokens = flag("--global-batch-size") * flag("--seq-length")
    mean = tokens * flag("--moe-router-topk") / flag("--num-experts")
    lines = [line for line in log.splitlines() if "[expert load]" in line]
    means = tensorboard_scalars(tensorboard, "expert_load/tokens_mean/layer_1")
    if patched:
        assert len(lines) == 2 and "2 MoE layers" in lines[0] and f"mean {mean:.1f} |" in lines[0]
        assert means == {1: mean, 2: mean}
    else:
        assert lines == [] and means == {}
        assert tensorboard_scalars(tensorboard, "lm loss")  # TensorBoard was written
