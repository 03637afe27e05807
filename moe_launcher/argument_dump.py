"""megatron's argument dump (the `---- arguments ----` block, one line per flag: over 800 lines
in megatron-core 0.19.2) into a file of the run, named in one line of the log.

megatron's validate_args prints the block on rank 0. With $MEGATRON_ARGUMENTS_FILE set
(examples/moe/train.sh sets it in the run folder) the block is taken out of the launcher's
stdout while megatron's checks run; everything else megatron prints there passes through as
it comes. The file is written once every check has passed (a refused command line writes
nothing). Without the variable megatron prints the block as it always does.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

ARGUMENTS_FILE_ENV = "MEGATRON_ARGUMENTS_FILE"
_BLOCK_START = "arguments ----"       # megatron's "---------- arguments ----------" line
_BLOCK_END = "end of arguments ----"  # and its "------ end of arguments ------" line


class _ArgumentBlockSplitter(io.TextIOBase):
    """A stdout that keeps megatron's argument block and forwards every other line."""

    def __init__(self, forward):
        self.forward = forward
        self.block: list[str] = []
        self._inside = False
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._route(line)
        return len(text)

    def _route(self, line: str) -> None:
        starts = not self._inside and line.startswith("---") and _BLOCK_START in line \
            and _BLOCK_END not in line
        if starts or self._inside:
            self.block.append(line)
            self._inside = not (self._inside and _BLOCK_END in line)
        else:
            self.forward.write(line + "\n")

    def flush(self) -> None:
        if self._partial:
            self._route(self._partial)
            self._partial = ""
        self.forward.flush()


@contextlib.contextmanager
def argument_block_kept(environ=os.environ):
    """Inside the block, megatron's argument dump is kept (the yielded list of its lines) where
    $MEGATRON_ARGUMENTS_FILE is set, and printed as megatron prints it otherwise."""
    block: list[str] = []
    if not environ.get(ARGUMENTS_FILE_ENV):
        yield block
        return
    splitter = _ArgumentBlockSplitter(sys.stdout)
    try:
        with contextlib.redirect_stdout(splitter):
            yield block
    finally:
        splitter.flush()
        block.extend(splitter.block)


def write_argument_block(block: list[str], environ=os.environ) -> str | None:
    """Writes the kept block to $MEGATRON_ARGUMENTS_FILE; the log line naming it, or None when
    nothing was kept (the variable unset, or a rank megatron does not print on)."""
    path = environ.get(ARGUMENTS_FILE_ENV)
    if not path or not block:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as out:
        out.write("\n".join(block) + "\n")
    return f"[pretrain_moe] megatron's arguments ({len(block) - 2} flags): {path}"
