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
  own ShardedTensors/DTensors against the parameters behind them (moe_launcher.model.param_shapes:
  local shape, partition dim, the size of the group that partitions it), the ranks agree on the
  union of problems and every rank refuses before a byte is written. No flag name enters. A
  run that saves in torch_dist is judged once before training too (where get_megatron_optimizer
  gets the built model): a layout no save could write is refused before iteration 1.
* tiling: on the metadata megatron has already all-gathered for its own check (or, where it
  skips that gather, on our own), every rank checks that main replicas cover each tensor once,
  so every rank raises the same error instead of rank 0 alone.
* both checks run once per structure: a later save whose sharded entries are unchanged on
  every rank (one small all-gather of a flag) reuses the verdict instead of walking every
  parameter and every rank's metadata again. With --ckpt-assume-constant-structure (megatron
  then gathers and checks at the first save only) the guard gathers nothing more either.

Core-only callers (no megatron.training, e.g. megatron-core 0.15 with Megatron-FSDP) call
`refuse_wrong_model_shapes(state_dict, model_chunks)` where they build their state dict.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections import defaultdict
from typing import Any, Callable

import numpy as np
from torch.distributed.tensor import DTensor

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

from megatron_patches import registry
from moe_launcher.runtime import collectives
from moe_launcher.checkpoint_files.geometry import (
    Coverage,
    coverage,
    coverage_of_arrays,
    describe_chunks,
)
from moe_launcher.model.param_shapes import (
    Judgement,
    ModelParams,
    judge_dtensor_state_dict,
    judge_sharded_state_dict,
)

UPSTREAM = "NVIDIA/Megatron-LM#1836"
VERSIONS = ">=0.15,<0.20"
NAME = "checkpoint-completeness-guard"
_LISTED = 8  # problems shown per refusal


class IncompleteCheckpointError(CheckpointingException):
    """A save or load was refused because the checkpoint layout is incomplete or wrong."""

    refusal_names_its_fix = True  # atomic-checkpoint-commit then keeps this message's fix
    every_rank = True  # the guards gather their verdict: every rank refuses alike


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

def _say_unjudged_once(keys: list[str], said: set[str]) -> None:
    if keys and "unjudged" not in said and collectives.rank() == 0:
        said.add("unjudged")
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
        verdict.to_tile += one.to_tile
    return verdict


def _say_tiled_once(keys: list[str], said: set[str]) -> None:
    if keys and "tiled" not in said and collectives.rank() == 0:
        said.add("tiled")
        print(f"[megatron_patches] checkpoint-completeness-guard: {len(keys)} tensor(s) declare a "
              f"global shape larger than their parameter, which megatron did not mark "
              f"tensor-parallel (e.g. {keys[0]}); the ranks' pieces tile it exactly once, so "
              f"they pass", flush=True)


def refuse_wrong_model_shapes(state_dict: dict, model_chunks: Any,
                              said: set[str] | None = None) -> None:
    """Raises on every rank if any rank's model tensors declare a global shape their parameters
    contradict. Collective: every rank must call it (the pieces of a key may lie on any rank).
    `said`: the notes already printed (the guard's record), so that each is printed once."""
    said = set() if said is None else said
    verdict = judge_model_state_dict(state_dict, model_chunks)
    # Unmarked parameters declared larger than themselves are judged on every rank's pieces:
    # they pass where the main replicas tile the declared shape once (one gather, with the
    # verdicts).
    gathered = collectives.gather_objects((verdict.problems, verdict.to_tile))
    problems = sorted({problem for mine, _ in gathered for problem in mine})
    tiled = [pieces for _, pieces in gathered]
    if any(tiled):
        untiled = tiling_problems(tiled)
        problems += untiled
        if not untiled:
            _say_tiled_once(sorted({sh.key for pieces in tiled for sh in pieces}), said)
    _say_unjudged_once(sorted(set(verdict.unjudged)), said)
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
# --ckpt-assume-constant-structure, here for every run.
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


