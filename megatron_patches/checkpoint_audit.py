"""Audits a distributed checkpoint from its metadata alone (Megatron-LM #1836).

With expert tensor parallelism (ETP > 1) megatron-core <0.16 wrote expert weights with a global
shape 1/ETP of the true one and saved only one ETP replica; a resumed run then silently gave the
other ETP ranks wrong expert weights. Nothing in the checkpoint looks broken unless one compares
the global shapes against the shapes the saved model config implies, which is what this does.

    python -m megatron_patches.checkpoint_audit CKPT_DIR [--json]

CKPT_DIR is a save root (with latest_checkpointed_iteration.txt) or one iter_XXXXXXX directory,
in `torch_dist` or `fsdp_dtensor` format. Only the `.metadata` file is parsed, plus the small
pickled model args (common.pt, or the one `common_state`/`args` object inside the checkpoint);
tensor payloads are never read, .distcp files are only stat()ed.
Exit status: 0 complete, 1 damaged, 2 unreadable.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import re
import sys
import types
import warnings
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

EXIT_COMPLETE, EXIT_DAMAGED, EXIT_UNREADABLE = 0, 1, 2
TRACKER_FILE = "latest_checkpointed_iteration.txt"
# megatron-core >=0.17 keeps the common (non-tensor) state as this one object inside the checkpoint.
COMMON_STATE_KEY = "common_state/shard_0_1"


class UnreadableCheckpoint(Exception):
    """The directory is not a checkpoint this tool can read (exit status 2)."""


# ---------------------------------------------------------------------------------------------
# The shapes the model config implies
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The model sizes that fix every weight's global shape (parallelism never changes them)."""

    hidden: int
    num_experts: int | None
    moe_ffn: int | None
    ffn: int | None
    glu: bool
    heads: int | None
    query_groups: int | None
    kv_channels: int | None
    padded_vocab: int | None = None  # only training args know the padded vocabulary
    expert_hidden: int | None = None  # experts' input width when it is not hidden (latent MoE)
    expert_tensor_parallel: int = 1

    @classmethod
    def from_config(cls, config: Any) -> "ModelDims":
        """From a megatron TransformerConfig."""
        return cls(
            hidden=config.hidden_size,
            num_experts=config.num_moe_experts,
            moe_ffn=config.moe_ffn_hidden_size,
            ffn=config.ffn_hidden_size,
            glu=bool(config.gated_linear_unit),
            heads=None if getattr(config, "multi_latent_attention", False)
            else config.num_attention_heads,
            query_groups=config.num_query_groups or config.num_attention_heads,
            kv_channels=config.kv_channels,
            expert_tensor_parallel=config.expert_tensor_parallel_size or 1,
            expert_hidden=getattr(config, "moe_latent_size", None),
        )

    @classmethod
    def from_args(cls, args: Any) -> "ModelDims":
        """From megatron training args (the Namespace saved in every checkpoint, or the dict
        megatron.training turns it into for its common-state consistency check)."""
        if isinstance(args, Mapping):
            args = types.SimpleNamespace(**args)
        # Multi-latent attention projects through other widths: attention shapes unchecked.
        heads = None if getattr(args, "multi_latent_attention", False) else getattr(
            args, "num_attention_heads", None)
        groups = getattr(args, "num_query_groups", None) if getattr(
            args, "group_query_attention", False) else None
        kv = getattr(args, "kv_channels", None) or (heads and args.hidden_size // heads)
        num_experts = getattr(args, "num_experts", None)
        return cls(
            hidden=args.hidden_size,
            num_experts=num_experts,
            moe_ffn=getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None),
            ffn=getattr(args, "ffn_hidden_size", None),
            glu=bool(getattr(args, "swiglu", False)),
            heads=heads,
            query_groups=groups or heads,
            kv_channels=kv,
            padded_vocab=getattr(args, "padded_vocab_size", None),
            expert_tensor_parallel=getattr(args, "expert_tensor_parallel_size", None) or 1,
            expert_hidden=getattr(args, "moe_latent_size", None),
        )


