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
  supported", whichever sharding type; torch: `KeyError: 'step'`);
* a checkpoint of a bf16/fp16 run resumed in fp32 or the other way round, in every format
  (torch_dist's plain optimizer: "ValueError: Could not find parameter group", or `fp32_param`
  tensors it lacks, the distributed one's buckets keyed by dtype; the torch format: `KeyError:
  'state'` or 'optimizer_state_dict'; fsdp_dtensor: "Missing key in checkpoint state_dict:
  optimizer.state..."). Between bf16 and fp16 the plain optimizer, a fully reshardable
  distributed one and Megatron-FSDP load; a dp_reshardable one's buckets are refused by the load
  guard; the torch format's distributed optimizer keys its state by the model's dtype
  (`KeyError: (torch.float16, torch.float16)`), refused here;
* a torch-format checkpoint of another --optimizer (adam <-> sgd: `KeyError: 'momentum'` or
  'step'; torch_dist's absent tensors are the load guard's).
Switching between the distributed optimizer's sharding types (dp_reshardable, fully_reshardable)
or toggling --accumulate-allreduce-grads-in-fp32 loads, and is not judged. Nor are a switch to or
from Megatron-FSDP (the layout checks' business), the layer-wise distributed optimizer, or a
torch_dist checkpoint without content metadata (megatron-core < 0.13) beyond its precision: they
pass as before.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from moe_launcher.checkpoint_files import torch_format
from moe_launcher.checkpoint_files.commit_protocol import loaded_iteration_dir
from moe_launcher.checkpoint_files.metadata import read_checkpoint_metadata

# megatron's content-metadata key naming how its distributed optimizer cut the saved state; a
# plain optimizer's save has none.
_SHARDING_TYPE = "distrib_optim_sharding_type"
_DISTRIBUTED_STATE_FILE = "distrib_optim.pt"


def _optimizer_name(distributed: bool) -> str:
    return ("the distributed optimizer (--use-distributed-optimizer)" if distributed
            else "the plain optimizer (no --use-distributed-optimizer)")


@dataclasses.dataclass(frozen=True)
class _SavedOptimizer:
    args: Any  # the saved megatron arguments (None where none were saved)
    format: str  # "torch_dist", "fsdp_dtensor" or "torch"
    distributed: bool | None  # whether the distributed optimizer saved it; None: not said


def _saved_optimizer(iteration_dir: str) -> _SavedOptimizer | None:
    """What a torch_dist, fsdp_dtensor or torch-format checkpoint says of its optimizer state;
    None where it is none of them or cannot be read: the file checks, the load guard and
    megatron's own load judge that (rank 0 reads here while the other ranks wait for its
    verdict, so nothing it reads may raise past this)."""
    try:
        return _read_saved_optimizer(iteration_dir)
    except Exception:  # a truncated torch-format file or pickle raises anything
        return None


def _read_saved_optimizer(iteration_dir: str) -> _SavedOptimizer | None:
    if torch_format.is_torch_format(iteration_dir):
        files = torch_format.model_files(iteration_dir)
        if not files:
            return None
        # megatron's torch format keeps the distributed optimizer's state in a file of its own
        # beside each model file (get_distributed_optimizer_checkpoint_name).
        return _SavedOptimizer(torch_format.saved_args(files[0]), "torch", os.path.isfile(
            os.path.join(os.path.dirname(files[0]), _DISTRIBUTED_STATE_FILE)))
    if not os.path.isfile(os.path.join(iteration_dir, ".metadata")):
        return None
    saved = read_checkpoint_metadata(iteration_dir, with_args=True, with_payload=False)
    if saved.format != "torch_dist" or saved.content is None:
        # fsdp_dtensor: Megatron-FSDP's own optimizer on both sides
        return _SavedOptimizer(saved.args, saved.format, None)
    return _SavedOptimizer(saved.args, saved.format,
                           saved.content.get(_SHARDING_TYPE) is not None)


def _weights_only(saved_as: str) -> str:
    return (f"fix: resume {saved_as} as saved, or add --no-load-optim to load its weights only "
            f"and start a fresh optimizer")


_FP32 = "fp32 (neither --bf16 nor --fp16)"


def _precision(args: Any) -> str:
    return next((flag for flag in ("--bf16", "--fp16") if getattr(args, flag[2:], False)),
                _FP32)


def load_problems(load_dir: str, ckpt_step: int | None, margs: Any) -> list[str]:
    """Why this run cannot load the optimizer state of the checkpoint in `load_dir`; [] when it
    can, when it loads none, or when the checkpoint says too little to judge."""
    if getattr(margs, "finetune", False) or getattr(margs, "no_load_optim", False):
        return []
    # (None also for a tracker that does not parse: the file checks refuse it)
    iteration_dir = loaded_iteration_dir(load_dir, ckpt_step)
    # megatron loads no optimizer from a release checkpoint
    if iteration_dir is None or os.path.basename(iteration_dir) == "release":
        return []
    saved = _saved_optimizer(iteration_dir)
    if saved is None:
        return []
    refusing = f"refusing to resume from {iteration_dir}: "
    if getattr(saved.args, "no_save_optim", False):
        return [f"{refusing}it was saved with --no-save-optim, so it holds no optimizer state, "
                f"and this run would load one (megatron-core 0.19.2 fails on every rank once the "
                f"model is built); fix: add --no-load-optim to load its weights only and start a "
                f"fresh optimizer (--finetune also restarts the iteration count and the "
                f"learning-rate schedule)"]
    sides = (saved.args, margs)
    megatron_fsdp = [bool(getattr(side, "use_megatron_fsdp", False)) for side in sides]
    if megatron_fsdp[0] != megatron_fsdp[1] or any(
            getattr(side, "use_layer_wise_distributed_optimizer", False) for side in sides):
        return []
    precision = _precision_problem(saved, margs)
    if precision:
        return [refusing + precision]
    if megatron_fsdp[0]:
        return []  # Megatron-FSDP's own optimizer on both sides
    distributed = bool(getattr(margs, "use_distributed_optimizer", False))
    if saved.distributed not in (None, distributed):
        return [f"{refusing}its optimizer state was saved by "
                f"{_optimizer_name(saved.distributed)} and this run uses "
                f"{_optimizer_name(distributed)}; megatron-core 0.19.2 cannot load one's state "
                f"into the other (it fails on every rank once the model is built); "
                + _weights_only(f"{'with' if saved.distributed else 'without'} "
                                f"--use-distributed-optimizer")]
    was, now = (getattr(side, "optimizer", None) for side in sides)
    if saved.format == "torch" and None not in (was, now) and was != now:
        return [f"{refusing}its optimizer state was saved by --optimizer {was} and this run uses "
                f"--optimizer {now}: megatron-core 0.19.2's torch-format load looks for one's "
                f"state in the other's and fails on every rank once the model is built; "
                + _weights_only(f"with --optimizer {was}")]
    return []


def _precision_problem(saved: _SavedOptimizer, margs: Any) -> str | None:
    """Why the optimizer state saved in one precision cannot be loaded in this run's; None when
    it can or the checkpoint does not say. Between fp32 and bf16/fp16 the optimizers keep other
    state (fp32 main weights beside the bf16/fp16 ones) in every format; the torch format's
    distributed optimizer keys its state by the model's dtype, so it fails between bf16 and
    fp16 too."""
    if saved.args is None:
        return None
    was, now = _precision(saved.args), _precision(margs)
    keyed_by_dtype = saved.format == "torch" and saved.distributed
    if was == now or not (keyed_by_dtype or _FP32 in (was, now)):
        return None
    return (f"its optimizer state was saved by a run in {was} and this one trains in {now}: "
            f"megatron-core 0.19.2 keeps other optimizer state for each "
            + ("(its torch-format distributed optimizer keys the state by the model's dtype)"
               if keyed_by_dtype and _FP32 not in (was, now) else
               "(fp32 main weights beside the bf16/fp16 ones)")
            + f" and the load fails on every rank once the model is built; "
            + _weights_only(f"in {was}"))
