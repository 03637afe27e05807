"""Audits a distributed checkpoint from its metadata alone (Megatron-LM #1836).

With expert tensor parallelism (ETP > 1) megatron-core <0.16 wrote expert weights with a global
shape 1/ETP of the true one and saved only one ETP replica; a resumed run then silently gave the
other ETP ranks wrong expert weights. Nothing in the checkpoint looks broken unless one compares
the global shapes against the shapes the saved model config implies, which is what this does.

    python -m megatron_patches.checkpoint_audit CKPT_DIR [--json]

CKPT_DIR is a save root (with latest_checkpointed_iteration.txt) or one iter_XXXXXXX directory,
in `torch_dist` or `fsdp_dtensor` format, or the legacy `torch` format: for that one the audit
shows the layout its saved arguments record, every file that layout writes with the ranks that
write it and the file's size, and names the expert pieces such a save lost (Megatron-LM #1719:
ranks holding different expert tensor-parallel pieces wrote one file). Only the `.metadata` file is parsed, plus the small
pickled model args (common.pt, or the one `common_state`/`args` object inside the checkpoint);
tensor payloads are never read, .distcp files are only stat()ed. Without a model the shapes come
from rules on the saved args (shape_rules.py): a tensor no rule covers, or one a flag the
rules do not model changes, is reported "unchecked", never damaged.
Exit status: 0 complete, 1 damaged, 2 unreadable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Iterable, Sequence

from moe_launcher.checkpoint_files import torch_format
from moe_launcher.checkpoint_files.geometry import Box, Coverage, coverage, describe_chunks
from moe_launcher.checkpoint_files.metadata import (
    UnreadableCheckpoint,
    read_checkpoint_metadata,
    resolve_iteration_dir,
)
from moe_launcher.checkpoint_files.shape_rules import (
    ModelDims,
    expected_numel,
    expected_shape,
    is_expert_key,
    shape_matches,
)

EXIT_COMPLETE, EXIT_DAMAGED, EXIT_UNREADABLE = 0, 1, 2


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
        parts += Coverage(self.missing_fraction, self.overlapping, self.out_of_bounds).problems()
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


def judge_tensor(key: str, global_shape: Sequence[int], itemsize: int, boxes: Iterable[Box],
                 dims: ModelDims | None) -> TensorFinding:
    """Tiling and config-rule shape verdict for one saved tensor."""
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
        layout=describe_chunks(boxes),
        chunk_count=len(boxes),
    )


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


@dataclasses.dataclass(frozen=True)
class TorchFormatReport:
    """A legacy torch-format checkpoint: the layout saved in it and the files it implies."""
    path: str
    layout: torch_format.SavedLayout | None  # None: no arguments saved
    files: list[dict]  # file, ranks writing it, bytes on disk (None: missing)
    problems: list[str]

    @property
    def exit_status(self) -> int:
        return EXIT_DAMAGED if self.problems else EXIT_COMPLETE

    @property
    def verdict(self) -> str:
        if self.problems:
            return (f"DAMAGED: {'; '.join(self.problems)}. Do not resume from this checkpoint.")
        if self.layout is None:
            return "no saved arguments: the layout and its files are not checked"
        return "complete: every file the saved layout writes is here, each from one piece"

    def to_json(self) -> dict:
        return {"path": self.path, "format": "torch", "verdict": self.verdict,
                "exit_status": self.exit_status,
                "layout": dataclasses.asdict(self.layout) if self.layout else None,
                "files": self.files, "problems": self.problems}


def audit_torch_format(iteration_dir: str) -> TorchFormatReport:
    """Reads one file's saved arguments (tensors mapped, not read) and stats the others."""
    found = torch_format.model_files(iteration_dir)
    try:
        args = torch_format.saved_args(found[0]) if found else None
    except Exception as e:  # a truncated or garbled pickle raises anything
        raise UnreadableCheckpoint(f"{found[0]} is unreadable: {type(e).__name__}: {e}") from e
    if args is None:
        files = [{"file": os.path.relpath(f, iteration_dir), "ranks": None,
                  "bytes": os.path.getsize(f)} for f in found]
        return TorchFormatReport(iteration_dir, None, files, [])
    layout = torch_format.SavedLayout.from_args(args)
    files, problems = [], []
    for name, pieces in sorted(torch_format.by_file(torch_format.writers(layout)).items()):
        path = os.path.join(iteration_dir, name, torch_format.MODEL_FILE)
        ranks = sorted(r for held in pieces.values() for r in held)
        files.append({"file": os.path.relpath(path, iteration_dir), "ranks": ranks,
                      "bytes": os.path.getsize(path) if os.path.isfile(path) else None})
        if len(pieces) > 1:
            problems.append(torch_format.damage(layout, name, ranks))
        if not os.path.isfile(path):
            problems.append(f"{files[-1]['file']} (ranks {ranks}) is missing")
    return TorchFormatReport(iteration_dir, layout, files, problems)


def _print_torch_format(report: TorchFormatReport) -> None:
    print(f"checkpoint: {report.path} (torch)")
    if report.layout is not None:
        print(f"layout saved: {report.layout.describe()}")
    for f in report.files:
        size = "MISSING" if f["bytes"] is None else f"{f['bytes']} bytes"
        writers = "" if f["ranks"] is None else f", written by ranks {f['ranks']}"
        print(f"  {f['file']}: {size}{writers}")
    print(report.verdict)


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
        iteration_dir = resolve_iteration_dir(options.ckpt_dir)
        if os.path.isdir(iteration_dir) and torch_format.is_torch_format(iteration_dir):
            torch_report = audit_torch_format(iteration_dir)
            if options.json:
                print(json.dumps(torch_report.to_json(), indent=1))
            else:
                _print_torch_format(torch_report)
            return torch_report.exit_status
        report = audit(options.ckpt_dir)
    except (UnreadableCheckpoint, OSError, ValueError) as e:
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
