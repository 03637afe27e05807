"""Megatron-FSDP: each DTensor shard's place in its tensor is found with a few collectives when
the model is wrapped and at each fsdp_dtensor save or load, not several per tensor.

Upstream: megatron-core 0.19.2 `megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor`
(its own TODO: "Implement batched barrier using grouped collectives"); NVIDIA/Megatron-LM PR
#6214 made Megatron-FSDP's v2 path collective-free (merged; not the path megatron.training's
fsdp_dtensor format takes in 0.19.x), PR #6573 (open) batches this one. Targets 0.19.x (read
and tested on 0.19.2).

Megatron-FSDP's shards are uneven, so before DCP writes or reads an fsdp_dtensor checkpoint
`preprocess_fsdp_dtensor_state_dict` works out, for every DTensor of the state dict, where this
rank's shard lies (the chunk's offsets): one `all_gather_object` per DTensor per sharded mesh
dim (`preprocess_state_dict_for_uneven_dtensor`). Before that, the SwiGLU split makes two
DTensors of every fc1 weight and of each of its optimizer states (`make_fsdp_dtensor` with
`run_check`): each half is validated (one more object gather and an all_reduce per sharded mesh
dim) and given its chunk (one more gather per sharded mesh dim), which the last step computes
again, and with (expert) tensor parallelism torch's `DTensor.from_local(run_check=True)` runs one
`all_gather_object` over the whole world per half. A save of a model with E experts per layer
and L layers runs ~30 x E x L such collectives one after another (a DeepSeek-V2-Lite save: tens
of thousands), each a few ms or, over the world, more: minutes of every save and load at scale,
~5 s of a tiny model's save on 4 CPU ranks.

Wrapping the model does the same per parameter (`ParamAndGradBuffer._init_distributed_params`
makes each parameter's DTensor with `run_check` and its chunk): several collectives per
parameter again, thousands of parameters in a large MoE.

The fix, for the duration of `preprocess_fsdp_dtensor_state_dict` (megatron.training's save and
load call it) and of `_init_distributed_params`: `make_fsdp_dtensor` (both names megatron calls
it by) makes its DTensors without the per-tensor checks and chunk (a TP-duplicated parameter,
whose run_check broadcasts TP rank 0's copy, is left to megatron unless megatron broadcasts it
anyway: `force_sync_tp_duplicated_param`, as the model wrap does), and they are done at the end for
all at once: dtype and requires_grad compared over the world in one object gather, the chunks
computed together (at a save or load those of every DTensor of the state dict), the tensors
megatron would validate validated together. Megatron's rule is kept: a chunk is built from its
local shape mesh dim by mesh dim (a strided shard first, then the mesh dims in order, or the
reverse of the mesh's `_shard_order`), each step adding up the extents the ranks of that dim's
group hold so far. Here step k of every tensor is taken at once: one int64 gather per process
group per step, the tensors in megatron's order (the state dict's sorted keys, then the order
they were made), the groups in name order (the same on every rank). Validation is megatron's:
in bounds, and every boundary touched (one MAX all_reduce per group per sharded placement).
What DCP receives is what megatron's hooks give: one chunk per DTensor, nothing written for an
empty shard.

Needed where megatron's chunk computation gathers shapes per tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect

from megatron_patches.registry import Patch, PatchContext, register

NAME = "fsdp-dtensor-batched-chunk-metadata"


@dataclasses.dataclass
class PutOffChecks:
    """What megatron's per-tensor code would ask of the DTensors `make_fsdp_dtensor` makes while
    `deferring` (during `preprocess_fsdp_dtensor_state_dict` or `_init_distributed_params`;
    outside them `make_fsdp_dtensor` runs as it is): the DTensors to validate, those to give a
    chunk, and the dtype and requires_grad of the local tensors torch's
    `DTensor.from_local(run_check=True)` compares over the world; all done at once at the end."""

    deferring: bool = False
    to_validate: list = dataclasses.field(default_factory=list)
    to_attach: list = dataclasses.field(default_factory=list)
    to_compare: list = dataclasses.field(default_factory=list)

    def clear(self) -> None:
        self.to_validate.clear()
        self.to_attach.clear()
        self.to_compare.clear()


@dataclasses.dataclass
class Chunk:
    """One DTensor's chunk as it is built: megatron's offsets and 'cumulative shape'."""

    dtensor: object
    offsets: list[int]
    extent: list[int]  # the block of the tensor that the shards combined so far cover
    steps: list[int]  # the mesh dims combined, in megatron's order


def _uneven_dtensor():
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor

    return uneven_dtensor


def _combining_order(dtensor) -> list[int]:
    """The sharded mesh dims in the order megatron combines their shards."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    placements = dtensor.placements
    explicit = getattr(dtensor.device_mesh, "_shard_order", None)
    if explicit is not None:
        order = list(reversed(explicit))
    else:
        strided = [d for d, p in enumerate(placements) if isinstance(p, _StridedShard)]
        if len(strided) > 1:
            raise ValueError(f"DTensor has {len(strided)} strided shards; megatron supports one")
        order = strided + [d for d in range(len(placements)) if d not in strided]
    steps = []
    for mesh_dim in order:
        placement = placements[mesh_dim]
        if isinstance(placement, (Shard, _StridedShard)):
            steps.append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"unsupported placement {placement!r} of a DTensor {dtensor.shape}")
    return steps


