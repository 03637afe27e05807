"""What the sync-save patches share: megatron-core's synchronous torch_dist save
(`TorchDistSaveShardedStrategy.save`, which runs its asynchronous machinery with `execute_sync`)
wrapped so that one of megatron's module-level caches reads another value for that save only.

Only where the cache still holds its unset value: what megatron put there itself (an
asynchronous save's Manager queue, a warning already given) stands, and the save runs as
before. After the save the unset value is back, so a later asynchronous save finds megatron's
state as megatron left it.
"""

from __future__ import annotations

import functools
from typing import Callable

from megatron_patches.registry import wrapped_by


def strategy_module():
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    return torch_strategy


def hold_during_sync_save(patch: str, module, attribute: str, unset, held: Callable[[], object]):
    """Wraps the synchronous save (once per patch: both patches wrap the same method, in either
    order) so that `module.attribute`, where it `is unset`, is `held()` during each save."""
    strategy = strategy_module().TorchDistSaveShardedStrategy
    save = strategy.save
    if wrapped_by(save, patch):
        return

    @functools.wraps(save)
    def save_holding(self, sharded_state_dict, checkpoint_dir):
        if getattr(module, attribute) is not unset:
            return save(self, sharded_state_dict, checkpoint_dir)
        setattr(module, attribute, held())
        try:
            return save(self, sharded_state_dict, checkpoint_dir)
        finally:
            setattr(module, attribute, unset)

    save_holding.__wrapped_by__ = patch
    strategy.save = save_holding
