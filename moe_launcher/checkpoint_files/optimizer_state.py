"""Whether this run can load the optimizer state of the checkpoint it resumes from, judged from the
checkpoint's saved args and content metadata (no tensor data): the optimizer check behind
checkpoint-load-integrity.

megatron-core 0.19.2 fails on every rank, after the model and optimizer are built, with a
traceback naming neither cause nor fix, when a resume loads optimizer state (no --no-load-optim,
no --finetune, not a release checkpoint) from
* a checkpoint saved with --no-save-optim: `KeyError: 'optimizer'` (torch_dist: megatron builds
  the state dict without an optimizer, then reads `state_dict['optimizer']`), or "Missing key in
  checkpoint state_dict: optimizer.state..." (fsdp_dtensor);
* a torch_dist checkpoint of the distributed optimizer into the plain one (`KeyError:
  "optimizer.state.exp_avg... from model not in state dict"`, the saved state is keyed by buffer
  bucket, or by `fp32_param` where fully reshardable), or of the plain optimizer into the
  distributed one ("ShardedTensor.flattened_range is not supported", whichever sharding type).
Switching between the distributed optimizer's sharding types (dp_reshardable, fully_reshardable)
loads, and is not judged. Nor are the torch format (its args sit in files holding the weights),
Megatron-FSDP on torch_dist, the layer-wise distributed optimizer, or a checkpoint without content
metadata (megatron-core < 0.13): they pass as before.
"""

from __future__ import annotations

import os
from typing import Any

from moe_launcher.checkpoint_files import torch_format
from moe_launcher.checkpoint_files.commit_protocol import loaded_dirname
from moe_launcher.checkpoint_files.metadata import UnreadableCheckpoint, read_checkpoint_metadata
from moe_launcher.runtime.refusals import CheckpointLoadError

# megatron's content-metadata key naming how its distributed optimizer cut the saved state; a
# plain optimizer's save has none.
_SHARDING_TYPE = "distrib_optim_sharding_type"


def _optimizer_name(distributed: bool) -> str:
    return ("the distributed optimizer (--use-distributed-optimizer)" if distributed
            else "the plain optimizer (no --use-distributed-optimizer)")


def load_problems(load_dir: str, ckpt_step: int | None, margs: Any) -> list[str]:
    """Why this run cannot load the optimizer state of the checkpoint in `load_dir`; [] when it
    can, when it loads none, or when the checkpoint says too little to judge."""
    if getattr(margs, "finetune", False) or getattr(margs, "no_load_optim", False):
        return []
    try:
        dirname = loaded_dirname(load_dir, ckpt_step)
    except CheckpointLoadError:
        return []  # the file checks refuse a tracker that does not parse
    if dirname in (None, "release"):  # megatron loads no optimizer from a release checkpoint
        return []
    iteration_dir = os.path.join(load_dir, dirname)
    if not os.path.isfile(os.path.join(iteration_dir, ".metadata")) or \
            torch_format.is_torch_format(iteration_dir):
        return []
    try:
        saved = read_checkpoint_metadata(iteration_dir, with_args=True, with_payload=False)
    except UnreadableCheckpoint:
        return []  # the file checks and the load guard judge an unreadable checkpoint
    fix = ("fix: add --no-load-optim to load its weights only and start a fresh optimizer "
           "(--finetune also restarts the iteration count and the learning-rate schedule)")
    if getattr(saved.args, "no_save_optim", False):
        return [f"refusing to resume from {iteration_dir}: it was saved with --no-save-optim, so "
                f"it holds no optimizer state, and this run would load one (megatron-core 0.19.2 "
                f"fails on every rank once the model is built); {fix}"]
    if saved.format != "torch_dist" or saved.content is None or any(
            getattr(side, name, False) for side in (saved.args, margs)
            for name in ("use_megatron_fsdp", "use_layer_wise_distributed_optimizer")):
        return []
    saved_distributed = saved.content.get(_SHARDING_TYPE) is not None
    distributed = bool(getattr(margs, "use_distributed_optimizer", False))
    if saved_distributed == distributed:
        return []
    return [f"refusing to resume from {iteration_dir}: its optimizer state was saved by "
            f"{_optimizer_name(saved_distributed)} and this run uses "
            f"{_optimizer_name(distributed)}; megatron-core 0.19.2 cannot load one's state into "
            f"the other (it fails on every rank once the model is built); fix: resume "
            f"{'with' if saved_distributed else 'without'} --use-distributed-optimizer as "
            f"saved, or add --no-load-optim to load its weights only and start a fresh optimizer"]