def _in_rounds(chunks: list[Chunk], mesh_dims_of, combine) -> None:
    """Round k takes step k of every chunk that has one: one `combine(group, entries)` per
    process group, groups in name order, entries in `chunks`' order."""
    round_index = 0
    while True:
        groups: dict[str, tuple[object, list]] = {}
        for chunk in chunks:
            mesh_dims = mesh_dims_of(chunk)
            if round_index < len(mesh_dims):
                mesh_dim = mesh_dims[round_index]
                group = chunk.dtensor.device_mesh.get_group(mesh_dim)
                groups.setdefault(group.group_name, (group, []))[1].append((chunk, mesh_dim))
        if not groups:
            return
        for name in sorted(groups):
            combine(*groups[name])
        round_index += 1


def _place_shards(group, entries) -> None:
    from moe_launcher.runtime import collectives

    dims = [chunk.dtensor.placements[mesh_dim].dim for chunk, mesh_dim in entries]
    extents = collectives.gather_integers(
        [chunk.extent[dim] for (chunk, _), dim in zip(entries, dims)], group,
        what="DTensor shards (the ranks hold different DTensors: an fsdp_dtensor state dict "
             "with other keys, or another model)")
    rank = collectives.rank(group)
    for j, ((chunk, _), dim) in enumerate(zip(entries, dims)):
        chunk.offsets[dim] += sum(extents[r][j] for r in range(rank))
        chunk.extent[dim] = sum(held[j] for held in extents)


def place_chunks(dtensors: list) -> list[Chunk]:
    """Each DTensor's chunk by megatron's rule, all at once; every rank of each group passes its
    DTensors in the same order."""
    chunks = []
    for dtensor in dtensors:
        local_shape = list(dtensor.to_local().shape)
        chunks.append(Chunk(dtensor, [0] * len(local_shape), local_shape,
                             _combining_order(dtensor)))
    _in_rounds(chunks, lambda chunk: chunk.steps, _place_shards)
    return chunks


def _sharded_mesh_dims(chunk: Chunk) -> list[int]:
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    return [d for d, p in enumerate(chunk.dtensor.placements)
            if isinstance(p, (Shard, _StridedShard))]


def validate_chunks(chunks: list[Chunk]) -> None:
    """megatron's validate_uneven_dtensor, for all of `chunks` at once: every chunk lies in its
    tensor, and over each sharded dim's group some rank's chunk starts at 0 and some ends at the
    tensor's end."""
    import torch.distributed as dist

    from moe_launcher.runtime import collectives

    for chunk in chunks:
        shape, sizes = chunk.dtensor.shape, chunk.dtensor.to_local().shape
        spans = enumerate(zip(chunk.offsets, sizes))
        assert all(0 <= o and o + s <= shape[d] for d, (o, s) in spans), (
            f"[Megatron-FSDP] DTensor chunk metadata is invalid. Offsets: {chunk.offsets}, "
            f"sizes: {list(sizes)}, global shape: {list(shape)}, mesh: {chunk.dtensor.device_mesh}")
    if dist.is_initialized() and dist.get_backend() == "fake":
        return  # megatron skips it too: a fake group reduces nothing
    touched = {id(chunk): [int(flag) for d, (o, s) in enumerate(
        zip(chunk.offsets, chunk.dtensor.to_local().shape))
        for flag in (o == 0, o + s == chunk.dtensor.shape[d])] for chunk in chunks}

    def reduce_flags(group, entries):
        flat = [flag for chunk, _ in entries for flag in touched[id(chunk)]]
        reduced = iter(collectives.reduce_numbers(flat, op="max", group=group))
        for chunk, _ in entries:
            touched[id(chunk)] = [int(next(reduced)) for _ in touched[id(chunk)]]

    _in_rounds(chunks, _sharded_mesh_dims, reduce_flags)
    for chunk in chunks:
        assert all(touched[id(chunk)]), (
            f"[Megatron-FSDP] DTensor chunk metadata boundary check failed. Offsets: "
            f"{chunk.offsets}, global shape: {list(chunk.dtensor.shape)}, "
            f"mesh: {chunk.dtensor.device_mesh}")