# `linear_fc1.weight`, grouped `weight3`, fsdp_dtensor's SwiGLU halves `weight_w` / `weight3_v`.
_EXPERT = re.compile(
    r"mlp\.experts\.(?P<form>experts\.|local_experts\.\d+\.|)linear_fc(?P<fc>[12])\."
    r"(?P<kind>weight|bias)(?P<idx>\d*)(?P<half>_[wv])?$"
)
_ATTENTION = re.compile(r"self_attention\.linear_(?P<which>qkv|proj)\.weight$")
_ROUTER = re.compile(r"mlp\.router\.weight$")
_DENSE_MLP = re.compile(r"mlp\.linear_fc(?P<fc>[12])\.weight$")  # not (shared_)experts.linear_fc
_VOCAB = re.compile(r"(embedding\.word_embeddings|output_layer)\.weight$")
# Norms over the hidden size only (q/k/kv norms of other widths are left unchecked).
_NORM = re.compile(r"((input|pre_mlp|pre_cross_attn|final)_layernorm\.(weight|bias)"
                   r"|linear_(qkv|fc1)\.layer_norm_(weight|bias))$")


def is_expert_key(key: str) -> bool:
    return _EXPERT.search(key) is not None


def expected_shape(key: str, shape: Sequence[int], dims: ModelDims) -> tuple[int | None, ...] | None:
    """The global shape `dims` implies for tensor `key`, None where this tool has no rule.

    Entries are None for axes the config does not fix (the stacked layer axis megatron prepends
    to `decoder.layers.*` keys). `shape` is only used for its rank: leading stacking axes.
    """
    if m := _EXPERT.search(key):
        if dims.num_experts is None or dims.moe_ffn is None:
            return None
        fc1 = m["fc"] == "1"
        rows = dims.moe_ffn * (2 if fc1 and dims.glu and not m["half"] else 1)
        width = dims.expert_hidden or dims.hidden
        if m["kind"] == "bias":
            core: tuple[int, ...] = (rows,) if fc1 else (width,)
        else:
            core = (rows, width) if fc1 else (width, dims.moe_ffn)
        # SequentialMLP/TEGroupedMLP under torch_dist stack experts on an axis before the matrix.
        if m["form"] == "experts." or (not m["form"] and not m["idx"]
                                         and len(shape) == _stacked_layers(key) + 1 + len(core)):
            core = (dims.num_experts,) + core
        return _with_leading(shape, core)
    if (m := _ATTENTION.search(key)) and dims.heads and dims.kv_channels:
        if m["which"] == "qkv":
            core = ((dims.heads + 2 * dims.query_groups) * dims.kv_channels, dims.hidden)
        else:
            core = (dims.hidden, dims.heads * dims.kv_channels)
        return _with_leading(shape, core)
    if _ROUTER.search(key) and dims.num_experts:
        return _with_leading(shape, (dims.num_experts, dims.hidden))
    if (m := _DENSE_MLP.search(key)) and dims.ffn:
        fc1 = m["fc"] == "1"
        core = (dims.ffn * (2 if dims.glu else 1), dims.hidden) if fc1 else (dims.hidden, dims.ffn)
        return _with_leading(shape, core)
    if _VOCAB.search(key) and dims.padded_vocab:
        return _with_leading(shape, (dims.padded_vocab, dims.hidden))
    if _NORM.search(key):
        return _with_leading(shape, (dims.hidden,))
    return None


def _stacked_layers(key: str) -> int:
    # torch_dist keys `decoder.layers.X` (no layer number) carry a prepended layer axis.
    return 1 if re.search(r"layers\.(?!\d)", key) else 0


def _with_leading(shape: Sequence[int], core: tuple[int, ...]) -> tuple[int | None, ...] | None:
    lead = len(shape) - len(core)
    if lead < 0:
        return core  # fewer axes than the config implies: shape_matches reports it
    return (None,) * lead + core


def shape_matches(shape: Sequence[int], expected: Sequence[int | None]) -> bool:
    return len(shape) == len(expected) and all(e is None or e == s for s, e in zip(shape, expected))


def expected_numel(shape: Sequence[int], expected: Sequence[int | None]) -> int:
    """Elements of the true tensor; unchecked axes take the saved size."""
    if len(shape) != len(expected):
        return math.prod(e for e in expected if e is not None)
    return math.prod(s if e is None else e for s, e in zip(shape, expected))


# ---------------------------------------------------------------------------------------------
# Do the saved chunks tile the global shape exactly once?
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Coverage:
    missing_fraction: float  # share of the global tensor no chunk covers
    overlapping: bool  # some element is covered by more than one chunk
    out_of_bounds: bool  # some chunk reaches outside the global shape

    @property
    def exact(self) -> bool:
        return self.missing_fraction == 0 and not self.overlapping and not self.out_of_bounds