class GuardRecord:
    """What the save guard keeps between saves: per check, the fingerprints (this rank's) of
    the structures that passed it, and the notes printed once. One per applied guard, handed
    to its wrappers."""

    def __init__(self):
        self.passed_structures: dict[str, set[int]] = defaultdict(set)
        self.said: set[str] = set()

    def passed_before(self, check: str, fingerprint: int | None) -> bool:
        """Whether every rank's structure is one that passed `check` (collective; a
        `fingerprint` of None never passed)."""
        return not collectives.any_rank(
            fingerprint is None or fingerprint not in self.passed_structures[check])

    def passed(self, check: str, fingerprint: int) -> None:
        passed = self.passed_structures[check]
        if len(passed) >= _KEPT_PER_CHECK:
            passed.clear()
        passed.add(fingerprint)


def _judge_model_once(record: GuardRecord, state_dict: dict, model: Any) -> None:
    """refuse_wrong_model_shapes, unless every rank's model part of `state_dict` has a structure
    that passed before. Collective."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    fingerprint = _structure_fingerprint(
        {k: v for k, v in state_dict.items() if str(k).startswith("model")},
        tuple(id(chunk) for chunk in chunks))
    if not record.passed_before("model shapes", fingerprint):
        refuse_wrong_model_shapes(state_dict, model, said=record.said)
        record.passed("model shapes", fingerprint)


def _guard_generate_state_dict(original: Callable, record: GuardRecord) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate_state_dict(*args, **kwargs):
        state_dict = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        margs, model = bound.arguments["args"], bound.arguments["model"]
        # These formats build the state dict on every rank (the legacy `torch` format does not).
        if getattr(margs, "ckpt_format", None) in ("torch_dist", "fsdp_dtensor"):
            _judge_model_once(record, state_dict, model)
        return state_dict

    generate_state_dict.__wrapped_by__ = NAME
    return generate_state_dict


# ---------------------------------------------------------------------------------------------
# Save guard: tiling of the all-gathered metadata
# ---------------------------------------------------------------------------------------------


def tiling_problems(global_metadata: list[list[Any]]) -> list[str]:
    """Tensors whose main replicas, over all ranks' metadata, do not tile the declared shape once.

    One pass over every rank's shardings keeps, per key, the main replicas' offsets and sizes
    (megatron's own check walks the same entries); the tiling of each key is then judged on
    arrays of them (moe_launcher/checkpoint_files/geometry.py: coverage_of_arrays)."""
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


def _guard_validate(original: Callable, record: GuardRecord) -> Callable:
    @functools.wraps(original)
    def validate_sharding_integrity(global_metadata, common_state_dict=None):
        fingerprint = _own_part_fingerprint(global_metadata)
        if fingerprint is None:
            enforce_complete_layout(global_metadata)
        elif not record.passed_before("tiling", fingerprint):
            enforce_complete_layout(global_metadata)
            record.passed("tiling", fingerprint)
        return original(global_metadata, common_state_dict)

    validate_sharding_integrity.__wrapped_by__ = NAME
    return validate_sharding_integrity


def _guard_save_preprocess(original: Callable, record: GuardRecord) -> Callable:
    @functools.wraps(original)
    def save_preprocess(sharded_state_dict, validate_access_integrity=True, *args, **kwargs):
        sharded_part, common_state_dict = original(
            sharded_state_dict, validate_access_integrity, *args, **kwargs)
        if not validate_access_integrity:
            # Megatron skipped its gather and check (--ckpt-assume-constant-structure: it
            # checked the first save's structure); a structure the guard has not seen pass (in
            # megatron's check or here) is gathered and checked here.
            fingerprint = _structure_fingerprint(sharded_part)
            if not record.passed_before("tiling", fingerprint):
                enforce_complete_layout(determine_global_metadata(sharded_part)[1])
                record.passed("tiling", fingerprint)
        return sharded_part, common_state_dict

    save_preprocess.__wrapped_by__ = NAME
    return save_preprocess


def _judge_before_training(get_megatron_optimizer: Callable, record: GuardRecord) -> Callable:
    """setup_model_and_optimizer hands get_megatron_optimizer the model it built, before the
    optimizer, the load and iteration 1. A run that saves in torch_dist gets its model judged
    there, on the sharded state dict megatron's saves build of it (generate_state_dict's model
    part, with the save's metadata), and the verdict kept for the first save: a model whose
    layout no save could write is refused in seconds, not at the end of the first save
    interval. Where a rank cannot build that state dict yet, the first save judges it, as
    before (said once). Collective: every rank builds, then all judge or none."""
    signature = inspect.signature(get_megatron_optimizer)

    @functools.wraps(get_megatron_optimizer)
    def get_megatron_optimizer_judged(*args, **kwargs):
        from megatron.training import checkpointing, get_args

        margs = get_args()
        if margs.save and getattr(margs, "ckpt_format", None) == "torch_dist":
            from megatron.core.utils import unwrap_model

            model = signature.bind(*args, **kwargs).arguments["model_chunks"]
            # unwrapped as save_checkpoint unwraps them (DDP's state dict prefixes `module.`)
            chunks = unwrap_model(list(model) if isinstance(model, (list, tuple)) else [model])
            build_metadata = getattr(checkpointing, "_build_sharded_state_dict_metadata", None)
            state_dict, failure = {}, None
            try:
                metadata = build_metadata(margs) if build_metadata is not None else None
                for i, chunk in enumerate(chunks):  # megatron's keys: model, or model0, model1..
                    state_dict["model" if len(chunks) == 1 else f"model{i}"] = (
                        chunk.sharded_state_dict(metadata=metadata))
            except Exception as exc:  # noqa: BLE001 -- the first save judges it instead
                failure = f"rank {collectives.rank()}: {type(exc).__name__}: {exc}"
            failures = [f for f in collectives.gather_objects(failure) if f]
            if not failures:
                _judge_model_once(record, state_dict, chunks)
            elif collectives.rank() == 0 and "before training" not in record.said:
                record.said.add("before training")
                print(f"[megatron_patches] {SAVE_GUARD.name}: the model's checkpoint layout "
                      f"could not be judged before training ({failures[0]}); the first save "
                      f"judges it", flush=True)
        return get_megatron_optimizer(*args, **kwargs)

    get_megatron_optimizer_judged.__wrapped_by__ = NAME
    return get_megatron_optimizer_judged


def _wrap(module: Any, name: str, guard: Callable[[Callable], Callable], patch: str) -> None:
    """module.name wrapped by `guard`, once: `guard` marks what it returns as patch `patch`'s."""
    if not registry.wrapped_by(getattr(module, name), patch):
        setattr(module, name, guard(getattr(module, name)))


def apply_save_guard() -> None:
    record = GuardRecord()
    # save_preprocess looks validate_sharding_integrity up in state_dict_utils; the fully
    # parallel strategy imported its own reference.
    for module in (state_dict_utils, fully_parallel):
        _wrap(module, "validate_sharding_integrity",
              functools.partial(_guard_validate, record=record), NAME)
    _wrap(serialization, "save_preprocess",
          functools.partial(_guard_save_preprocess, record=record), NAME)
    if (checkpointing := _megatron_training_checkpointing()) is not None:
        _wrap(checkpointing, "generate_state_dict",
              functools.partial(_guard_generate_state_dict, record=record), NAME)
        from megatron.training import training

        if not registry.wrapped_by(training.get_megatron_optimizer, NAME):
            training.get_megatron_optimizer = _judge_before_training(
                training.get_megatron_optimizer, record)


def _save_guard_not_needed(context: registry.PatchContext) -> str | None:
    # Needed on every targeted version: even where megatron writes correct layouts, its own
    # check never compares the declared shapes with the model and raises on rank 0 only.
    return None


SAVE_GUARD = registry.register(registry.Patch(
    name=NAME,
    upstream=UPSTREAM,
    versions=VERSIONS,
    summary="every rank checks each tensor's global shape against its parameter and that main "
            "replicas tile it, before saving",
    not_needed_because=_save_guard_not_needed,
    apply=apply_save_guard,
))