def _write_items(chunk_metadata, fqn, dtensor):
    """DCP's hook: the one shard this rank writes of `dtensor`, nothing for an empty one."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    local = dtensor.to_local()
    if local.numel() == 0:
        return []
    return [WriteItem(type=WriteItemType.SHARD, index=MetadataIndex(fqn, chunk_metadata.offsets),
                      tensor_data=TensorWriteData(
                          chunk=chunk_metadata,
                          properties=TensorProperties.create_from_tensor(local),
                          size=dtensor.size()))]


def _attach(chunk: Chunk) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    metadata = ChunkStorageMetadata(offsets=tuple(chunk.offsets),
                                    sizes=tuple(chunk.dtensor.to_local().shape))
    local = chunk.dtensor._local_tensor
    local.__create_chunk_list__ = functools.partial(list, [metadata])
    local.__create_write_items__ = functools.partial(_write_items, metadata)


def _state_dict_dtensors(state_dict: dict) -> list:
    """The DTensors of a nested state dict in megatron's order (sorted key chains)."""
    from torch.distributed.tensor import DTensor

    found = _uneven_dtensor()
    chains = found.filter_unflattened_state_dict(
        state_dict, visit_condition=lambda value: isinstance(value, DTensor))
    return [found.get_unflattened_state_dict(state_dict, chain) for chain in sorted(chains)]


def _compare_across_the_world(local_metadata: list[str]) -> None:
    """torch's run_check of `DTensor.from_local`, for all the put-off DTensors at once: each
    one's dtype and requires_grad are the same on every rank (megatron's run had one world
    object gather per DTensor; where the ranks' numbers differ only the common ones compare)."""
    from moe_launcher.runtime import collectives

    for rank, theirs in enumerate(collectives.gather_objects(local_metadata)):
        for index, (mine, other) in enumerate(zip(local_metadata, theirs)):
            if mine != other:
                raise ValueError(f"Inconsistent tensor metadata across ranks: DTensor {index} "
                                 f"made is {mine} here, {other} on rank {rank}")


def _unique(dtensors) -> list:
    seen, unique = set(), []
    for dtensor in dtensors:
        if id(dtensor) not in seen:
            seen.add(id(dtensor))
            unique.append(dtensor)
    return unique


def _settle(checks: PutOffChecks, dtensors: list) -> None:
    """Does what was put off, and gives `dtensors` their chunks too, for all at once: the
    world comparison, the chunks (in `dtensors`' order, then the put-off ones' in the order
    they were made: the same on every rank), the validation, the DCP hooks."""
    _compare_across_the_world(checks.to_compare)
    to_attach = {id(t) for t in (*dtensors, *checks.to_attach)}
    to_validate = {id(t) for t in checks.to_validate}
    chunks = place_chunks(_unique([*dtensors, *checks.to_attach, *checks.to_validate]))
    validate_chunks([chunk for chunk in chunks if id(chunk.dtensor) in to_validate])
    for chunk in chunks:
        if id(chunk.dtensor) in to_attach:
            _attach(chunk)
    checks.clear()


@contextlib.contextmanager
def _deferring(checks: PutOffChecks):
    checks.deferring = True
    try:
        yield
    finally:
        checks.deferring = False
        checks.clear()


def _wrap_preprocess(checks: PutOffChecks, preprocess):
    @functools.wraps(preprocess)
    def preprocess_with_batched_chunks(*args, **kwargs):
        with _deferring(checks):
            return preprocess(*args, **kwargs)

    preprocess_with_batched_chunks.__wrapped_by__ = NAME
    return preprocess_with_batched_chunks


def _wrap_init_distributed_params(checks: PutOffChecks, init_distributed_params):
    @functools.wraps(init_distributed_params)
    def init_distributed_params_checked_together(self):
        with _deferring(checks):
            init_distributed_params(self)
            _settle(checks, [])

    init_distributed_params_checked_together.__wrapped_by__ = NAME
    return init_distributed_params_checked_together


