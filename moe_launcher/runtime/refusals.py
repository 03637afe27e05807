"""The launcher's refusals: the exception types a run stops with on purpose, and their one-line
wording. pretrain_moe.py prints them without a traceback; every patch and check that refuses
raises one of these.

* `PreflightError`: a command line or environment that cannot run, found before megatron builds
  anything (or, where only the model built shows it, all ranks agreeing, before anything is
  loaded or written: torch-format-shard-guard); rank 0 prints `pretrain_moe: error: ...` and
  every rank exits with `EXIT_STATUS`.
* `LayerLayoutError`: layers megatron would build, or built, other than the flags ask (#1778).
* `CheckpointRefusal` (`CheckpointSaveError`, `CheckpointLoadError`): a save or load stopped on
  purpose once training runs; every rank exits 1. One whose verdict every rank reached alike
  (`every_rank`: a gathered verdict, or the same check on every rank) is printed once, by rank
  0, `pretrain_moe: error: ...`; one rank's own failure by that rank, `... [rank N] ...`.
* `DataRefusal`: a batch the model cannot take (token ids past its vocabulary), before it moves
  to the device; the rank that read it prints its line and exits 1. Datasets made with another
  tokenizer (their prepare_data record) are refused the same way, printed once by rank 0.
* `ToolError`: the tools' refusals (`python -m moe_launcher.convert`, `... .prepare_data`): one
  line `<tool>: error: ...` on stderr, exit `EXIT_STATUS`, nothing left behind.
* The #1836 guards' `IncompleteCheckpointError` subclasses megatron's own CheckpointingException,
  so it lives with the guard (this module imports no megatron); it says `refusal_names_its_fix`
  and `every_rank`. Raised inside a torch.distributed.checkpoint load, it reaches the entrypoint
  inside torch's CheckpointException, where `find_refusal` finds it.

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
    """A save or load this project stopped on purpose; the message says what and where.
    `every_rank`: every rank raises it alike (rank 0 alone then prints it)."""

    refusal_names_its_fix = True

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class CheckpointSaveError(CheckpointRefusal):
    pass


class CheckpointLoadError(CheckpointRefusal):
    pass


class DataRefusal(RuntimeError):
    """Training data the model cannot take: a token id past its vocabulary met in a batch (the
    rank that read it prints one line naming it and exits 1, instead of an IndexError, a
    device-side assert on a GPU), or datasets whose prepare_data record names another
    tokenizer (`every_rank`: every rank judges the same records; rank 0 prints it)."""

    refusal_names_its_fix = True

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class ToolError(Exception):
    """Input a tool cannot use; each tool subclasses it with its own name as `tool`."""

    tool = "moe_launcher"

    def line(self) -> str:
        return f"{self.tool}: error: {self}"


def exceptions_in(exc: BaseException):
    """`exc`, its causes and contexts, and the per-rank exceptions torch's CheckpointException
    carries in `failures` ({rank: (exception, traceback summary)})."""
    seen, todo = set(), [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()
                     if isinstance(f, (tuple, BaseException))]


def find_refusal(exc: BaseException) -> BaseException | None:
    """The refusal behind `exc` (one that says `refusal_names_its_fix`), wherever
    `exceptions_in` finds it; None if there is none."""
    return next((e for e in exceptions_in(exc) if getattr(e, "refusal_names_its_fix", False)),
                None)


def refusal_line(exc: BaseException) -> str | None:
    """The line this rank prints for refusal `exc`: rank 0's alone where every rank refused
    alike (None on the others), else every rank's own, naming its rank."""
    rank = os.environ.get("RANK", "0")
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if getattr(exc, "every_rank", False):
        return f"pretrain_moe: error: {text}" if rank == "0" else None
    return f"pretrain_moe: error: [rank {rank}] {text}"
