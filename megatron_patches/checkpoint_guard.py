"""Refuses to save or load a checkpoint whose tensor layout is incomplete (Megatron-LM #1836).

With expert tensor parallelism (ETP>1) megatron-core <0.16 (Megatron-FSDP) declared expert
weights with a global shape 1/ETP of the truth and wrote one ETP slice; a reload gave the other
ETP ranks the wrong slice. Nothing in such a save looks broken to megatron's own checks: its
`validate_sharding_integrity` checks that main replicas tile each tensor's *declared* global
shape (which the damaged layout does) and raises on rank 0 only, leaving the other ranks in the
save collectives.

Save guard ("checkpoint-completeness-guard"):
* the model's tensors against the truth: megatron.training's `generate_state_dict` (looked up at
  call time by save_checkpoint and load_checkpoint, for torch_dist and fsdp_dtensor, sync and
  async saves alike) is where the model and its sharded state dict meet. Each rank judges its
  own ShardedTensors/DTensors against the parameters behind them (megatron_patches.param_shapes:
  local shape, partition dim, the size of the group that partitions it), the ranks agree on the
  union of problems and every rank refuses before a byte is written. No flag name enters.
* tiling: on the metadata megatron has already all-gathered for its own check (or, where it
  skips that gather, on our own), every rank checks that main replicas cover each tensor once,
  so every rank raises the same error instead of rank 0 alone.
* both checks run once per structure: a later save whose sharded entries are unchanged on
  every rank (one small all-gather of a flag) reuses the verdict instead of walking every
  parameter and every rank's metadata again. With --ckpt-assume-constant-structure (megatron
  then gathers and checks at the first save only) the guard gathers nothing more either.

Load guard ("checkpoint-load-guard"): before megatron reads anything it compares the
checkpoint's `.metadata` with the state dict of the model being loaded into and with the args
saved in the checkpoint (for torch_dist inside `dist_checkpointing.load`, on the state dict its
`load_preprocess` returns, before anything is read; megatron.training's
`preprocess_fsdp_dtensor_state_dict` inside `_load_base_checkpoint` for fsdp_dtensor), then all
ranks agree. Tensors megatron itself allows to differ in shape (`allow_shape_mismatch`: the
TP-dependent vocabulary padding of embeddings, output layer, MTP) are only checked for tiling.
A difference the parallel layout explains (dp_reshardable optimizer buckets) is refused as a
layout change, not as #1836.

Core-only callers (no megatron.training, e.g. megatron-core 0.15 with Megatron-FSDP) call
`refuse_wrong_model_shapes(state_dict, model_chunks)` where they build their state dict.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
import os
import re
from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import serialization, state_dict_utils
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedBase,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies import fully_parallel
from megatron.core.dist_checkpointing.validation import determine_global_metadata

from megatron_patches import checkpoint_reads, collectives, registry
from megatron_patches.checkpoint_geometry import (
    Coverage,
    coverage,
    coverage_of_arrays,
    describe_chunks,
)
from megatron_patches.checkpoint_metadata import (
    TRACKER_FILE,
    SavedTensor,
    UnreadableCheckpoint,
    read_checkpoint_metadata,
)
from megatron_patches.config_shape_rules import ModelDims, expected_shape, shape_matches
from megatron_patches.param_shapes import (
    Judgement,
    ModelParams,
    judge_dtensor_state_dict,
    judge_sharded_state_dict,
    sharded_tensors,
)

UPSTREAM = "NVIDIA/Megatron-LM#1836"
VERSIONS = ">=0.15,<0.20"
_MARK = "_megatron_patches_checkpoint_guard"
_LISTED = 8  # problems shown per refusal


class IncompleteCheckpointError(CheckpointingException):
    """A save or load was refused because the checkpoint layout is incomplete or wrong."""

    refusal_names_its_fix = True  # atomic-checkpoint-commit then keeps this message's fix


def _listing(lines: list[str]) -> str:
    more = f"\n  ... and {len(lines) - _LISTED} more" if len(lines) > _LISTED else ""
    return "\n  " + "\n  ".join(lines[:_LISTED]) + more


def _megatron_training_checkpointing():
    """megatron.training.checkpointing, None where megatron.training is not installed."""
    try:
        from megatron.training import checkpointing
    except ImportError:
        return None
    return checkpointing


# ---------------------------------------------------------------------------------------------
# The model's tensors against its parameters (save and load, torch_dist and fsdp_dtensor)
# ---------------------------------------------------------------------------------------------

_said_unjudged = False


def _say_unjudged_once(keys: list[str]) -> None:
    global _said_unjudged
    if keys and not _said_unjudged and collectives.rank() == 0:
        _said_unjudged = True
        print(f"[megatron_patches] checkpoint-completeness-guard: {len(keys)} tensor(s) map onto "
              f"no parameter axis by axis (e.g. {keys[0]}); their global shapes pass unjudged",
              flush=True)


def judge_model_state_dict(state_dict: dict, model_chunks: Any) -> Judgement:
    """This rank's verdict on the model entries (`model`, `model0`, ...) of a megatron state dict."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    params = ModelParams(chunks)
    verdict = Judgement()
    for key, part in state_dict.items():
        if not (isinstance(key, str) and key.startswith("model") and isinstance(part, dict)):
            continue
        if any(isinstance(v, DTensor) for v in part.values()):
            one = judge_dtensor_state_dict(part, params)
        else:
            one = judge_sharded_state_dict(part, params)
        verdict.problems += one.problems
        verdict.unjudged += one.unjudged
        verdict.judged += one.judged
    return verdict


