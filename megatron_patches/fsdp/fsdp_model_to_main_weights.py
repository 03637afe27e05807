"""Megatron-FSDP with bf16/fp16: the main (fp32) weights rebuilt from weights loaded without
their optimizer state.

Upstream: megatron-core 0.19.2 `DistributedOptimizer._copy_model_params_to_main_params` raises
"Megatron-FSDP does not implement a model-to-main parameter update." Targets 0.19.x (read and
tested on 0.19.2).

megatron's load_checkpoint calls `optimizer.reload_model_params()` whenever it loads weights but
no optimizer state in bf16/fp16: `--no-load-optim`, `--finetune`, and a `release` checkpoint.
Under Megatron-FSDP every rank then fails after the load, so no fine-tune could start in the
project's first layout. (import-hf writes torch_dist, which Megatron-FSDP does not load: refused
before work by the preflight check megatron-fsdp-loads-fsdp-dtensor.)

The fix does what the optimizer step does the other way round (Megatron-FSDP's
`copy_main_weights_to_model_weights`): for every parameter group with a main-weight buffer, each
parameter's model weight (the shard this rank keeps, where either buffer is sharded) is copied
into its main weight. Left to megatron (it still raises): `--load-main-params-from-ckpt` (main
weights from a state dict) and FP8 parameters, whose model weights are quantized.

Needed where `_copy_model_params_to_main_params` still raises for Megatron-FSDP.
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_patches.registry import Patch, PatchContext, register

NAME = "fsdp-model-to-main-weights"
_UNIMPLEMENTED = "does not implement a model-to-main parameter update"


def _distributed_optimizer():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def _not_needed_because(context: PatchContext) -> str | None:
    source = inspect.getsource(_distributed_optimizer()._copy_model_params_to_main_params)
    if _UNIMPLEMENTED not in source:
        return "megatron's optimizer updates Megatron-FSDP's main weights from the model"
    return None


def _quantized(param) -> bool:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision import (
        is_blockwise_float8tensor,
        is_float8tensor,
    )

    return is_float8tensor(param) or is_blockwise_float8tensor(param)


@torch.no_grad()
def copy_model_weights_to_main_weights(buffer) -> None:
    """Megatron-FSDP's ParamAndGradBuffer `buffer`: every main weight from its model weight."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        to_local_if_dtensor,
    )

    for group in buffer.parameter_groups:
        main, model = group.main_weight_buffer, group.model_weight_buffer
        if main is None:
            continue
        for param in group.params:
            item = main.param_idx[param]
            if model is None:  # the parameter itself is the compute weight, unsharded
                weight, target = to_local_if_dtensor(param), main.get_item(item)
            else:
                shard = model.is_data_distributed or main.is_data_distributed
                weight = model.get_item(item, only_shard=shard)
                target = main.get_item(item, only_shard=shard)
            if weight.numel():
                target.copy_(weight.reshape(target.shape))


def _wrap(copy_model_params_to_main_params):
    @functools.wraps(copy_model_params_to_main_params)
    def _copy_model_params_to_main_params(self, state_dict=None):
        if not self.ddp_config.use_megatron_fsdp or state_dict is not None or any(
                _quantized(p) for chunk in self.model_chunks for p in chunk.parameters()):
            return copy_model_params_to_main_params(self, state_dict=state_dict)
        for chunk in self.model_chunks:
            copy_model_weights_to_main_weights(chunk.param_and_grad_buffer)

    _copy_model_params_to_main_params.__wrapped_by__ = NAME
    return _copy_model_params_to_main_params


def _apply() -> None:
    from megatron_patches.registry import wrapped_by

    cls = _distributed_optimizer()
    if not wrapped_by(cls._copy_model_params_to_main_params, NAME):
        cls._copy_model_params_to_main_params = _wrap(cls._copy_model_params_to_main_params)


register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 DistributedOptimizer._copy_model_params_to_main_params "
             "(NotImplementedError for Megatron-FSDP)",
    versions=">=0.19,<0.20",
    summary="Megatron-FSDP bf16/fp16: weights loaded without optimizer state (--no-load-optim, "
            "--finetune, a release checkpoint) refresh the main weights, as the "
            "optimizer step does the other way",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
