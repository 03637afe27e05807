"""fsdp_dtensor checkpoints (the only format megatron-core 0.19.2 saves Megatron-FSDP runs in)
read into, and written from, the converter's one-rank model.

What megatron's fsdp_dtensor save writes (megatron.training.checkpointing's
`preprocess_fsdp_dtensor_state_dict` and megatron.core.transformer.fsdp_dtensor_checkpoint, read
in megatron-core 0.19.2 and checked against the `.metadata` of the launcher's own runs):

* torch DCP files, no megatron metadata.json; every model tensor as one global tensor under
  `model.module.` + the module's own state-dict name, in the main weights' dtype (fp32 for
  --bf16); `args`, `iteration` and `checkpoint_version` as pickled objects.
* experts under their global index: `local_experts.<e>.` (sequential experts) or `weight<e>`
  (grouped GEMM experts, the GPU recipes').
* each SwiGLU `linear_fc1` weight as its two halves `<name>_w` and `<name>_v`, each the whole
  gate (up) matrix: fc1's TP shards interleave the halves, so megatron splits before saving.
* module names are those of the spec that trained: the local spec's, or Transformer Engine's,
  which fuses norms into the next linear layer. megatron's own map between them (each layer's
  `sharded_state_dict_keys_map`, what makes torch_dist keys spec-independent) gives TE's name,
  so a reader tries both against what `.metadata` holds, and a writer writes the target spec's.

The Reader also reads torch_dcp, megatron's format for torch FSDP2 (`--use-torch-fsdp2`, which
megatron runs at TP, PP and EP 1 only): the same torch DCP files, each model tensor global under
`model.` + its name, in the model's dtype, a SwiGLU fc1 whole (TORCH_DCP).
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .dcp_files import BoundedFilesWriter
from .errors import ConvertError, unwrapped_from_dcp
from .hf_files import read_with_progress

MODEL_PREFIX = "model.module."
CHECKPOINT_VERSION = 3.0  # megatron's current one: no QKV reordering on load
SPECS = ("transformer_engine", "local")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GATED_FC1 = re.compile(r"\.mlp\.(experts\.local_experts\.\d+\.|shared_experts\.)?linear_fc1\."
                        r"(weight|bias)$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a torch DCP format keeps the model's tensors: under `prefix`, SwiGLU fc1 weights
    as their `_w`/`_v` halves (`halves`) or whole."""
    prefix: str
    halves: bool


FSDP_DTENSOR = Layout(MODEL_PREFIX, halves=True)
TORCH_DCP = Layout("model.", halves=False)


def layout_of(path: str) -> Layout | None:
    """The layout of the model tensors an iteration folder of torch DCP files holds (None: no
    model tensor under either prefix)."""
    keys = _metadata(path).keys()
    for layout in (FSDP_DTENSOR, TORCH_DCP):  # the longer prefix first: it starts with the other
        if any(key.startswith(layout.prefix) for key in keys):
            return layout
    return None