def coverage(global_shape: Sequence[int], boxes: Iterable[tuple[Sequence[int], Sequence[int]]]) -> Coverage:
    """Checks how (offset, size) boxes cover `global_shape`.

    Works on the grid that all box boundaries induce, so cost grows with the number of chunks,
    not with the tensor size.
    """
    boxes = [(tuple(o), tuple(s)) for o, s in boxes]
    ndim = len(global_shape)
    total = math.prod(global_shape)
    if ndim == 0:
        return Coverage(0.0 if boxes else 1.0, len(boxes) > 1, False)
    out_of_bounds = any(
        len(o) != ndim or any(a < 0 or a + b > g for a, b, g in zip(o, s, global_shape))
        for o, s in boxes
    )
    boxes = [(o, s) for o, s in boxes if len(o) == ndim]
    if not out_of_bounds and (regular := _regular_grid_coverage(global_shape, boxes)) is not None:
        return regular
    bounds = [sorted({0, g} | {min(max(o[d], 0), g) for o, _ in boxes}
                     | {min(max(o[d] + s[d], 0), g) for o, s in boxes})
              for d, g in enumerate(global_shape)]
    counts = np.zeros([len(b) - 1 for b in bounds], dtype=np.int32)
    for o, s in boxes:
        index = tuple(slice(np.searchsorted(b, min(max(o[d], 0), global_shape[d])),
                            np.searchsorted(b, min(max(o[d] + s[d], 0), global_shape[d])))
                      for d, b in enumerate(bounds))
        counts[index] += 1
    cell_volume = np.ones(counts.shape, dtype=np.float64)
    for d, b in enumerate(bounds):
        widths = np.diff(np.asarray(b, dtype=np.float64))
        cell_volume *= widths.reshape([-1 if i == d else 1 for i in range(ndim)])
    missing = float(cell_volume[counts == 0].sum()) / total if total else 0.0
    return Coverage(missing, bool((counts > 1).any()), out_of_bounds)


