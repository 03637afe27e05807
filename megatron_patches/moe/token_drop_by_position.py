"""`--moe-token-drop-policy position` drops the tokens at the end of the batch, as megatron
documents it, instead of whichever tokens torch.topk's tie-breaking picks.

megatron-core 0.19.2's `apply_router_token_dropping` keeps, for each expert, the tokens of
`torch.topk(routing_map.int(), k=capacity, dim=0, sorted=False)`: every routed token scores 1,
so which of them are kept is torch's choice among equal values, which it does not specify (on
the CPU about a quarter of the kept tokens are among the first `capacity` routed ones:
drops spread over the whole batch). megatron's documentation of the policy (`TransformerConfig.
moe_token_drop_policy`): "If "position", tokens at the end of each batch will be dropped".

The fix, at megatron's call site (the router module's name for the function): with the
position policy megatron's own function gets the routing map as priorities, a routed token
scoring more the earlier it comes (zero where not routed), so its top-k keeps each expert's
first routed tokens; the rest of megatron's function (the kept map, padding to capacity, the
probabilities) is unchanged (it reads the map as booleans). Applied before
`expert-bias-counts-routed-tokens`, whose wrapper of the same function must see the boolean
map. Targets 0.19.x.
"""

from __future__ import annotations

import functools

import torch

from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by

NAME = "moe-token-drop-by-position"


def _router_module():
    from megatron.core.transformer.moe import router

    return router


def position_priorities(routing_map: torch.Tensor) -> torch.Tensor:
    """The boolean [tokens, experts] map as int32 priorities: tokens - index where routed, 0
    elsewhere."""
    tokens = routing_map.shape[0]
    earlier_first = torch.arange(tokens, 0, -1, dtype=torch.int32, device=routing_map.device)
    return routing_map.to(torch.int32) * earlier_first[:, None]


def _dropping_by_position(drop):
    @functools.wraps(drop)
    def drop_by_position(routing_probs, routing_map, *args, drop_policy="probs", **kwargs):
        if drop_policy == "position":
            routing_map = position_priorities(routing_map)
        return drop(routing_probs, routing_map, *args, drop_policy=drop_policy, **kwargs)

    drop_by_position.__wrapped_by__ = NAME
    return drop_by_position


def _apply() -> None:
    module = _router_module()
    if wrapped_by(module.apply_router_token_dropping, NAME):
        return
    module.apply_router_token_dropping = _dropping_by_position(module.apply_router_token_dropping)


def kept_by_position(routing_map: torch.Tensor, capacity: int) -> torch.Tensor:
    """Each expert's first `capacity` routed tokens (the documented position policy)."""
    return routing_map & (routing_map.to(torch.int64).cumsum(dim=0) <= capacity)


def _not_needed_because(context: PatchContext) -> str | None:
    """Runs megatron's function on 1024 tokens routed at random to 8 experts (top-2), capacity
    factor 1 (256 tokens an expert), position policy."""
    drop = unwrapped(_router_module().apply_router_token_dropping)
    generator = torch.Generator().manual_seed(0)
    top = torch.rand(1024, 8, generator=generator).topk(2, dim=1).indices
    routing_map = torch.zeros(1024, 8, dtype=torch.bool).scatter(1, top, True)
    probs = routing_map.float() * 0.5
    _, kept = drop(probs, routing_map, router_topk=2, capacity_factor=1.0,
                   drop_policy="position")
    if torch.equal(kept, kept_by_position(routing_map, 256)):
        return "apply_router_token_dropping keeps each expert's first routed tokens itself"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 moe_utils.apply_router_token_dropping)",
    versions=">=0.19,<0.20",
    summary="--moe-token-drop-policy position drops the tokens at the end of the batch (megatron "
            "kept whichever routed tokens torch.topk's tie-breaking picked)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
