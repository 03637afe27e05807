"""megatron in the converter's process: a gloo world of one rank with every parallel size 1,
the launcher's patches and platform defaults (megatron's local spec, CPU initialisation), and
the GPTModel megatron's own builder makes from a validated command line or from the args saved
in a checkpoint. Saving goes through megatron's dist_checkpointing, as the launcher's does: what
this process writes at TP1 any layout loads. Reading takes one parameter at a time from any
layout's checkpoint: where megatron's sharded state dict of the model puts it in the saved
global tensors (torch_dist), or its fsdp_dtensor chunks, read by torch DCP.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import socket

import torch

from . import fsdp_dtensor
from .dcp_files import BoundedFilesWriter
from .errors import ConvertError, unwrapped_from_dcp
from .hf_files import read_with_progress

# What a conversion's command line needs besides the architecture; saved in the checkpoint's
# args (megatron reads none of them back when the launcher loads it: see save_release).
_CONVERSION_FLAGS = ["--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1",
                     "--global-batch-size", "1", "--train-iters", "1", "--eval-interval", "1",
                     "--eval-iters", "0", "--lr", "0.0", "--mock-data", "--ckpt-format",
                     "torch_dist", "--no-save-optim", "--no-save-rng"]

# A checkpoint's args as one rank holds the whole model: the layout reset, Transformer Engine,
# FSDP and fused kernels off (the weights are the same; the local spec's checkpoint keys are
# TE's, megatron maps them), and sequential experts (their checkpoint keys are grouped GEMM's).
_WORLD_ONE = {
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
    "context_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
    "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "pipeline_model_parallel_layout": None, "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False, "sequence_parallel": False,
    "world_size": 1, "rank": 0, "data_parallel_size": 1,
    "transformer_impl": "local", "moe_grouped_gemm": False, "use_cpu_initialization": True,
    "gradient_accumulation_fusion": False, "no_persist_layer_norm": True,
    "masked_softmax_fusion": False, "apply_rope_fusion": False, "bias_swiglu_fusion": False,
    "use_megatron_fsdp": False, "use_torch_fsdp2": False, "fp8": None, "fp4": None,
    "recompute_granularity": None, "recompute_method": None, "cuda_graph_impl": "none",
}


def start() -> None:
    """The CPU backend (without CUDA), the launcher's patches, one gloo rank (idempotent)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")  # megatron's parser reads them
    if not torch.cuda.is_available():
        from moe_launcher import cpu_backend

        cpu_backend.activate()
    from megatron_patches import registry

    registry.load_patches()
    registry.apply_patches(registry.current_context(cpu_backend=not torch.cuda.is_available()))
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)


def args_of_flags(model_flags: list[str], seq_length: int):
    """megatron's validated args and GPT model config for `model_flags`, as pretrain_moe.py
    checks them (its parser, preflight, megatron's validation), on the local spec."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    from moe_launcher.megatron_validation import checked_command_line
    from moe_launcher.platform_defaults import with_platform_defaults
    from moe_launcher.runtime.refusals import PreflightError

    argv = model_flags + ["--seq-length", str(seq_length)] + _CONVERSION_FLAGS
    argv, _ = with_platform_defaults(argv, on_cpu=True, have_te=False)
    try:
        # megatron prints every argument while it validates: not the converter's output.
        with contextlib.redirect_stdout(io.StringIO()):
            args, config = checked_command_line(argv)
    except PreflightError as error:
        raise ConvertError(str(error)) from None
    # What megatron's tokenizer setup records at TP1, as in a launcher's own checkpoint.
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    return args, config.model


def world_one_args(saved_args, ckpt_format: str = "torch_dist"):
    """A checkpoint's saved args laid out for this one rank, saving in `ckpt_format`, with no
    samples consumed: megatron restores the consumed counts of a release's args while it starts
    at iteration 0, so a trained run's counts would make the next run skip that much data, or
    stop before its first step ("no samples left to consume")."""
    args = copy.copy(saved_args)
    for name, value in {**_WORLD_ONE, "consumed_train_samples": 0, "skipped_train_samples": 0,
                        "consumed_valid_samples": 0, "ckpt_format": ckpt_format}.items():
        setattr(args, name, value)
    return args


def world_one_config(saved_args):
    """The GPT model config of a checkpoint's saved args, laid out for this one rank."""
    from moe_launcher.megatron_validation import model_config
    from moe_launcher.runtime.refusals import PreflightError

    try:
        return model_config(world_one_args(saved_args))
    except PreflightError as error:
        raise ConvertError(str(error)) from None


