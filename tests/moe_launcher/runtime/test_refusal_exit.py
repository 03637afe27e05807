"""A refused run ends with the refusal's status without tearing the interpreter down: its atexit
handlers run (the writer claims' release among them), its output is flushed, and no thread or
C++ destructor left behind can hold the exit or abort it.

Why: a refusal is raised right after the collective in which the ranks agreed on it. Two gloo
ranks that then exit through the interpreter's finalization, one while the other still waits,
aborted the first in C++ in 12 of 40 torchrun runs here ("terminate called without an active
exception", exit -6 instead of 1); so did CI's ETP resume refusal once
(test_checkpoint_guard.py). Ended by pretrain_moe.exit_refused: 0 of 40. Those runs are too slow
and too rare to repeat here; this test holds the property that removed the abort: the process
ends without finalization (Python's own finalization would wait for the thread below forever)."""

import subprocess
import sys

from tests._launch import REPO

PROGRAM = """
import atexit, sys, threading
import pretrain_moe

atexit.register(lambda: open(sys.argv[1], "w").write("released"))
threading.Thread(target=threading.Event().wait).start()  # never ends, not a daemon
print("refused", end="")
pretrain_moe.exit_refused(3)
"""


def test_a_refusal_exits_with_its_status_after_the_atexit_handlers_without_finalizing(tmp_path):
    marker = tmp_path / "atexit-ran"
    ended = subprocess.run([sys.executable, "-c", PROGRAM, str(marker)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert ended.returncode == 3, ended.stderr[-3000:]
    assert ended.stdout == "refused"
    assert marker.read_text() == "released"