def _regular_grid_coverage(global_shape: Sequence[int], boxes: list) -> Coverage | None:
    """Fast path for the usual case: equal boxes on a grid of their size (a set, no array).

    None when the boxes are not such a grid; the general path handles them.
    """
    if not boxes:
        return None
    size = boxes[0][1]
    if any(s != size for _, s in boxes) or any(
            o % max(n, 1) for offsets, _ in boxes for o, n in zip(offsets, size)):
        return None
    cells = math.prod(-(-g // max(n, 1)) for g, n in zip(global_shape, size))
    if any(g % max(n, 1) for g, n in zip(global_shape, size)):
        return None  # a ragged last row of cells: let the general path measure it
    distinct = len({o for o, _ in boxes})
    return Coverage(1 - distinct / cells if cells else 0.0, distinct < len(boxes), False)


# ---------------------------------------------------------------------------------------------
# Reading a checkpoint's metadata
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    key: str
    global_shape: tuple[int, ...]
    itemsize: int
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes)


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    path: str
    format: str  # "torch_dist" or "fsdp_dtensor"
    tensors: dict[str, SavedTensor]
    args: Any  # the saved training args Namespace, None if the checkpoint has none
    payload_bytes: int  # sum of the .distcp file sizes


def resolve_iteration_dir(path: str) -> str:
    """A save root resolves to its latest iteration directory; an iteration dir to itself."""
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
        return os.path.join(path, name)
    return path


def read_checkpoint_metadata(path: str, with_args: bool = True) -> CheckpointMetadata:
    """Reads `.metadata` (and, with_args, the saved args) of a torch_dist/fsdp_dtensor checkpoint."""
    try:
        path = resolve_iteration_dir(path)
    except (OSError, ValueError) as e:
        raise UnreadableCheckpoint(f"{path}: bad {TRACKER_FILE}: {e}") from e
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise UnreadableCheckpoint(f"{path}: no .metadata file, not a torch_dist/fsdp_dtensor checkpoint")
    reader = FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # a truncated or garbled pickle raises anything
        raise UnreadableCheckpoint(f"{path}/.metadata is unreadable: {type(e).__name__}: {e}") from e
    state = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(state, dict):
        raise UnreadableCheckpoint(f"{path}/.metadata holds no state_dict_metadata")

    megatron_meta = _read_json(os.path.join(path, "metadata.json"))
    fmt = (megatron_meta or {}).get("sharded_backend")
    if fmt is None:
        # fsdp_dtensor checkpoints are written by torch.distributed.checkpoint.save directly:
        # no metadata.json, model tensors under `model.`.
        fmt = "fsdp_dtensor" if any(k.startswith("model.") for k in state) else "torch_dist"

    tensors = {}
    for key, meta in state.items():
        if isinstance(meta, TensorStorageMetadata):
            tensors[key] = SavedTensor(
                key, tuple(meta.size), meta.properties.dtype.itemsize,
                tuple((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks))
    args = _read_args(path, reader, state) if with_args else None
    payload = sum(os.stat(os.path.join(path, f)).st_size
                  for f in os.listdir(path) if f.endswith(".distcp"))
    return CheckpointMetadata(path, fmt, tensors, args, payload)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_args(path: str, reader: FileSystemReader, state: dict) -> Any:
    """The training args: from common.pt (legacy) or the one small object stored in the checkpoint."""
    common_pt = os.path.join(path, "common.pt")
    if os.path.isfile(common_pt):
        return torch.load(common_pt, map_location="cpu", weights_only=False).get("args")
    key = COMMON_STATE_KEY if COMMON_STATE_KEY in state else "args" if "args" in state else None
    if key is None or not isinstance(state[key], BytesStorageMetadata):
        return None
    # Reads just this object's byte range out of the .distcp files, never the tensors.
    buffer = {key: io.BytesIO()}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, deliberately
        warnings.simplefilter("ignore", UserWarning)
        torch.distributed.checkpoint.load(buffer, storage_reader=reader, no_dist=True)
    value = buffer[key]
    if isinstance(value, io.BytesIO):
        value.seek(0)
        value = torch.load(value, map_location="cpu", weights_only=False)
    if key == COMMON_STATE_KEY:
        value = value[0] if isinstance(value, (list, tuple)) else value
        return value.get("args") if isinstance(value, dict) else None
    return value


# ---------------------------------------------------------------------------------------------
# The audit
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorFinding:
    key: str
    expert: bool
    global_shape: tuple[int, ...]
    expected_shape: tuple[int | None, ...] | None  # None: no rule for this tensor
    shape_ok: bool | None
    missing_fraction: float
    overlapping: bool
    out_of_bounds: bool
    saved_bytes: int
    layout: str  # the saved chunks, e.g. "32 chunks of [1, 1, 24, 32]"
    chunk_count: int
    expected_bytes: int | None

    @property
    def ok(self) -> bool:
        return (self.shape_ok is not False and self.missing_fraction == 0
                and not self.overlapping and not self.out_of_bounds)

    def problem(self) -> str:
        parts = []
        if self.shape_ok is False:
            parts.append(f"global shape {list(self.global_shape)} but the config implies "
                         f"{['*' if e is None else e for e in self.expected_shape]}")
        if self.missing_fraction:
            parts.append(f"{self.missing_fraction:.1%} of the global tensor has no chunk")
        if self.overlapping:
            parts.append("chunks overlap")
        if self.out_of_bounds:
            parts.append("a chunk lies outside the global shape")
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class AuditReport:
    path: str
    format: str
    have_config: bool
    tensors: list[TensorFinding]
    payload_bytes: int
    verdict: str

    @property
    def damaged(self) -> list[TensorFinding]:
        return [t for t in self.tensors if not t.ok]

    @property
    def exit_status(self) -> int:
        return EXIT_DAMAGED if self.damaged else EXIT_COMPLETE

    def to_json(self) -> dict:
        checked = [t for t in self.tensors if t.expected_bytes is not None]
        return {
            "path": self.path,
            "format": self.format,
            "verdict": self.verdict,
            "exit_status": self.exit_status,
            "have_config": self.have_config,
            "saved_bytes": sum(t.saved_bytes for t in self.tensors),
            "payload_bytes_on_disk": self.payload_bytes,
            "chunks": sum(t.chunk_count for t in self.tensors),
            "checked_saved_bytes": sum(t.saved_bytes for t in checked),
            "checked_expected_bytes": sum(t.expected_bytes for t in checked),
            "expert_saved_bytes": sum(t.saved_bytes for t in checked if t.expert),
            "expert_expected_bytes": sum(t.expected_bytes for t in checked if t.expert),
            "tensors": [dict(dataclasses.asdict(t), ok=t.ok) for t in self.tensors],
        }


def judge_tensor(key: str, global_shape: Sequence[int], itemsize: int,
                 boxes: Iterable[tuple[Sequence[int], Sequence[int]]],
                 dims: ModelDims | None) -> TensorFinding:
    """Tiling and shape verdict for one tensor; shared by the audit and the save guard."""
    global_shape = tuple(global_shape)
    boxes = list(boxes)
    cov = coverage(global_shape, boxes)
    expected = expected_shape(key, global_shape, dims) if dims else None
    saved = sum(math.prod(s) for _, s in boxes) * itemsize
    return TensorFinding(
        key=key,
        expert=is_expert_key(key),
        global_shape=global_shape,
        expected_shape=expected,
        shape_ok=None if expected is None else shape_matches(global_shape, expected),
        missing_fraction=cov.missing_fraction,
        overlapping=cov.overlapping,
        out_of_bounds=cov.out_of_bounds,
        saved_bytes=saved,
        expected_bytes=None if expected is None else expected_numel(global_shape, expected) * itemsize,
        layout=_describe_chunks(boxes),
        chunk_count=len(boxes),
    )


def _describe_chunks(boxes: list) -> str:
    sizes: dict[tuple, int] = {}
    for _, size in boxes:
        sizes[tuple(size)] = sizes.get(tuple(size), 0) + 1
    return ", ".join(f"{n} chunk{'s' if n > 1 else ''} of {list(size)}"
                     for size, n in sizes.items()) or "no chunks"


def verdict_for(findings: list[TensorFinding], dims: ModelDims | None) -> str:
    bad = [t for t in findings if not t.ok]
    if not bad:
        if dims is None:
            return "complete tiling; no model config found, global shapes not checked"
        return "complete: every tensor tiles its global shape once and matches the config"
    shrunk = [t for t in bad if t.expert and t.shape_ok is False
              and t.expected_bytes and t.saved_bytes * (dims.expert_tensor_parallel if dims else 1)
              == t.expected_bytes]
    lines = [f"DAMAGED: {len(bad)} of {len(findings)} tensors are wrong"]
    if shrunk:
        lines.append(f"Megatron-LM #1836 signature: {len(shrunk)} expert tensors hold 1/ETP "
                     f"(ETP={dims.expert_tensor_parallel}) of their true size; only one expert "
                     f"tensor-parallel replica was saved. Do not resume from this checkpoint.")
    return "\n".join(lines)


def audit(path: str) -> AuditReport:
    meta = read_checkpoint_metadata(path)
    dims = ModelDims.from_args(meta.args) if meta.args is not None else None
    findings = [judge_tensor(t.key, t.global_shape, t.itemsize, t.chunks, dims)
                for t in meta.tensors.values()]
    # Expert tensors first: they are what #1836 damages.
    findings.sort(key=lambda t: (not t.expert, t.key))
    return AuditReport(meta.path, meta.format, dims is not None, findings, meta.payload_bytes,
                       verdict_for(findings, dims))


def _print_text(report: AuditReport) -> None:
    data = report.to_json()
    print(f"checkpoint: {report.path} ({report.format})")
    for t in report.tensors:
        status = "ok " if t.ok else "BAD"
        shape = "unchecked" if t.shape_ok is None else "shape ok" if t.shape_ok else "SHAPE WRONG"
        print(f"  {status} {t.key} {list(t.global_shape)} {shape}"
              + (f": {t.problem()}" if not t.ok else ""))
    if data["expert_expected_bytes"]:
        ratio = data["expert_saved_bytes"] / data["expert_expected_bytes"]
        print(f"expert bytes saved / implied by config: {data['expert_saved_bytes']} / "
              f"{data['expert_expected_bytes']} = {ratio:.3f}")
    print(f"tensor bytes in metadata: {data['saved_bytes']}; .distcp bytes on disk: "
          f"{data['payload_bytes_on_disk']}")
    print(report.verdict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_patches.checkpoint_audit",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt_dir")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    options = parser.parse_args(argv)
    try:
        report = audit(options.ckpt_dir)
    except UnreadableCheckpoint as e:
        if options.json:
            print(json.dumps({"path": options.ckpt_dir, "verdict": f"UNREADABLE: {e}",
                              "exit_status": EXIT_UNREADABLE}))
        else:
            print(f"UNREADABLE: {e}", file=sys.stderr)
        return EXIT_UNREADABLE
    if options.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        _print_text(report)
    return report.exit_status


if __name__ == "__main__":
    sys.exit(main())