def _layer_key_maps(model) -> dict[str, dict[str, str]]:
    """Each transformer layer's prefix -> megatron's map from local-spec to TE names."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return {f"{name}.": dict(module.submodules_config.sharded_state_dict_keys_map)
            for name, module in model.named_modules() if isinstance(module, TransformerLayer)}


def _te_name(name: str, key_maps: dict[str, dict[str, str]]) -> str:
    for prefix, key_map in key_maps.items():
        if name.startswith(prefix):
            inner = name[len(prefix):]
            for local, te in key_map.items():
                if inner.startswith(local):
                    inner = te + inner[len(local):]
                    break
            name = prefix + inner
            break
    if match := _EXPERT.match(name):  # TE's grouped GEMM: one weight<e> per expert
        experts, index, linear, kind = match.groups()
        name = f"{experts}{linear}.{kind}{index}"
    return name


def stored_names(model, spec: str, halves: bool = True) -> dict[str, list[str]]:
    """Each parameter of the one-rank model (state-dict name) -> the names it is saved under by
    a run of `spec` (without the layout's prefix): one, or the `_w`/`_v` halves of a SwiGLU fc1
    where `halves`."""
    gated = model.config.gated_linear_unit and halves
    key_maps = _layer_key_maps(model) if spec == "transformer_engine" else {}
    names = {}
    for name in model.state_dict():
        if name.endswith("_extra_state"):
            continue
        stored = _te_name(name, key_maps) if key_maps else name
        names[name] = [stored + "_w", stored + "_v"] if gated and _GATED_FC1.search(name) \
            else [stored]
    return names


def _metadata(path: str) -> dict:
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as error:  # a truncated or garbled pickle raises anything
        raise ConvertError(f"{path}/.metadata is unreadable ({type(error).__name__}: {error})") \
            from None


def checkpoint_model_tensors(path: str,
                             prefix: str = MODEL_PREFIX) -> dict[str, TensorStorageMetadata]:
    """The model tensors a torch DCP iteration folder holds under `prefix` (stripped)."""
    return {key[len(prefix):]: value for key, value in _metadata(path).items()
            if key.startswith(prefix) and isinstance(value, TensorStorageMetadata)}


def _spec_of(saved: dict, candidates: dict[str, dict[str, list[str]]], prefix: str) -> str:
    """The spec whose names the checkpoint holds, every parameter's."""
    for spec, names in candidates.items():
        if all(name in saved for stored in names.values() for name in stored):
            return spec
    best = max(candidates, key=lambda s: sum(n in saved for v in candidates[s].values() for n in v))
    missing = [n for v in candidates[best].values() for n in v if n not in saved]
    raise ConvertError(f"the checkpoint lacks {len(missing)} of the model's tensors "
                       f"(e.g. {prefix}{missing[0]}; names of the {best} spec): it is "
                       "partial or of another model")


def _part_shape(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """The shape of each of a parameter's `parts` saved tensors (a SwiGLU fc1's two halves)."""
    return ((shape[0] // parts,) if shape else ()) + shape[1:]


class Reader:
    """The one-rank model's parameters read one at a time from an fsdp_dtensor (or torch_dcp:
    `layout`) iteration folder, each saved tensor read once, in the model's dtype. Refuses, on
    opening, a checkpoint that lacks a parameter, holds one of another shape, or holds model
    tensors no parameter takes (the conversion would drop them). The model may be on the meta
    device."""

    def __init__(self, model, path: str, layout: Layout = FSDP_DTENSOR):
        self.path, self.prefix = path, layout.prefix
        self.saved = checkpoint_model_tensors(path, self.prefix)
        candidates = {spec: stored_names(model, spec, layout.halves) for spec in SPECS}
        self.spec = _spec_of(self.saved, candidates, self.prefix)
        self.names = candidates[self.spec]
        used = {name for stored in self.names.values() for name in stored}
        if extra := sorted(set(self.saved) - used):
            raise ConvertError(f"the checkpoint's {self.prefix}{extra[0]}"
                               f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''} "
                               "belongs to no parameter of the model its args build: the "
                               "conversion would drop it")
        self.targets = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()
                        if name in self.names}
        for name, stored in self.names.items():
            shape = self.targets[name][0]
            whole = _part_shape(shape, len(stored))
            for key in stored:
                if tuple(self.saved[key].size) != whole:
                    raise ConvertError(f"the checkpoint's {self.prefix}{key} has shape "
                                       f"{tuple(self.saved[key].size)}, the model its args "
                                       f"build {whole}")

    def read(self, name: str) -> torch.Tensor:
        shape, dtype = self.targets[name]
        whole = torch.empty(shape, dtype=dtype)
        # DCP copies each saved chunk into its place, casting (Megatron-FSDP saves fp32 main
        # weights): the halves of a SwiGLU fc1 land in their rows, no other copy is made.
        parts = dict(zip((self.prefix + key for key in self.names[name]),
                         whole.chunk(len(self.names[name]))))
        dcp.load(parts, checkpoint_id=self.path, no_dist=True)
        return whole


def saved_args(path: str):
    """The args an fsdp_dtensor checkpoint was saved with."""
    from moe_launcher.checkpoint_files.metadata import (
        UnreadableCheckpoint, read_checkpoint_metadata)

    try:
        args = read_checkpoint_metadata(path, with_payload=False).args
    except UnreadableCheckpoint as error:
        raise ConvertError(f"{path} holds no readable megatron args ({error})") from None
    if args is None:
        raise ConvertError(f"{path} holds no megatron args")
    return args


class _PartsPlanner(dcp.DefaultSavePlanner):
    """Plans from meta placeholders (names, shapes, dtypes) and makes each tensor when torch
    DCP's FileSystemWriter asks for it, which writes it before asking for the next: one
    parameter (its parts: a SwiGLU fc1's two halves) is held at a time."""

    def __init__(self, read, part_of: dict[str, tuple[str, int, int]]):
        super().__init__()
        self.read, self.part_of = read, part_of  # key -> (parameter, part, parts)
        self.held: tuple[str | None, list[torch.Tensor]] = (None, [])

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if not (isinstance(data, torch.Tensor) and data.is_meta):
            return data
        name, part, parts = self.part_of[write_item.index.fqn]
        if self.held[0] != name:
            weight = self.read(name).to(torch.float32)  # no copy of an fp32 weight
            self.held = (name, [chunk.contiguous() for chunk in weight.chunk(parts)])
        return self.held[1][part]


def save_release(model, read, args, ckpt_root: str, spec: str) -> None:
    """`ckpt_root/release` in fsdp_dtensor (each parameter, `read(name)` when it is written, in
    fp32, Megatron-FSDP's main-weight dtype, named as a run of `spec` asks for them) and a
    tracker naming it; `model` (it may be on the meta device) gives the names. megatron's load
    then takes iteration 0 and no optimizer, scheduler or RNG state, as for import-hf's
    torch_dist."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()
              if isinstance(t, torch.Tensor)}  # (not TE's _extra_state)
    placeholders, part_of = {}, {}
    for name, stored in stored_names(model, spec).items():
        part = _part_shape(shapes[name], len(stored))
        for k, key in enumerate(stored):
            placeholders["module." + key] = torch.empty(part, dtype=torch.float32, device="meta")
            part_of[f"model.module.{key}"] = (name, k, len(stored))
    release = os.path.join(ckpt_root, "release")
    os.mkdir(release)
    state = {"model": placeholders, "args": args, "iteration": 0,
             "checkpoint_version": CHECKPOINT_VERSION}
    with unwrapped_from_dcp(), read_with_progress(read, model, "writing fsdp_dtensor") as counted:
        dcp.save(state, storage_writer=BoundedFilesWriter(release),
                 planner=_PartsPlanner(counted, part_of), no_dist=True)
    with open(os.path.join(ckpt_root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
