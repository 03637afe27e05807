"""Refuses to save or load a checkpoint whose tensor layout is incomplete (Megatron-LM #1836).

Save guard ("checkpoint-completeness-guard"): megatron's own `validate_sharding_integrity` runs by
default on save and checks that main replicas tile each tensor's *declared* global shape, but
(a) it never compares that shape with the model config, which is exactly how #1836 slipped
through (expert global shapes 1/ETP of the truth, tiled perfectly), and (b) it raises on rank 0
only, leaving the other ranks to hang in the save collectives. The guard runs on every rank on
the metadata megatron has already all-gathered, checks tiling and config-implied shapes (expert
tensors first) and raises everywhere before a byte is written, so the previous checkpoint and
the tracker file stay as they were. fsdp_dtensor saves (torch.distributed.checkpoint.save of
DTensors, whose placements always cover their shape) get the config-shape check.

Load guard ("checkpoint-load-guard"): before `dist_checkpointing.load` reads anything it compares
the checkpoint's `.metadata` with the sharded state dict of the model being loaded into (and with
the config), then agrees across ranks so every rank stops with the same message instead of some
loading wrong expert weights or waiting forever. megatron-core 0.19.2 itself rejects a plain
global-shape mismatch, but it loads without a word a checkpoint whose chunks leave part of a
tensor uncovered (those regions keep their initial values), and a model built by an affected
version agrees with its own damaged checkpoint; the guard catches both.

The model config comes from the `args` megatron puts in every checkpoint's common state, else
from megatron's global args.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed.checkpoint

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import serialization, state_dict_utils
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies import fully_parallel
from megatron.core.dist_checkpointing.validation import determine_global_metadata

from megatron_patches import registry
from megatron_patches.checkpoint_audit import (
    ModelDims,
    TensorFinding,
    UnreadableCheckpoint,
    expected_shape,
    judge_tensor,
    read_checkpoint_metadata,
)

UPSTREAM = "NVIDIA/Megatron-LM#1836"
VERSIONS = ">=0.15,<0.20"
_MARK = "_megatron_patches_checkpoint_guard"

class IncompleteCheckpointError(CheckpointingException):
    """A save or load was refused because the checkpoint layout is incomplete or wrong."""


def _model_dims(common_state_dict: Any = None) -> ModelDims | None:
    if isinstance(common_state_dict, dict) and common_state_dict.get("args") is not None:
        return ModelDims.from_args(common_state_dict["args"])
    from megatron.training import global_vars  # only when running under megatron.training

    args = global_vars._GLOBAL_ARGS
    return ModelDims.from_args(args) if args is not None and hasattr(args, "hidden_size") else None


# ---------------------------------------------------------------------------------------------
# Save guard
# ---------------------------------------------------------------------------------------------


def layout_findings(global_metadata: list[list[Any]], dims: ModelDims | None) -> list[TensorFinding]:
    """Judges the main-replica layout of every ShardedTensor key across all ranks' metadata."""
    by_key: dict[str, list[ShardedTensor]] = defaultdict(list)
    for rank_metadata in global_metadata:
        for sharding in rank_metadata:
            if isinstance(sharding, ShardedTensor):
                by_key[sharding.key].append(sharding)
    findings = []
    for key, shardings in by_key.items():
        first = shardings[0]
        findings.append(judge_tensor(key, first.global_shape, first.dtype.itemsize,
                                     _main_replica_boxes(shardings), dims))
    return sorted(findings, key=lambda t: (not t.expert, t.key))


