"""Refuses to load a checkpoint whose tensors do not match the model (Megatron-LM #1836).

Load guard ("checkpoint-load-guard"): before megatron reads anything it compares the
checkpoint's `.metadata` with the state dict of the model being loaded into and with the args
saved in the checkpoint (for torch_dist inside `dist_checkpointing.load`, on the state dict its
`load_preprocess` returns, before anything is read; megatron.training's
`preprocess_fsdp_dtensor_state_dict` inside `_load_base_checkpoint` for fsdp_dtensor), then all
ranks agree. Tensors megatron itself allows to differ in shape (`allow_shape_mismatch`: the
TP-dependent vocabulary padding of embeddings, output layer, MTP) are only checked for tiling.
A difference the parallel layout explains (dp_reshardable optimizer buckets) is refused as a
layout change, not as #1836. A torch_dist tensor the run loads and the checkpoint lacks (another
--optimizer, a switch between fp32 and bf16/fp16, a model built otherwise), where megatron's
strict handling would fail the load on every rank with a KeyError, is refused naming the tensors,
the optimizer flags changed since the save, and the fix.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import re
from typing import Any, Callable

import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_patches import registry
from moe_launcher.checkpoint_files import reads as checkpoint_reads
from moe_launcher.runtime import collectives
from moe_launcher.checkpoint_files.geometry import coverage
from moe_launcher.checkpoint_files.metadata import (
    TRACKER_FILE,
    SavedTensor,
    UnreadableCheckpoint,
    read_checkpoint_metadata,
)
from moe_launcher.checkpoint_files.shape_rules import ModelDims, expected_shape, shape_matches
from moe_launcher.model.param_shapes import sharded_tensors

# The save guard's wrap serves both guards (they wrap different functions).
from megatron_patches.checkpointing.checkpoint_completeness_guard import (
    UPSTREAM,
    VERSIONS,
    IncompleteCheckpointError,
    _listing,
    _megatron_training_checkpointing,
    _wrap,
)


NAME = "checkpoint-load-guard"
# Problem kinds, most serious first: the refusal is worded after the first kind present.
DAMAGE, MISMATCH, LAYOUT, ABSENT = "damage", "mismatch", "layout", "absent"
# megatron's strict handlings (--dist-ckpt-strictness) under which a tensor the run loads and the
# checkpoint lacks fails the load on every rank: the default in torch's load planner (`KeyError:
# "... from model not in state dict"`), the raise_* ones in megatron's own validation. The others
# drop it from the load (log_*, return_*, ignore_all).
_ABSENT_FAILS = ("assume_ok_unexpected", "raise_unexpected", "raise_all")
_ABSENT_PER_RANK = 24  # what one rank sends of its absent tensors' names
# The arguments whose change makes a resume's optimizer tensors others than the saved ones.
_OPTIMIZER_FLAGS = (("--optimizer", "optimizer"), ("--bf16", "bf16"), ("--fp16", "fp16"),
                    ("--use-distributed-optimizer", "use_distributed_optimizer"))
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
    """(tensors, dims, (saved layout, current layout), saved args) or the reason it cannot be
    read. Reads `.metadata` once and stats no .distcp file (checkpoint-load-integrity checks the
    files)."""
    meta = read_checkpoint_metadata(str(checkpoint_dir), with_args=True, with_payload=False)
    dims = ModelDims.from_args(meta.args) if meta.args is not None else None
    return meta.tensors, dims, (_saved_layout(meta.args), _current_layout()), meta.args


def load_problems(sharded_state_dict: Any, checkpoint_dir: str,
                  strict: Any = "assume_ok_unexpected") -> list[tuple[str, str]]:
    """(kind, problem) for loading torch_dist `checkpoint_dir` into this rank's state dict
    under megatron's `strict` handling."""
    try:
        saved, dims, layouts, _ = _checkpoint_for_load(checkpoint_dir)
    except UnreadableCheckpoint as e:
        return [(DAMAGE, str(e))]
    shardings = sharded_tensors(sharded_state_dict)
    problems = judge_against_saved(shardings, saved, dims, layouts)
    if getattr(strict, "value", strict) in _ABSENT_FAILS:
        absent = sorted({sh.key for sh in shardings if sh.key not in saved})
        # dp_reshardable buckets are cut by the layout: absent ones after a layout change are it
        moved = layouts[0] is not None and layouts[0] != layouts[1]
        problems += [(LAYOUT, f"{key}: not in the checkpoint")
                     if moved and _LAYOUT_BOUND.search(key) else (ABSENT, key)
                     for key in absent[:_ABSENT_PER_RANK]]
    return problems


def judge_against_saved(shardings: list[ShardedTensor], saved: dict[str, SavedTensor],
                        dims: ModelDims | None, layouts: tuple) -> list[tuple[str, str]]:
    """(kind, problem) for this rank's ShardedTensors against the checkpoint's tensors; each
    tensor is judged once (a rank holds many pieces of one key: experts, optimizer states)."""
    problems, judged = set(), set()
    for sh in shardings:
        question = (sh.key, tuple(sh.global_shape), sh.allow_shape_mismatch)
        # absent keys: load_problems, after megatron's strict handling
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
        saved, dims, layouts, _ = _checkpoint_for_load(checkpoint_dir)
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


