"""The launcher's refusals: the exception types a run stops with on purpose, and their one-line
wording. pretrain_moe.py prints them without a traceback; every patch and check that refuses
raises one of these.

* `PreflightError`: a command line or environment that cannot run, found before megatron builds
  anything (or, where only the model built shows it, all ranks agreeing, before anything is
  loaded or written: torch-format-shard-guard); rank 0 prints `pretrain_moe: error: ...` and
  every rank exits with `EXIT_STATUS`.
* `LayerLayoutError`: layers megatron would build, or built, other than the flags ask (#1778).
* `CheckpointRefusal` (`CheckpointSaveError`, `CheckpointLoadError`): a save or load stopped on
  purpose once training runs; every rank prints its one line and exits 1.
* `ToolError`: the tools' refusals (`python -m moe_launcher.convert`, `... .prepare_data`): one
  line `<tool>: error: ...` on stderr, exit `EXIT_STATUS`, nothing left behind.
* The #1836 guards' `IncompleteCheckpointError` subclasses megatron's own CheckpointingException
  (megatron reports it per rank), so it lives with the guard: this module imports no megatron.

Imports nothing of megatron or torch: the entrypoint imports it before either.
"""

from __future__ import annotations

import os

EXIT_STATUS = 2


class PreflightError(Exception):
    """A command line or environment that cannot run. `flag` names what to change."""

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag

    def line(self) -> str:
        return f"pretrain_moe: error: {self}"


class LayerLayoutError(ValueError):
    """Layers per pipeline stage that megatron would misplace, or a built model whose layers
    differ from the flags (NVIDIA/Megatron-LM#1778); preflight words it as a PreflightError."""


class CheckpointRefusal(RuntimeError):
    """A save or load this project stopped on purpose; the message says what and where."""


class CheckpointSaveError(CheckpointRefusal):
    pass


class CheckpointLoadError(CheckpointRefusal):
    pass


class ToolError(Exception):
    """Input a tool cannot use; each tool subclasses it with its own name as `tool`."""

    tool = "moe_launcher"

    def line(self) -> str:
        return f"{self.tool}: error: {self}"


def refusal_types() -> tuple[type, ...]:
    """Exceptions the launcher prints as one line per rank, without a traceback. The #1836
    guard's IncompleteCheckpointError keeps megatron's per-rank error report (its tests read
    it); it names the directory and the tensors either way."""
    return (CheckpointRefusal,)


def refusal_line(exc: BaseException) -> str:
    rank = os.environ.get("RANK", "0")
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"pretrain_moe: error: [rank {rank}] {text}"
