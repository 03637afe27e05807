"""Whether this run can load the optimizer state of the checkpoint it resumes from, judged from the
checkpoint's saved args, content metadata and file names (no tensor data): the optimizer check
behind checkpoint-load-integrity.

megatron-core 0.19.2 fails on every rank, after the model and optimizer are built, with a
traceback naming neither cause nor fix, when a resume loads optimizer state (no --no-load-optim,
no --finetune, not a release checkpoint) from
* a checkpoint saved with --no-save-optim: `KeyError: 'optimizer'` (torch_dist, torch: megatron
  builds the state dict without an optimizer, then reads `state_dict['optimizer']`), or "Missing
  key in checkpoint state_dict: optimizer.state..." (fsdp_dtensor);
* a checkpoint of the distributed optimizer into the plain one (torch_dist: `KeyError:
  "optimizer.state.exp_avg... from model not in state dict"`, the saved state is keyed by buffer
  bucket, or by `fp32_param` where fully reshardable; torch: `KeyError: 'state'`), or of the
  plain optimizer into the distributed one (torch_dist: "ShardedTensor.flattened_range is not
  supported", whichever sharding type; torch: `KeyError: 'step'`).
Switching between the distributed optimizer's sharding types (dp_reshardable, fully_reshardable)
loads, and is not judged. Nor are Megatron-FSDP (its own optimizer on both sides), the
layer-wise distributed optimizer, or a torch_dist checkpoint without content metadata
(megatron-core < 0.13): they pass as before.
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
DISTRIBUTED_STATE_FILE = "distrib_optim.pt"


def _optimizer_name(distributed: bool) -> str:
    return ("the distributed optimizer (--use-distributed-optimizer)" if distributed
            else "the plain optimizer (no --use-distributed-optimizer)")


def _saved_optimizer(iteration_dir: str) -> tuple[Any, bool | None] | None:
    """(saved args, whether the distributed optimizer saved its state: None where the checkpoint
    does not say) of a torch_dist, fsdp_dtensor or torch-format checkpoint; None where it cannot
    be read (the file checks and the load guard judge that) or is none of them."""
    if torch_format.is_torch_format(iteration_dir):
        files = torch_format.model_files(iteration_dir)
        if not files:
            return None
        # megatron's torch format keeps the distributed optimizer's state in a file of its own
        # beside each model file (get_distributed_optimizer_checkpoint_name).
        return (torch_format.saved_args(files[0]),
                os.path.isfile(os.path.join(os.path.dirname(files[0]), DISTRIBUTED_STATE_FILE)))
    if not os.path.isfile(os.path.join(iteration_dir, ".metadata")):
        return None
    try:
        saved = read_checkpoint_metadata(iteration_dir, with_args=True, with_payload=False)
    except UnreadableCheckpoint:
        return None
    if saved.format != "torch_dist" or saved.content is None:
        return saved.args, None  # fsdp_dtensor: Megatron-FSDP's own optimizer on both sides
    return saved.args, saved.content.get(_SHARDING_TYPE) is not None


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
    saved = _saved_optimizer(iteration_dir) if os.path.isdir(iteration_dir) else None
    if saved is None:
        return []
    saved_args, saved_distributed = saved
    if getattr(saved_args, "no_save_optim", False):
        return [f"refusing to resume from {iteration_dir}: it was saved with --no-save-optim, so "
                f"it holds no optimizer state, and this run would load one (megatron-core 0.19.2 "
                f"fails on every rank once the model is built); fix: add --no-load-optim to load "
                f"its weights only and start a fresh optimizer (--finetune also restarts the "
                f"iteration count and the learning-rate schedule)"]
    distributed = bool(getattr(margs, "use_distributed_optimizer", False))
    if saved_distributed in (None, distributed) or any(
            getattr(side, name, False) for side in (saved_args, margs)
            for name in ("use_megatron_fsdp", "use_layer_wise_distributed_optimizer")):
        return []
    return [f"refusing to resume from {iteration_dir}: its optimizer state was saved by "
            f"{_optimizer_name(saved_distributed)} and this run uses "
            f"{_optimizer_name(distributed)}; megatron-core 0.19.2 cannot load one's state into "
            f"the other (it fails on every rank once the model is built); fix: resume "
            f"{'with' if saved_distributed else 'without'} --use-distributed-optimizer as "
            f"saved, or add --no-load-optim to load its weights only and start a fresh optimizer"]