def _changed_optimizer_flags(saved_args: Any) -> str:
    """'--optimizer adam -> sgd, ...' for the optimizer arguments this run changed."""
    from megatron.training.global_vars import get_args

    if saved_args is None:
        return ""
    run = get_args()
    values = [(flag, getattr(saved_args, name, None) or False, getattr(run, name, None) or False)
              for flag, name in _OPTIMIZER_FLAGS]  # an unset flag is None or False
    return ", ".join(f"{flag} {was} -> {now}" for flag, was, now in values if was != now)


def _absent_refusal(checkpoint_dir: Any, keys: list[str], saved_args: Any) -> str:
    changed = _changed_optimizer_flags(saved_args)
    since = f" (changed since the save: {changed})" if changed else ""
    weights_only = (" or add --no-load-optim to load its weights only and start a fresh "
                    "optimizer" if all(key.startswith("optimizer.") for key in keys) else "")
    return (f"[megatron_patches] refusing to load {checkpoint_dir}: it holds none of these "
            f"tensors this run loads{since}, and megatron-core would fail on every rank at the "
            f"load; fix: resume with the flags it was saved with{weights_only}.{_listing(keys)}")


def _load_refusal(checkpoint_dir: Any, problems: list[tuple[str, str]], layouts: tuple,
                  saved_args: Any = None) -> str:
    kinds = {kind for kind, _ in problems}
    lines = [text for _, text in problems]
    if kinds & {DAMAGE, MISMATCH}:
        return (f"[megatron_patches] refusing to load {checkpoint_dir}: it does not hold this "
                f"model's tensors ({UPSTREAM}; an ETP>1 checkpoint written with 1/ETP expert "
                f"shapes looks like this). Audit it with `python -m "
                f"megatron_patches.checkpoint_audit {checkpoint_dir}`.{_listing(lines)}")
    if ABSENT in kinds and LAYOUT not in kinds:
        return _absent_refusal(checkpoint_dir, [text for kind, text in problems if kind == ABSENT],
                               saved_args)
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
        layouts, saved_args = (None, _current_layout()), None
        try:
            _, _, layouts, saved_args = _checkpoint_for_load(checkpoint_dir)
        except UnreadableCheckpoint:
            pass
        raise IncompleteCheckpointError(_load_refusal(
            checkpoint_dir, [tuple(p.split("\t", 1)) for p in everyone], layouts, saved_args))


# torch_dist loads: (the directory `dist_checkpointing.load` is loading from, its strict
# handling), while it runs.
_TORCH_DIST_LOAD = contextvars.ContextVar("megatron_patches_torch_dist_load", default=None)


def _guard_load(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        call = signature.bind(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        call.apply_defaults()
        # megatron's load then reuses the `.metadata` and common state the check read.
        with checkpoint_reads.reading_once():
            token = _TORCH_DIST_LOAD.set((checkpoint_dir, call.arguments.get("strict")))
            try:
                return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            finally:
                _TORCH_DIST_LOAD.reset(token)

    load.__wrapped_by__ = NAME
    return load


def _guard_load_preprocess(original: Callable) -> Callable:
    """The check runs on the state dict megatron's `load_preprocess` returns: its factories are
    built already (building them again costs as much again), and nothing has been read yet."""
    @functools.wraps(original)
    def load_preprocess(sharded_state_dict, *args, **kwargs):
        result = original(sharded_state_dict, *args, **kwargs)
        loading = _TORCH_DIST_LOAD.get()
        if loading is not None:
            checkpoint_dir, strict = loading
            _refuse_if_any(checkpoint_dir, load_problems(result[0], checkpoint_dir, strict))
        return result

    load_preprocess.__wrapped_by__ = NAME
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

    _load_base_checkpoint.__wrapped_by__ = NAME
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

    preprocess_fsdp_dtensor_state_dict.__wrapped_by__ = NAME
    return preprocess_fsdp_dtensor_state_dict


def apply_load_guard() -> None:
    checkpoint_reads.install()  # the guard's reads are the ones megatron's load then reuses
    # megatron.training.checkpointing calls `dist_checkpointing.load`, looked up at call time.
    for module in (serialization, dist_checkpointing):
        _wrap(module, "load", _guard_load, NAME)
    _wrap(serialization, "load_preprocess", _guard_load_preprocess, NAME)
    checkpointing = _megatron_training_checkpointing()
    if checkpointing is not None and hasattr(checkpointing, "preprocess_fsdp_dtensor_state_dict"):
        _wrap(checkpointing, "_load_base_checkpoint", _guard_load_base_checkpoint, NAME)
        _wrap(checkpointing, "preprocess_fsdp_dtensor_state_dict", _guard_preprocess_fsdp_dtensor,
              NAME)


LOAD_GUARD = registry.register(registry.Patch(
    name=NAME,
    upstream=UPSTREAM,
    versions=VERSIONS,
    summary="all ranks refuse to load a checkpoint whose tensors do not match the model",
    not_needed_because=lambda context: None,
    apply=apply_load_guard,
))
