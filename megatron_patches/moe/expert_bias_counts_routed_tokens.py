"""The expert bias (`--moe-router-enable-expert-bias`, DeepSeek's auxiliary-loss-free balancing)
moves by the tokens the router chose for each expert, also where a capacity factor drops some.

DeepSeek's loss-free balancing (arXiv 2408.15664, Algorithm 1; DeepSeek-V3's report) counts,
after each step, the tokens top-k over score + bias assigned to each expert, and moves the bias
of every expert above the mean down and every one below it up. megatron-core 0.19.2's
`TopKRouter.routing` counts (`_apply_expert_bias`) the routing map left after
`apply_router_token_dropping`, which with `--moe-expert-capacity-factor`:

* with `--moe-pad-expert-input-to-capacity` is the capacity mask: every expert holds exactly its
  capacity, so every count equals the mean, `sign(mean - count)` is 0 and the bias never moves,
  however unbalanced the routing: the balancing the flag asks for silently does nothing;
* without padding is each expert's count capped at its capacity: an overloaded expert looks
  like one at capacity, the mean of the capped counts falls below the true mean, and experts
  between the two are pushed down though they are under-loaded.

megatron's own load-balancing losses are computed from the routing before the drop
(`compute_routing_scores_for_aux_loss`); only the bias's count reads the dropped map.

The fix, at megatron's call sites in `TopKRouter.routing`: the router module's
`apply_router_token_dropping` returns its map carrying the map it was given (the routing
decision) and `_apply_expert_bias` counts that one (megatron's own function, so its padding-mask
and no-grad rules still apply). Nothing changes without a capacity factor. Applied after
`moe-token-drop-by-position`, so that its wrapper of the drop is the outer one and keeps the
boolean map. Targets 0.19.x.
"""

from __future__ import annotations

import functools
import types

import torch

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "expert-bias-counts-routed-tokens"
_ROUTED = "_routed_before_capacity"  # attribute of the dropped map: the map before the drop


def routed_before_capacity(routing_map: torch.Tensor) -> torch.Tensor:
    """The router's choice behind `routing_map`: the map before the capacity drop where one was
    applied, else `routing_map` itself."""
    return getattr(routing_map, _ROUTED, routing_map)


def _router_module():
    from megatron.core.transformer.moe import router

    return router


def _keeping_the_routed_map(drop):
    @functools.wraps(drop)
    def drop_keeping_the_routed_map(routing_probs, routing_map, *args, **kwargs):
        probs, kept = drop(routing_probs, routing_map, *args, **kwargs)
        # (the map before the drop then lives as long as the kept one, which autograd keeps to
        # the backward: a [tokens x experts] bool, 1 MiB a layer at 4096 tokens x 256 experts)
        setattr(kept, _ROUTED, routing_map)
        return probs, kept

    drop_keeping_the_routed_map.__wrapped_by__ = NAME
    return drop_keeping_the_routed_map


def _counting_the_routed_map(apply_expert_bias):
    @functools.wraps(apply_expert_bias)
    def apply_expert_bias_on_routed_tokens(self, routing_map, *args, **kwargs):
        return apply_expert_bias(self, routed_before_capacity(routing_map), *args, **kwargs)

    apply_expert_bias_on_routed_tokens.__wrapped_by__ = NAME
    return apply_expert_bias_on_routed_tokens


def _apply() -> None:
    module = _router_module()
    if wrapped_by(module.apply_router_token_dropping, NAME):
        return
    module.apply_router_token_dropping = _keeping_the_routed_map(
        module.apply_router_token_dropping)
    module.TopKRouter._apply_expert_bias = _counting_the_routed_map(
        module.TopKRouter._apply_expert_bias)


def _probe_counts() -> list[float]:
    """What megatron's TopKRouter.routing adds to the expert-bias count for 8 tokens that all
    choose expert 0 of 4 (top-1), capacity factor 1 (2 tokens an expert), padded to capacity."""
    router_class = _router_module().TopKRouter

    class ProbeRouter(router_class):
        def __init__(self):  # megatron's needs process groups and a CUDA device
            torch.nn.Module.__init__(self)
            self.config = types.SimpleNamespace(
                num_moe_experts=4, moe_z_loss_coeff=None, moe_router_pre_softmax=False,
                moe_router_num_groups=None, moe_router_group_topk=None,
                moe_router_topk_scaling_factor=None, moe_router_fusion=False,
                moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs",
                moe_pad_expert_input_to_capacity=True)
            self.topk, self.routing_type, self.score_function = 1, "none", "sigmoid"
            self.enable_expert_bias, self.router_replay = True, None
            self.register_buffer("expert_bias", torch.zeros(4))
            self.register_buffer("local_tokens_per_expert", torch.zeros(4))

    probe = ProbeRouter()
    logits = torch.tensor([5.0, 0.0, 0.0, 0.0]).repeat(8, 1, 1)  # [sequence 8, batch 1, 4]
    # _apply_expert_bias is torch.compile'd on a GPU machine: run it as Python here.
    with torch.compiler.set_stance("force_eager"), torch.enable_grad():
        probe.routing(logits)
    return probe.local_tokens_per_expert.tolist()


def _not_needed_because(context: PatchContext) -> str | None:
    try:
        counts = _probe_counts()
    except (AttributeError, TypeError):
        return None  # cannot tell: the wrappers change only a dropped map's count
    if counts == [8.0, 0.0, 0.0, 0.0]:
        return "TopKRouter counts the expert bias's tokens before the capacity drop itself"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 TopKRouter.routing, _apply_expert_bias)",
    versions=">=0.19,<0.20",
    summary="the expert bias moves by the tokens the router chose, before a capacity factor "
            "drops or pads (padded to capacity megatron's bias never moved)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