def build(model_config):
    from megatron.core.process_groups_config import ProcessGroupCollection

    if torch.get_default_device().type == "meta":
        # Names, shapes and dtypes only (the converter's builds): megatron's init methods would
        # give no values there, only work (torch's meta decompositions of normal_: 18 of a
        # GLM-4.5-Air build's 25 s).
        model_config = copy.copy(model_config)
        model_config.perform_initialization = False
    builder = model_config.get_builder_cls()(model_config)
    model = builder.build_model(ProcessGroupCollection.use_mpu_process_groups())
    # megatron builds in fp32 and its Float16Module casts the whole model for --bf16/--fp16:
    # the weights a launcher checkpoint holds are in params_dtype.
    return model.to(model_config.params_dtype)


def moe_layers(model) -> list[bool]:
    """Whether each decoder layer megatron built is a MoE layer (the others are dense MLPs)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers]


def _shards_on(entry, data: torch.Tensor) -> list[tuple]:
    """(ShardedTensor, its tensor) for each shard of one entry of megatron's sharded state dict
    of the model, with `data` in place of the (possibly meta) parameter: a factory's shards
    (SwiGLU's w and v) are rebuilt on it, as views of it."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if not isinstance(entry, ShardedTensorFactory):
        return [(entry, data)]
    meta, entry.data = entry.data, data
    try:
        built = entry.build()
    finally:
        entry.data = meta
    return [(shard, shard.data) for shard in (built if isinstance(built, list) else [built])]


def _weight_entries(model, metadata: dict) -> dict:
    """Parameter name -> its entry of megatron's sharded state dict of the model (TE's
    _extra_state objects, which hold no weights, left out)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {name: entry for name, entry in model.sharded_state_dict(metadata=metadata).items()
            if not isinstance(entry, ShardedObject)}


class _ShardSource:
    """The tensor of each shard megatron's save of the one-rank model writes, made when the save
    writes it: megatron's own sharded state dict of the model says which parameter a (key,
    global offset) is, and which of a factory's shards (the SwiGLU fc1's two halves). One
    parameter is kept at a time (a factory's shards are written one after the other)."""

    def __init__(self, model, metadata: dict, read):
        self.read, self.entries, self.where = read, _weight_entries(model, metadata), {}
        for name, entry in self.entries.items():
            for k, (shard, _) in enumerate(_shards_on(entry, entry.data)):
                self.where[shard.key, tuple(shard.global_offset)] = (name, k)
        self.held: tuple[str | None, list[torch.Tensor]] = (None, [])

    def makes(self, key: str, offset) -> bool:
        return (key, tuple(offset)) in self.where

    def tensor(self, key: str, offset) -> torch.Tensor:
        name, k = self.where[key, tuple(offset)]
        if self.held[0] != name:
            entry = self.entries[name]
            weight = self.read(name).to(entry.data.dtype)  # no copy where it already is
            self.held = (name, [part for _, part in _shards_on(entry, weight)])
        return self.held[1][k]


def _streaming_strategy(source: _ShardSource):
    """megatron's torch_dist save strategy (its keys, metadata and checkpoint config), written
    by dcp_files' writer, which asks the planner for one tensor at a time: each comes from
    `source` then."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class Planner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            # Every model tensor from `source`: also those megatron makes on a device of its
            # choosing whatever the default (the router's expert bias: zeros, not meta).
            fqn, offset = write_item.index.fqn, write_item.index.offset
            if isinstance(data, torch.Tensor) and source.makes(fqn, offset):
                made = source.tensor(fqn, offset)
                data = made.reshape(write_item.tensor_data.chunk.sizes)
            return data

    class Strategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            planner = Planner(dedup_replicated_tensors=not self.keep_only_main_replica,
                              flatten_state_dict=False, flatten_sharded_tensors=False)
            with unwrapped_from_dcp():
                dcp.save(mcore_to_pyt_state_dict(by_key, False), planner=planner, no_dist=True,
                         storage_writer=BoundedFilesWriter(str(checkpoint_dir)))

    return Strategy()


def save_release(model, read, args, ckpt_root: str) -> None:
    """`ckpt_root/release` and a tracker naming it: megatron's convention for a converted
    checkpoint. megatron's load then takes iteration 0 and reads no optimizer, scheduler or RNG
    state (none is saved), with or without --finetune. `model` (it may be on the meta device)
    gives the names and shapes; each parameter is `read(name)` when the save writes it, so no
    more than one is held at a time."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
    from megatron.training import checkpointing

    # The sharded-state-dict metadata megatron's own save_checkpoint builds for these args.
    metadata = checkpointing._build_sharded_state_dict_metadata(args)
    state = checkpointing.generate_state_dict(args, [model], None, None, None, iteration=0,
                                              model_sd_kwargs={"metadata": metadata})
    release = os.path.join(ckpt_root, "release")
    os.mkdir(release)
    with read_with_progress(read, model, "writing torch_dist") as counted:
        dist_checkpointing.save(state, release,
                                sharded_strategy=_streaming_strategy(
                                    _ShardSource(model, metadata, counted)),
                                content_metadata=_clean_metadata_for_serialization(metadata))
    with open(os.path.join(ckpt_root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")


def iteration_dir(ckpt_root: str, iteration: int | None) -> str:
    """The iteration folder to export: --iteration's, else the one the tracker names."""
    from moe_launcher.checkpoint_files.commit_protocol import iteration_dirname, read_tracker
    from moe_launcher.runtime.refusals import CheckpointLoadError

    if not os.path.isdir(ckpt_root):
        raise ConvertError(f"{ckpt_root} is not a folder")
    if iteration is not None:
        name = iteration_dirname(iteration)
    else:
        try:
            name = read_tracker(ckpt_root)
        except CheckpointLoadError as error:
            raise ConvertError(str(error)) from None
        if name is None:
            raise ConvertError(f"{ckpt_root} has no latest_checkpointed_iteration.txt "
                               "(pass --iteration N)")
    path = os.path.join(ckpt_root, name)
    if not os.path.isdir(path):
        raise ConvertError(f"{path} does not exist")
    return path


# torch DCP files without megatron's metadata.json, by where they keep the model's tensors
_DCP_FORMATS = {fsdp_dtensor.FSDP_DTENSOR: "fsdp_dtensor", fsdp_dtensor.TORCH_DCP: "torch_dcp"}


def _backend(path: str) -> str | None:
    """"torch_dist", "fsdp_dtensor" or "torch_dcp" as the folder's files name it (None: none)."""
    from moe_launcher.checkpoint_files.metadata import saved_backend

    backend = saved_backend(path)
    if backend is None and not os.path.exists(os.path.join(path, "metadata.json")) and \
            os.path.isfile(os.path.join(path, ".metadata")):
        try:
            layout = fsdp_dtensor.layout_of(path)
        except ConvertError:  # an unreadable .metadata: the file checks say so, as damage
            layout = None
        backend = _DCP_FORMATS.get(layout, "fsdp_dtensor")
    return backend


def _resave_torch_format(path: str) -> str:
    """The refusal of a --ckpt-format torch checkpoint (one file per model-parallel rank, its
    pieces laid out by the saving run's layout), with megatron's own converter as the fix."""
    root, name = os.path.split(os.path.normpath(path))
    step = f" --ckpt-step {int(name[len('iter_'):])}" if name.startswith("iter_") else ""
    return (f"{path} is a --ckpt-format torch checkpoint (mp_rank_* files), which the "
            "conversions do not read; fix: resave it as torch_dist with megatron's converter: "
            "pretrain_moe.py with the flags and parallel layout of the run that saved it, plus "
            f"--load {root}{step} --ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR "
            "(it loads, writes NEW_DIR/torch_dist and exits), then convert NEW_DIR/torch_dist")


def checkpoint_format(path: str) -> str:
    """"torch_dist", "fsdp_dtensor" or "torch_dcp" (torch FSDP2's), judged from the files alone;
    refuses anything else and a checkpoint whose files are missing or short. The conversions
    call it once, before any work; saved_args and open_reader then only tell the formats
    apart."""
    from moe_launcher.checkpoint_files import torch_format
    from moe_launcher.checkpoint_files.file_checks import file_problems

    backend = _backend(path)
    if backend is None and os.path.isdir(path) and torch_format.is_torch_format(path):
        raise ConvertError(_resave_torch_format(path))
    if backend not in ("torch_dist", "fsdp_dtensor", "torch_dcp"):
        raise ConvertError(f"{path} is not a torch_dist, fsdp_dtensor or torch_dcp checkpoint "
                           f"(sharded_backend {backend!r})")
    problems = file_problems(path)
    if problems:
        raise ConvertError(f"{path} is damaged: {problems[0]}")
    return backend


def saved_args(path: str):
    """The args a checkpoint was saved with."""
    from megatron.core import dist_checkpointing

    if _backend(path) in _DCP_FORMATS.values():
        return fsdp_dtensor.saved_args(path)
    args = dist_checkpointing.load_common_state_dict(path).get("args")
    if args is None:
        raise ConvertError(f"{path} holds no megatron args")
    return args


class _RegionPlanner:
    """A torch DCP load plan that reads given regions of saved tensors, each into its own
    tensor: (saved key, the region's offsets in the saved global tensor, the target, whose
    shape is the region's). DCP reads only the saved chunks that overlap a region."""

    def __init__(self, regions: list[tuple[str, tuple[int, ...], torch.Tensor]]):
        self.regions = regions

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import (
            create_read_items_for_chunk_list,
        )

        self.targets, requests = {}, []
        for key, offsets, target in self.regions:
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=target.shape)
            self.targets[key, tuple(offsets)] = target
            requests += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(requests)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def resolve_tensor(self, read_item):
        from torch.distributed._shard._utils import narrow_tensor_by_index

        target = self.targets[read_item.dest_index.fqn, tuple(read_item.dest_index.offset)]
        return narrow_tensor_by_index(target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        pass

    def load_bytes(self, read_item, value) -> None:
        raise AssertionError(f"a region read asked for {read_item.dest_index.fqn}'s bytes")


class _TorchDistReader:
    """A torch_dist checkpoint's tensors for the one-rank model, one parameter at a time: where
    megatron's own sharded state dict of the model (its keys, global offsets and shapes; the
    SwiGLU factory's two halves) puts each parameter in the saved global tensors, that region is
    read by torch DCP (only the chunks it overlaps). Rows megatron lets differ in number
    (`allow_shape_mismatch`: the vocabulary padding of another TP) are read as far as both
    have them, the rest left zero. The model may be on the meta device."""

    spec = "torch_dist"

    def __init__(self, model, path: str):
        from megatron.core import dist_checkpointing, parallel_state
        from torch.distributed.checkpoint import FileSystemReader

        metadata = dict(dist_checkpointing.load_content_metadata(path) or {})
        metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        self.entries = _weight_entries(model, metadata)
        self.storage = FileSystemReader(path)
        self.saved = self.storage.read_metadata()
        self.storage.read_metadata = lambda: self.saved  # read once, not once per parameter

    @property
    def names(self):
        return self.entries.keys()

    def _region(self, shard, target: torch.Tensor):
        """(key, offsets, the part of `target` the checkpoint has) for one ShardedTensor whose
        data is `target`."""
        shape = (1,) * shard.prepend_axis_num + tuple(shard.local_shape)
        view = target.view(shape)
        saved = tuple(self.saved.state_dict_metadata[shard.key].size)
        sizes = [min(size, have - offset)
                 for size, have, offset in zip(shape, saved, shard.global_offset)]
        for dim, size in enumerate(sizes):
            view = view.narrow(dim, 0, size)
        return shard.key, tuple(shard.global_offset), view

    def read(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        entry = self.entries[name]
        target = torch.zeros(entry.data.shape, dtype=entry.data.dtype)
        regions = [self._region(shard, part) for shard, part in _shards_on(entry, target)]
        dcp.load({}, storage_reader=self.storage, planner=_RegionPlanner(regions), no_dist=True)
        return target


def open_reader(model, path: str):
    """The checkpoint's tensors for the one-rank model (which may be on the meta device): an
    object with `spec`, `names` and `read(name)`, reading as little at a time as the format
    allows."""
    backend = _backend(path)
    for layout, name in _DCP_FORMATS.items():
        if backend == name:
            return fsdp_dtensor.Reader(model, path, layout)
    return _TorchDistReader(model, path)


def check_covers(reader, model, path: str) -> None:
    """The checkpoint holds every weight of the model its args build."""
    if missing := [name for name in model.state_dict()
                   if name not in reader.names and not name.endswith("_extra_state")]:
        raise ConvertError(f"{path} holds no {missing[0]} for the model its args build")


def load_into(model, path: str) -> None:
    """Every tensor of the model from the checkpoint (the optimizer's are left on disk)."""
    reader = open_reader(model, path)
    check_covers(reader, model, path)
    params = model.state_dict()
    with torch.no_grad():
        for name in reader.names:
            params[name].copy_(reader.read(name))
