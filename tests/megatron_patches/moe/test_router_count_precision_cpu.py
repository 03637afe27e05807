"""Under --bf16 the router's token counters stay fp32 and exact (patch router-token-counts-fp32,
Megatron-LM PR #7081): after a forward of a Float16Module-wrapped megatron GPT, the expert-bias
counts and the global-aux-loss counts equal a direct count of the routing decisions, also where
a count is above 256 (which bf16 cannot hold exactly)."""

import pytest
import torch

import _megatron_cpu as cpu

BATCH, SEQ = 2, 512  # 1024 tokens, top-2 of 4 experts: about 512 tokens per expert

CASES = {
    "expert-bias": (dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                         moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0),
                    "local_tokens_per_expert"),
    "global-aux-loss": (dict(moe_router_load_balancing_type="global_aux_loss",
                             moe_aux_loss_coeff=1e-2),
                        "global_tokens_per_expert"),
}


@pytest.mark.parametrize("case", CASES)
def test_router_counts_stay_fp32_and_exact_under_bf16(case):
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_patches import registry

    registry.load_patches()
    registry.apply_patches(registry.current_context(cpu_backend=True))
    overrides, buffer = CASES[case]
    config = cpu.tiny_config(num_moe_experts=4, moe_router_topk=2, bf16=True,
                             params_dtype=torch.bfloat16, **overrides)
    torch.manual_seed(0)
    model = Float16Module(config, cpu.build_gpt(config, SEQ))
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == 2 and getattr(routers[0], buffer).dtype == torch.bfloat16  # the cast

    routed = {id(r): torch.zeros(4, dtype=torch.int64) for r in routers}

    def count(router, inputs, outputs):
        routed[id(router)] += outputs[1].sum(dim=0)

    for router in routers:
        router.register_forward_hook(count)
    cpu.train_step_loss(model, BATCH, SEQ)

    for router in routers:
        counts = getattr(router, buffer)
        assert routed[id(router)].max() > 256
        assert torch.equal(counts.to(torch.int64), routed[id(router)]), (
            f"{buffer} {counts.tolist()} != routed {routed[id(router)].tolist()}")
        assert counts.dtype == torch.float32, f"{buffer} is {counts.dtype}"