def _put_off_checks(checks: PutOffChecks, make_fsdp_dtensor):
    from torch.distributed.tensor import DTensor

    from megatron.core.distributed.fsdp.src.megatron_fsdp import utils

    signature = inspect.signature(make_fsdp_dtensor)

    @functools.wraps(make_fsdp_dtensor)
    def make_fsdp_dtensor_checked_later(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        tp_checked = (given["run_check"] and not isinstance(given["param"], DTensor)
                      and utils.using_tensor_parallel(
                          given["dist_index"], is_expert_parallel=given["is_expert_param"]))
        if not checks.deferring or (
                tp_checked and utils.is_mcore_tensor_parallel_duplicated(given["param"])
                and not given["force_sync_tp_duplicated_param"]):
            # run_check broadcasts TP rank 0's copy of a TP-duplicated tensor: left to megatron
            # where megatron does not broadcast it anyway (force_sync_tp_duplicated_param).
            return make_fsdp_dtensor(*args, **kwargs)
        validate, attach = given["run_check"], given["update_uneven_dtensor_chunk_meta"]
        given["run_check"] = given["update_uneven_dtensor_chunk_meta"] = False
        dtensor = make_fsdp_dtensor(*call.args, **call.kwargs)
        if tp_checked:
            local = given["local_tensor"]
            checks.to_compare.append(f"{local.dtype} requires_grad={local.requires_grad}")
        if validate:
            checks.to_validate.append(dtensor)
        if attach:
            checks.to_attach.append(dtensor)
        return dtensor

    make_fsdp_dtensor_checked_later.__wrapped_by__ = NAME
    return make_fsdp_dtensor_checked_later


def _attach_in_batch(checks: PutOffChecks):
    def preprocess_state_dict_for_uneven_dtensor(state_dict: dict) -> dict:
        _settle(checks, _state_dict_dtensors(state_dict))
        return state_dict

    preprocess_state_dict_for_uneven_dtensor.__wrapped_by__ = NAME
    return preprocess_state_dict_for_uneven_dtensor


def _not_needed_because(context: PatchContext) -> str | None:
    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer
        from megatron.core.transformer import fsdp_dtensor_checkpoint
        from megatron.training import checkpointing
    except ImportError:
        return "this megatron-core has no Megatron-FSDP"
    for owner, name in ((checkpointing, "preprocess_fsdp_dtensor_state_dict"),
                        (checkpointing, "preprocess_state_dict_for_uneven_dtensor"),
                        (fsdp_dtensor_checkpoint, "make_fsdp_dtensor"),
                        (param_and_grad_buffer, "make_fsdp_dtensor"),
                        (param_and_grad_buffer.ParamAndGradBuffer, "_init_distributed_params")):
        if not callable(getattr(owner, name, None)):
            return f"megatron-core has no {owner.__name__}.{name} to hook"
    if "all_gather_object" not in inspect.getsource(
            _uneven_dtensor().gather_and_compute_chunk_metadata):
        return "megatron's chunk metadata no longer gathers shapes tensor by tensor"
    return None


def _apply(checks: PutOffChecks) -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer
    from megatron.core.transformer import fsdp_dtensor_checkpoint
    from megatron.training import checkpointing

    from megatron_patches.registry import wrapped_by

    if wrapped_by(checkpointing.preprocess_fsdp_dtensor_state_dict, NAME):
        return
    # Two names of one megatron function: the checkpoint's SwiGLU split and the buffer's own.
    for module in (fsdp_dtensor_checkpoint, param_and_grad_buffer):
        module.make_fsdp_dtensor = _put_off_checks(checks, module.make_fsdp_dtensor)
    buffer = param_and_grad_buffer.ParamAndGradBuffer
    buffer._init_distributed_params = _wrap_init_distributed_params(
        checks, buffer._init_distributed_params)
    checkpointing.preprocess_state_dict_for_uneven_dtensor = _attach_in_batch(checks)
    checkpointing.preprocess_fsdp_dtensor_state_dict = _wrap_preprocess(
        checks, checkpointing.preprocess_fsdp_dtensor_state_dict)


register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 uneven_dtensor (one all_gather_object per DTensor per "
             "sharded mesh dim; Megatron-LM PR #6573 open)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="Megatron-FSDP's model wrap and every fsdp_dtensor save or load place each "
            "DTensor shard with one int64 gather per process group per sharded mesh dim, and "
            "validate likewise, instead of several object gathers per tensor",
    not_needed_because=_not_needed_because,
    apply=lambda: _apply(PutOffChecks()),
))
