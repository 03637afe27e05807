"""Under --bf16 the router's token counters stay fp32 and exact (patch router-token-counts-fp32,
Megatron-LM PR #7081): after a forward of a Float16Module-wrapped megatron GPT, the expert-bias
counts and the global-aux-loss counts equal a direct count of the routing decisions, also where
a count is above 256 (which bf16 cannot hold exactly). With the patch left out (megatron-core
0.19.2's own TopKRouter._maintain_float32_expert_bias) the same forward keeps the counters in
bf16: counts above 256 come out rounded to bf16's spacing there (2 up to 512, 4 up to 1024)."""

import pytest
import torch

import _megatron_cpu as cpu
import _unpatched

PATCH = "router-token-counts-fp32"
BATCH, SEQ = 2, 512  # 1024 tokens, top-2 of 4 experts: about 512 tokens per expert

CASES = {
    "expert-bias": (dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                         moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0),
                    "local_tokens_per_expert"),
    "global-aux-loss": (dict(moe_router_load_balancing_type="global_aux_loss",
                             moe_aux_loss_coeff=1e-2),
                        "global_tokens_per_expert"),
}


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
@pytest.mark.parametrize("case", CASES)
def test_router_counts_stay_fp32_and_exact_under_bf16(case, patched, monkeypatch):
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.router import TopKRouter

    _unpatched.apply_all()
    if not patched:
        _unpatched.leave_out(monkeypatch, PATCH, TopKRouter, "_maintain_float32_expert_bias")
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
        counts, direct = getattr(router, buffer), routed[id(router)]
        assert direct.max() > 256
        if patched:
            assert torch.equal(counts.to(torch.int64), direct), (
                f"{buffer} {counts.tolist()} != routed {direct.tolist()}")
            assert counts.dtype == torch.float32, f"{buffer} is {counts.dtype}"
        else:  # megatron's own: the routed counts as bf16 holds them
            assert counts.dtype == torch.bfloat16, f"{buffer} is {counts.dtype}"
            assert torch.equal(counts, direct.to(torch.bfloat16)), (
                f"{buffer} {counts.tolist()} != bf16 of routed {direct.tolist()}")
    if not patched:  # and at least one count is not what was routed
        errors = [(getattr(r, buffer).to(torch.int64) - routed[id(r)]).abs().max().item()
                  for r in routers]
        print(f"{case}: unpatched {buffer} off by up to {max(errors)} tokens, routed "
              f"{[routed[id(r)].tolist() for r in routers]}")
        assert max(errors) > 0


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_launched_bf16_run_keeps_exact_counts(patched, tmp_path):
    """pretrain_moe.py, --bf16 with expert bias, one micro-batch of 2048 tokens (about 512 per
    expert, top-2 of 8): the counter megatron's expert-bias update reads equals the routing
    decisions counted beside it (tests/_observed_launch.py). With the patch left out
    (MEGATRON_PATCHES_DISABLE) the counter is bf16, holds the routed counts as bf16 rounds them,
    and at least one count is off."""
    import json

    from _launch import REPO, TINY_MODEL, launch

    args = [*TINY_MODEL, "--seq-length", "512", "--max-position-embeddings", "512",
            "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "1",
            "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
            "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"]
    env = {"ROUTER_COUNT_DIR": str(tmp_path)}
    if not patched:
        env["MEGATRON_PATCHES_DISABLE"] = PATCH
    run = launch(1, args, env=env, script=REPO / "tests" / "_observed_launch.py",
                 timeout=300).check()
    said = f"{PATCH}: applied" if patched else f"{PATCH}: skipped (disabled by MEGATRON_PATCHES"
    assert said in run.log, run.log[-3000:]
    routers = json.loads((tmp_path / "router_counts_rank0.json").read_text())
    assert len(routers) == 2 and max(max(r["routed"]) for r in routers) > 256, routers
    for router in routers:
        routed = torch.tensor(router["routed"])
        if patched:
            assert router["dtype"] == "torch.float32" and router["counts"] == routed.tolist(), router
        else:
            assert router["dtype"] == "torch.bfloat16", router
            assert router["counts"] == routed.to(torch.bfloat16).float().tolist(), router
    if not patched:
        assert any(r["counts"] != r["routed"] for r in routers), routers

