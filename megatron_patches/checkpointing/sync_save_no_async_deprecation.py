"""A synchronous torch_dist save logs no "MCore's async save is deprecated" warning.

Upstream: local (megatron-core 0.19.2
`megatron/core/dist_checkpointing/strategies/torch.py`: `TorchDistSaveShardedStrategy.save`, the
synchronous save, runs `async_save(..., async_strategy="mcore")` and executes the request at once;
`async_save` warns, once per process, that MCore's async save is deprecated and that
`async_strategy` should be `nvrx`). Targets megatron-core 0.19.

Every torch_dist save is synchronous unless the run asks for `--async-save`, so at its first save
every rank of every run warned about an asynchronous save it never made, with advice
(`async_strategy` `nvrx`) that does not apply to it: four lines in README's CPU run, one per rank
of a GPU job (1,024 at 1,024 ranks). During `TorchDistSaveShardedStrategy.save` megatron's
"already warned" flag reads as set, and is restored after it: a real MCore asynchronous save
(`async_save` called by megatron's `--async-save` path) still warns once.
"""

from __future__ import annotations

from megatron_patches.checkpointing.sync_save_scope import hold_during_sync_save, strategy_module
from megatron_patches.registry import Patch, PatchContext, register, unwrapped

NAME = "sync-save-no-async-deprecation"
FLAG = "_logged_mcore_async_deprecation"


def _apply() -> None:
    # Megatron's "already warned" flag reads as set during a synchronous save.
    hold_during_sync_save(NAME, strategy_module(), FLAG, False, lambda: True)


def _not_needed_because(context: PatchContext) -> str | None:
    # What megatron's code says: the synchronous save goes through async_save with "mcore", and
    # async_save reads a once-per-process flag before it warns.
    torch_strategy = strategy_module()
    strategy = torch_strategy.TorchDistSaveShardedStrategy
    save = unwrapped(strategy.save).__code__
    if "async_save" not in save.co_names or "mcore" not in save.co_consts:
        return "TorchDistSaveShardedStrategy.save does not run async_save(async_strategy='mcore')"
    async_save = unwrapped(strategy.async_save).__code__
    if FLAG not in vars(torch_strategy) or FLAG not in async_save.co_names:
        return f"async_save warns without the {FLAG} flag"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 dist_checkpointing/strategies/torch.py)",
    versions=">=0.19,<0.20",
    summary="a synchronous torch_dist save logs no \"MCore's async save is deprecated\" warning "
            "(megatron's synchronous save runs its async machinery as 'mcore', and every rank "
            "warned at its first save about an asynchronous save it did not make)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