def refuse_wrong_model_shapes(state_dict: dict, model_chunks: Any, group=None) -> None:
    """Raises on every rank of `group` if any rank's model tensors declare a global shape their
    parameters contradict. Collective: every rank of `group` must call it."""
    verdict = judge_model_state_dict(state_dict, model_chunks)
    problems = collectives.union(verdict.problems, group)
    _say_unjudged_once(sorted(set(verdict.unjudged)))
    if problems:
        raise IncompleteCheckpointError(
            f"[megatron_patches] refusing to checkpoint this model: {len(problems)} tensor(s) "
            f"declare a global shape their parameters contradict, so a save would write (and a "
            f"load would fill) only part of them ({UPSTREAM}; 1/ETP expert shapes are its "
            f"signature).{_listing(problems)}")


# Each check runs once per structure. A verdict depends only on the structure of what it
# judges (each sharded entry's key, shapes, offsets, replica and flat range, and the model it
# belongs to; not the data), so a later save whose structure is unchanged on every rank (one
# small all-gather of a flag) reuses it instead of walking every parameter, or every rank's
# gathered metadata, again. This is what megatron itself does with
# --ckpt-assume-constant-structure, here for every run. check name -> fingerprints (this
# rank's) that passed it.
_passed_structures: dict[str, set[int]] = defaultdict(set)
_KEPT_PER_CHECK = 16  # a save validates two structures (before and after the fully parallel split)


def _structure_fingerprint(tree: Any, extra: tuple = ()) -> int:
    """What a check's verdict depends on: each sharded entry's key, shapes, offsets, replica
    and flat range, each DTensor's shape and placements (this rank's; not the data)."""
    entries = []
    for value in nested_values(tree):
        if isinstance(value, ShardedTensorFactory):
            entries.append((value.key, tuple(value.data.shape), str(value.replica_id)))
        elif isinstance(value, ShardedBase):
            flat = getattr(value, "flattened_range", None)
            entries.append((value.key, tuple(value.global_shape), tuple(value.global_offset),
                            tuple(getattr(value, "local_shape", ())), str(value.replica_id),
                            (flat.start, flat.stop) if flat is not None else None))
        elif isinstance(value, DTensor):
            entries.append((tuple(value.shape), str(value.placements)))
    return hash((extra, tuple(entries)))


def _passed_before(check: str, fingerprint: int | None) -> bool:
    """Whether every rank's structure is one that passed `check` (collective; a `fingerprint`
    of None never passed)."""
    return not collectives.any_rank(
        fingerprint is None or fingerprint not in _passed_structures[check])