def _main_replica_boxes(shardings: list[ShardedTensor]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(global_offset, size) per main-replica chunk; flattened chunks count when whole."""
    flat_cover: dict[tuple, int] = defaultdict(int)
    boxes = []
    for sh in shardings:
        if not is_main_replica(sh.replica_id):
            continue
        box = (tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        if sh.flattened_range is None:
            boxes.append(box)
        else:
            # Distributed-optimizer shards: a box is saved once its flat pieces add up to it.
            flat_cover[box] += sh.flattened_range.stop - sh.flattened_range.start
    boxes.extend(box for box, n in flat_cover.items() if n == math.prod(box[1]))
    return boxes


def describe_refusal(findings: list[TensorFinding], what: str) -> str:
    bad = [t for t in findings if not t.ok]
    lines = [f"[megatron_patches] refusing to {what}: {len(bad)} tensor(s) would be incomplete "
             f"({UPSTREAM})"]
    for t in bad[:8]:
        missing = t.missing_fraction
        if t.shape_ok is False and t.expected_bytes:
            missing = max(missing, 1 - t.saved_bytes / t.expected_bytes)
        lines.append(f"  {t.key}: {t.problem()}; main replicas: {t.layout}; "
                     f"missing fraction {missing:.1%}")
    if len(bad) > 8:
        lines.append(f"  ... and {len(bad) - 8} more")
    return "\n".join(lines)


def enforce_complete_layout(global_metadata: list[list[Any]], common_state_dict: Any = None) -> None:
    """Raises on every rank (each holds the same all-gathered metadata) if the layout is wrong."""
    findings = layout_findings(global_metadata, _model_dims(common_state_dict))
    if any(not t.ok for t in findings):
        raise IncompleteCheckpointError(describe_refusal(findings, "save the checkpoint"))


def _guard_validate(original: Callable) -> Callable:
    @functools.wraps(original)
    def validate_sharding_integrity(global_metadata, common_state_dict=None):
        enforce_complete_layout(global_metadata, common_state_dict)
        return original(global_metadata, common_state_dict)

    setattr(validate_sharding_integrity, _MARK, True)
    return validate_sharding_integrity


def _guard_save_preprocess(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_preprocess(sharded_state_dict, validate_access_integrity=True, *args, **kwargs):
        sharded_part, common_state_dict = original(
            sharded_state_dict, validate_access_integrity, *args, **kwargs)
        if not validate_access_integrity:
            # Megatron skipped its gather (e.g. --ckpt-assume-constant-structure): do our own.
            enforce_complete_layout(determine_global_metadata(sharded_part)[1], common_state_dict)
        return sharded_part, common_state_dict

    setattr(save_preprocess, _MARK, True)
    return save_preprocess


def apply_save_guard() -> None:
    # save_preprocess looks validate_sharding_integrity up in state_dict_utils; the fully
    # parallel strategy imported its own reference.
    for module in (state_dict_utils, fully_parallel):
        if not hasattr(module.validate_sharding_integrity, _MARK):
            module.validate_sharding_integrity = _guard_validate(module.validate_sharding_integrity)
    if not hasattr(serialization.save_preprocess, _MARK):
        serialization.save_preprocess = _guard_save_preprocess(serialization.save_preprocess)
    # fsdp_dtensor: megatron.training calls torch.distributed.checkpoint.save on DTensors.
    if not hasattr(torch.distributed.checkpoint.save, _MARK):
        torch.distributed.checkpoint.save = _guard_dcp_save(torch.distributed.checkpoint.save)


def dtensor_findings(state_dict: dict, dims: ModelDims | None) -> list[TensorFinding]:
    """Config-implied shape verdicts for an fsdp_dtensor state dict (keys as DCP flattens them).

    A DTensor's shape is its global shape and its placements cover it by construction, so only
    the shape can be wrong: under #1836 expert DTensors sat Replicate on a mesh without the
    ETP dim, their global shape 1/ETP of the truth.
    """
    if dims is None:
        return []
    findings = []
    for key, value in _flatten(state_dict):
        if isinstance(value, torch.Tensor) and expected_shape(key, value.shape, dims) is not None:
            shape = tuple(value.shape)
            findings.append(judge_tensor(key, shape, value.element_size(),
                                         [((0,) * len(shape), shape)], dims))
    return sorted(findings, key=lambda t: (not t.expert, t.key))


def _flatten(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def _guard_dcp_save(original: Callable) -> Callable:
    @functools.wraps(original)
    def save(state_dict, *args, **kwargs):
        dims = _model_dims(state_dict)
        bad = [t for t in dtensor_findings(state_dict, dims) if not t.ok]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # Every rank must refuse, or the others wait in DCP's collectives forever.
            counts: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(counts, len(bad))
            refuse = any(counts)
        else:
            refuse = bool(bad)
        if refuse:
            raise IncompleteCheckpointError(describe_refusal(bad, "save the checkpoint") if bad
                                            else "[megatron_patches] refusing to save the "
                                            "checkpoint: another rank found tensors with wrong "
                                            f"global shapes ({UPSTREAM})")
        return original(state_dict, *args, **kwargs)

    setattr(save, _MARK, True)
    return save


def _save_guard_not_needed(context: registry.PatchContext) -> str | None:
    # Needed on every targeted version: even where megatron writes correct layouts, its own
    # check ignores the config and raises on rank 0 only.
    return None


SAVE_GUARD = registry.register(registry.Patch(
    name="checkpoint-completeness-guard",
    upstream=UPSTREAM,
    versions=VERSIONS,
    summary="every rank checks main replicas tile the config-implied global shape before saving",
    not_needed_because=_save_guard_not_needed,
    apply=apply_save_guard,
))


# ---------------------------------------------------------------------------------------------
# Load guard
# ---------------------------------------------------------------------------------------------


def _local_sharded_tensors(sharded_state_dict: Any) -> list[ShardedTensor]:
    tensors = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory):
            tensors.extend(v for v in nested_values(value.build()) if isinstance(v, ShardedTensor))
        elif isinstance(value, ShardedTensor):
            tensors.append(value)
    return tensors


def load_problems(sharded_state_dict: Any, checkpoint_dir: str, dims: ModelDims | None) -> list[str]:
    """What is wrong with loading `checkpoint_dir` into this rank's `sharded_state_dict`."""
    try:
        saved = read_checkpoint_metadata(str(checkpoint_dir), with_args=False).tensors
    except UnreadableCheckpoint as e:
        return [str(e)]
    problems = []
    for sh in _local_sharded_tensors(sharded_state_dict):
        ckpt = saved.get(sh.key)
        if ckpt is None:
            continue  # missing keys are megatron's strict-loading business
        if ckpt.global_shape != tuple(sh.global_shape):
            problems.append(f"{sh.key}: checkpoint global shape {list(ckpt.global_shape)}, "
                            f"model expects {list(sh.global_shape)}")
            continue
        finding = judge_tensor(ckpt.key, ckpt.global_shape, ckpt.itemsize, ckpt.chunks, dims)
        if not finding.ok:
            problems.append(f"{sh.key}: {finding.problem()}")
    return sorted(set(problems))


def _is_layout_bound_optimizer_state(problem: str) -> bool:
    # The distributed optimizer's default (dp_reshardable) format stores flat per-bucket state
    # whose sizes depend on the parallel layout it was saved with.
    return ".optimizer.distributed." in problem and ".bucket_idx_" in problem


def _load_refusal(checkpoint_dir: Any, problems: list[str]) -> str:
    def listing(lines: list[str]) -> str:
        more = f"\n  ... and {len(lines) - 8} more" if len(lines) > 8 else ""
        return "\n  " + "\n  ".join(lines[:8]) + more

    model = [p for p in problems if not _is_layout_bound_optimizer_state(p)]
    if model:
        return (f"[megatron_patches] refusing to load {checkpoint_dir}: it does not hold this "
                f"model's tensors ({UPSTREAM}; an ETP>1 checkpoint written with 1/ETP expert "
                f"shapes looks like this). Audit it with `python -m "
                f"megatron_patches.checkpoint_audit {checkpoint_dir}`.{listing(model)}")
    return (f"[megatron_patches] refusing to load {checkpoint_dir}: its distributed-optimizer "
            f"state was saved for another parallel layout (dp_reshardable buckets). Fix: resume "
            f"with the layout it was saved with, save with --dist-ckpt-optim-fully-reshardable "
            f"to change layouts, or load the weights only with --no-load-optim."
            f"{listing(problems)}")


def _guard_load(original: Callable) -> Callable:
    @functools.wraps(original)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        problems = load_problems(sharded_state_dict, checkpoint_dir, _model_dims())
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # Every rank must stop, also those whose own tensors happen to be fine.
            everyone: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, problems)
            problems = sorted({p for rank_problems in everyone for p in rank_problems})
        if problems:
            raise IncompleteCheckpointError(_load_refusal(checkpoint_dir, problems))
        return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    setattr(load, _MARK, True)
    return load


def apply_load_guard() -> None:
    # megatron.training.checkpointing calls `dist_checkpointing.load`, looked up at call time.
    for module in (serialization, dist_checkpointing):
        if not hasattr(module.load, _MARK):
            module.load = _guard_load(module.load)


LOAD_GUARD = registry.register(registry.Patch(
    name="checkpoint-load-guard",
    upstream=UPSTREAM,
    versions=VERSIONS,
    summary="all ranks refuse to load a checkpoint whose tensors do not match the model",
    not_needed_because=lambda context: None,
    apply=apply_load_guard,
))