def _passed(check: str, fingerprint: int) -> None:
    passed = _passed_structures[check]
    if len(passed) >= _KEPT_PER_CHECK:
        passed.clear()
    passed.add(fingerprint)


def _guard_generate_state_dict(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate_state_dict(*args, **kwargs):
        state_dict = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        margs, model = bound.arguments["args"], bound.arguments["model"]
        # These formats build the state dict on every rank (the legacy `torch` format does not).
        if getattr(margs, "ckpt_format", None) in ("torch_dist", "fsdp_dtensor"):
            chunks = model if isinstance(model, (list, tuple)) else [model]
            fingerprint = _structure_fingerprint(
                {k: v for k, v in state_dict.items() if str(k).startswith("model")},
                tuple(id(chunk) for chunk in chunks))
            if not _passed_before("model shapes", fingerprint):
                refuse_wrong_model_shapes(state_dict, model)
                _passed("model shapes", fingerprint)
        return state_dict

    setattr(generate_state_dict, _MARK, True)
    return generate_state_dict


# ---------------------------------------------------------------------------------------------
# Save guard: tiling of the all-gathered metadata
# ---------------------------------------------------------------------------------------------


def tiling_problems(global_metadata: list[list[Any]]) -> list[str]:
    """Tensors whose main replicas, over all ranks' metadata, do not tile the declared shape once.

    One pass over every rank's shardings keeps, per key, the main replicas' offsets and sizes
    (megatron's own check walks the same entries); the tiling of each key is then judged on
    arrays of them (checkpoint_geometry.coverage_of_arrays)."""
    main_by_replica_id: dict[Any, bool] = {}
    by_key: dict[str, _KeyChunks] = {}
    for rank_metadata in global_metadata:
        for sh in rank_metadata:
            if not isinstance(sh, ShardedTensor):
                continue
            chunks = by_key.get(sh.key)
            if chunks is None:
                chunks = by_key[sh.key] = _KeyChunks(sh.global_shape)
            replica = sh.replica_id
            main = main_by_replica_id.get(replica)
            if main is None:
                main = main_by_replica_id[replica] = is_main_replica(replica)
            if not main:
                continue
            if sh.flattened_range is not None:  # distributed-optimizer flat pieces
                chunks.flat.append(sh)
            else:  # inline, not a method: this loop runs once per shard of the checkpoint
                chunks.offsets.append(sh.global_offset)
                chunks.local_shapes.append(sh.local_shape)
                chunks.prepend.append(sh.prepend_axis_num)
    problems = []
    for key, chunks in sorted(by_key.items()):
        cov = chunks.coverage()
        if not cov.exact:
            boxes = chunks.boxes()
            problems.append(f"{key}: {"; ".join(cov.problems())}; global shape "
                            f"{list(chunks.global_shape)}; main replicas: "
                            f"{describe_chunks(boxes)}")
    return problems


class _KeyChunks:
    """One key's main-replica chunks, as tiling_problems collects them."""

    __slots__ = ("global_shape", "offsets", "local_shapes", "prepend", "flat")

    def __init__(self, global_shape):
        self.global_shape = tuple(global_shape)
        self.offsets: list[tuple[int, ...]] = []
        self.local_shapes: list[tuple[int, ...]] = []
        self.prepend: list[int] = []
        self.flat: list[ShardedTensor] = []  # distributed-optimizer flat pieces

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        boxes = [(tuple(o), (1,) * p + tuple(s))
                 for o, s, p in zip(self.offsets, self.local_shapes, self.prepend)]
        return boxes + _whole_flat_boxes(self.flat)

    def coverage(self) -> Coverage:
        ndim = len(self.global_shape)
        if self.flat or len(set(self.prepend)) > 1 or len(set(map(tuple, self.local_shapes))) > 1:
            return coverage(self.global_shape, self.boxes())
        if not self.offsets:
            return coverage(self.global_shape, [])
        size = (1,) * self.prepend[0] + tuple(self.local_shapes[0])
        if len(size) != ndim or any(len(o) != ndim for o in self.offsets):
            return coverage(self.global_shape, self.boxes())  # reports the stray chunks
        offsets = np.asarray(self.offsets, dtype=np.int64).reshape(len(self.offsets), ndim)
        sizes = np.broadcast_to(np.asarray(size, dtype=np.int64), offsets.shape)
        return coverage_of_arrays(np.asarray(self.global_shape, dtype=np.int64), offsets, sizes)


def _whole_flat_boxes(flat: list[ShardedTensor]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Distributed-optimizer shards: a box is saved once its flat pieces add up to it."""
    cover: dict[tuple, int] = defaultdict(int)
    for sh in flat:
        box = (tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        cover[box] += sh.flattened_range.stop - sh.flattened_range.start
    return [box for box, n in cover.items() if n == math.prod(box[1])]


def enforce_complete_layout(global_metadata: list[list[Any]]) -> None:
    """Raises on every rank (each holds the same all-gathered metadata) if the tiling is wrong."""
    problems = tiling_problems(global_metadata)
    if problems:
        raise IncompleteCheckpointError(
            f"[megatron_patches] refusing to save the checkpoint: {len(problems)} tensor(s) "
            f"would be incomplete ({UPSTREAM}){_listing(problems)}")


def _own_part_fingerprint(global_metadata: list[list[Any]]) -> int | None:
    """The fingerprint of this rank's part of metadata all-gathered over all ranks; None for a
    gather over fewer ranks (whose ranks cannot be asked collectively whether it changed)."""
    if len(global_metadata) != collectives.world_size():
        return None
    return _structure_fingerprint(global_metadata[collectives.rank()])


def _guard_validate(original: Callable) -> Callable:
    @functools.wraps(original)
    def validate_sharding_integrity(global_metadata, common_state_dict=None):
        fingerprint = _own_part_fingerprint(global_metadata)
        if fingerprint is None:
            enforce_complete_layout(global_metadata)
        elif not _passed_before("tiling", fingerprint):
            enforce_complete_layout(global_metadata)
            _passed("tiling", fingerprint)
        return original(global_metadata, common_state_dict)

    setattr(validate_sharding_integrity, _MARK, True)
    return validate_sharding_integrity


def _guard_save_preprocess(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_preprocess(sharded_state_dict, validate_access_integrity=True, *args, **kwargs):
        sharded_part, common_state_dict = original(
            sharded_state_dict, validate_access_integrity, *args, **kwargs)
        if not validate_access_integrity:
            # Megatron skipped its gather and check (--ckpt-assume-constant-structure: it
            # checked the first save's structure); a structure the guard has not seen pass (in
            # megatron's check or here) is gathered and checked here.
            fingerprint = _structure_fingerprint(sharded_part)
            if not _passed_before("tiling", fingerprint):
                enforce_complete_layout(determine_global_metadata(sharded_part)[1])
                _passed("tiling", fingerprint)
        return sharded_part, common_state_dict

    setattr(save_preprocess, _MARK, True)
    return save_preprocess


def _wrap(module: Any, name: str, guard: Callable[[Callable], Callable]) -> None:
    if not hasattr(getattr(module, name), _MARK):
        setattr(module, name, guard(getattr(module, name)))


def apply_save_guard() -> None:
    # save_preprocess looks validate_sharding_integrity up in state_dict_utils; the fully
    # parallel strategy imported its own reference.
    for module in (state_dict_utils, fully_parallel):
        _wrap(module, "validate_sharding_integrity", _guard_validate)
    _wrap(serialization, "save_preprocess", _guard_save_preprocess)
    if (checkpointing := _megatron_training_checkpointing()) is not None:
        _wrap(checkpointing, "generate_state_dict", _guard_generate_state_dict)


def _save_guard_not_needed(context: registry.PatchContext) -> str | None:
    # Needed on every targeted version: even where megatron writes correct layouts, its own
    # check never compares the declared shapes with the model and raises on rank 0 only.
    return None


SAVE_GUARD = registry.register(registry.Patch(
    name="checkpoint-completeness-guard",
    upstream=UPSTREAM,
    versions=VERSIONS,
    summary="every rank checks each tensor's global shape against its parameter and that main "
            "replicas tile it, before saving",
    not_needed_because=_save_guard_not_needed,
    apply=apply_save_guard,
))


# ---------------------------------------------------------------------------------------------
# Load guard
# ---------------------------------------------------------------------------------------------

# Problem kinds, most serious first: the refusal is worded after the first kind present.
DAMAGE, MISMATCH, LAYOUT = "damage", "mismatch", "layout"
_LAYOUT_BOUND = re.compile(r"(^|\.)optimizer\.distributed\..*bucket_idx_")
_LAYOUT_NAMES = ("TP", "PP", "EP", "ETP", "CP", "DP")


def _saved_layout(args: Any) -> dict[str, int] | None:
    if args is None:
        return None
    fields = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
              "expert_model_parallel_size", "expert_tensor_parallel_size",
              "context_parallel_size", "data_parallel_size")
    get = args.get if isinstance(args, dict) else functools.partial(getattr, args)
    layout = {name: get(field, None) for name, field in zip(_LAYOUT_NAMES, fields)}
    if layout["ETP"] is None:
        layout["ETP"] = layout["TP"]
    return layout


def _current_layout() -> dict[str, int] | None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
             ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
             ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size())
    return dict(zip(_LAYOUT_NAMES, sizes))


def _describe_layout(layout: dict[str, int] | None) -> str:
    if not layout:
        return "unknown"
    return " ".join(f"{k}={v}" for k, v in layout.items() if v is not None)


def _explained_by_layout(saved_shape, model_shape, saved, current) -> bool:
    """The shapes differ on one axis by a ratio of the saved to the current size of a group."""
    if not saved or not current or saved == current or len(saved_shape) != len(model_shape):
        return False
    axes = [(s, m) for s, m in zip(saved_shape, model_shape) if s != m]
    if len(axes) != 1:
        return False
    s, m = axes[0]
    return any(saved.get(k) and current.get(k) and s * current[k] == m * saved[k]
               for k in _LAYOUT_NAMES)


def _judge_saved(key: str, model_shape, allow_shape_mismatch: bool, saved: SavedTensor,
                 dims: ModelDims | None, layouts: tuple) -> tuple[str, str] | None:
    """(kind, problem) for loading the checkpoint's `saved` tensor into a model tensor."""
    expected = expected_shape(key, saved.global_shape, dims) if dims else None
    contradicts_args = expected is not None and not shape_matches(saved.global_shape, expected)
    args_imply = (f"the args saved with it imply {['*' if e is None else e for e in expected]}"
                  if contradicts_args else "")
    if saved.global_shape != tuple(model_shape) and not allow_shape_mismatch:
        text = (f"{key}: checkpoint global shape {list(saved.global_shape)}, model expects "
                f"{list(model_shape)}")
        if contradicts_args:
            return DAMAGE, f"{text} ({args_imply})"
        if _LAYOUT_BOUND.search(key) or _explained_by_layout(saved.global_shape, model_shape,
                                                             *layouts):
            return LAYOUT, text
        return MISMATCH, text
    if contradicts_args:
        return DAMAGE, f"{key}: checkpoint global shape {list(saved.global_shape)} but {args_imply}"
    cov = coverage(saved.global_shape, saved.chunks)
    if not cov.exact:
        return DAMAGE, f"{key}: {"; ".join(cov.problems())} in the checkpoint"
    return None


def _checkpoint_for_load(checkpoint_dir: str):
    """(tensors, dims, (saved layout, current layout)) or the reason it cannot be read. Reads
    `.metadata` once and stats no .distcp file (checkpoint-load-integrity checks the files)."""
    meta = read_checkpoint_metadata(str(checkpoint_dir), with_args=True, with_payload=False)
    dims = ModelDims.from_args(meta.args) if meta.args is not None else None
    return meta.tensors, dims, (_saved_layout(meta.args), _current_layout())


def load_problems(sharded_state_dict: Any, checkpoint_dir: str) -> list[tuple[str, str]]:
    """(kind, problem) for loading torch_dist `checkpoint_dir` into this rank's state dict."""
    try:
        saved, dims, layouts = _checkpoint_for_load(checkpoint_dir)
    except UnreadableCheckpoint as e:
        return [(DAMAGE, str(e))]
    return judge_against_saved(sharded_tensors(sharded_state_dict), saved, dims, layouts)


def judge_against_saved(shardings: list[ShardedTensor], saved: dict[str, SavedTensor],
                        dims: ModelDims | None, layouts: tuple) -> list[tuple[str, str]]:
    """(kind, problem) for this rank's ShardedTensors against the checkpoint's tensors; each
    tensor is judged once (a rank holds many pieces of one key: experts, optimizer states)."""
    problems, judged = set(), set()
    for sh in shardings:
        question = (sh.key, tuple(sh.global_shape), sh.allow_shape_mismatch)
        # missing keys are megatron's strict-loading business
        if sh.key in saved and question not in judged:
            judged.add(question)
            found = _judge_saved(sh.key, sh.global_shape, sh.allow_shape_mismatch, saved[sh.key],
                                 dims, layouts)
            if found:
                problems.add(found)
    return sorted(problems)


def fsdp_dtensor_load_problems(state_dict: dict, checkpoint_dir: str) -> list[tuple[str, str]]:
    """The same for an fsdp_dtensor load: DTensors keyed the way DCP flattens them."""
    try:
        saved, dims, layouts = _checkpoint_for_load(checkpoint_dir)
    except UnreadableCheckpoint as e:
        return [(DAMAGE, str(e))]
    problems = set()
    for part in ("model", "optimizer"):
        for key, value in _flatten(state_dict.get(part, {}), f"{part}."):
            if isinstance(value, torch.Tensor) and key in saved:
                found = _judge_saved(key, tuple(value.shape), False, saved[key], dims, layouts)
                if found:
                    problems.add(found)
    return sorted(problems)


def _flatten(tree: Any, prefix: str):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def _load_refusal(checkpoint_dir: Any, problems: list[tuple[str, str]], layouts: tuple) -> str:
    kinds = {kind for kind, _ in problems}
    lines = [text for _, text in problems]
    if kinds & {DAMAGE, MISMATCH}:
        return (f"[megatron_patches] refusing to load {checkpoint_dir}: it does not hold this "
                f"model's tensors ({UPSTREAM}; an ETP>1 checkpoint written with 1/ETP expert "
                f"shapes looks like this). Audit it with `python -m "
                f"megatron_patches.checkpoint_audit {checkpoint_dir}`.{_listing(lines)}")
    saved, current = layouts
    return (f"[megatron_patches] refusing to load {checkpoint_dir}: it was saved with another "
            f"parallel layout ({_describe_layout(saved)}; this run {_describe_layout(current)}) "
            f"and these tensors only load into the layout they were saved with (the distributed "
            f"optimizer's default dp_reshardable state is bound to it). Fix: resume with the "
            f"saved layout, or load the weights only with --no-load-optim.{_listing(lines)}")


def _refuse_if_any(checkpoint_dir: str, problems: list[tuple[str, str]]) -> None:
    """Every rank stops, also those whose own tensors happen to be fine."""
    everyone = collectives.union([f"{kind}\t{text}" for kind, text in problems])
    if everyone:
        layouts = (None, _current_layout())
        try:
            layouts = _checkpoint_for_load(checkpoint_dir)[2]
        except UnreadableCheckpoint:
            pass
        raise IncompleteCheckpointError(_load_refusal(
            checkpoint_dir, [tuple(p.split("\t", 1)) for p in everyone], layouts))


# torch_dist loads: the directory `dist_checkpointing.load` is loading from, while it runs.
_TORCH_DIST_LOAD = contextvars.ContextVar("megatron_patches_torch_dist_load", default=None)


def _guard_load(original: Callable) -> Callable:
    @functools.wraps(original)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        # megatron's load then reuses the `.metadata` and common state the check read.
        with checkpoint_reads.reading_once():
            token = _TORCH_DIST_LOAD.set(checkpoint_dir)
            try:
                return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            finally:
                _TORCH_DIST_LOAD.reset(token)

    setattr(load, _MARK, True)
    return load


def _guard_load_preprocess(original: Callable) -> Callable:
    """The check runs on the state dict megatron's `load_preprocess` returns: its factories are
    built already (building them again costs as much again), and nothing has been read yet."""
    @functools.wraps(original)
    def load_preprocess(sharded_state_dict, *args, **kwargs):
        result = original(sharded_state_dict, *args, **kwargs)
        checkpoint_dir = _TORCH_DIST_LOAD.get()
        if checkpoint_dir is not None:
            _refuse_if_any(checkpoint_dir, load_problems(result[0], checkpoint_dir))
        return result

    setattr(load_preprocess, _MARK, True)
    return load_preprocess


# fsdp_dtensor loads: the directory `_load_base_checkpoint` is loading from, while it runs.
_FSDP_LOAD = contextvars.ContextVar("megatron_patches_fsdp_dtensor_load", default=None)


def _fsdp_dtensor_checkpoint_dir(load_dir: str) -> str:
    """The iteration directory megatron's `_load_base_checkpoint` resolves for fsdp_dtensor."""
    checkpointing = _megatron_training_checkpointing()
    with open(os.path.join(load_dir, TRACKER_FILE)) as f:
        release = f.read().strip() == "release"
    return checkpointing.get_checkpoint_name(
        load_dir, checkpointing.get_loaded_iteration(), release, return_base_dir=True)


def _guard_load_base_checkpoint(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _load_base_checkpoint(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        loading = None if bound.arguments["rank0"] else bound.arguments["load_dir"]
        token = _FSDP_LOAD.set(loading)
        try:
            return original(*args, **kwargs)
        finally:
            _FSDP_LOAD.reset(token)

    setattr(_load_base_checkpoint, _MARK, True)
    return _load_base_checkpoint


def _guard_preprocess_fsdp_dtensor(original: Callable) -> Callable:
    @functools.wraps(original)
    def preprocess_fsdp_dtensor_state_dict(args, raw_state_dict, model):
        state_dict = original(args, raw_state_dict, model)
        loading = _FSDP_LOAD.get()
        if loading is not None:  # a load, not a save: compare with what is on disk
            checkpoint_dir = _fsdp_dtensor_checkpoint_dir(loading)
            _refuse_if_any(checkpoint_dir, fsdp_dtensor_load_problems(state_dict, checkpoint_dir))
        return state_dict

    setattr(preprocess_fsdp_dtensor_state_dict, _MARK, True)
    return preprocess_fsdp_dtensor_state_dict


def apply_load_guard() -> None:
    checkpoint_reads.install()  # the guard's reads are the ones megatron's load then reuses
    # megatron.training.checkpointing calls `dist_checkpointing.load`, looked up at call time.
    for module in (serialization, dist_checkpointing):
        _wrap(module, "load", _guard_load)
    _wrap(serialization, "load_preprocess", _guard_load_preprocess)
    checkpointing = _megatron_training_checkpointing()
    if checkpointing is not None and hasattr(checkpointing, "preprocess_fsdp_dtensor_state_dict"):
        _wrap(checkpointing, "_load_base_checkpoint", _guard_load_base_checkpoint)
        _wrap(checkpointing, "preprocess_fsdp_dtensor_state_dict", _guard_preprocess_fsdp_dtensor)


LOAD_GUARD = registry.register(registry.Patch(
    name="checkpoint-load-guard",
    upstream=UPSTREAM,
    versions=VERSIONS,
    summary="all ranks refuse to load a checkpoint whose tensors do not match the model",
    not_needed_because=lambda context: None,
    apply=apply_load_guard,
))
