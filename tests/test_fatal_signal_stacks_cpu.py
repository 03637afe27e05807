"""A rank that dies of a fatal signal prints its Python stacks first (pretrain_moe.py enables
faulthandler): the log of a run aborted by NCCL's watchdog or by glibc's heap checks says which
line each thread was on. Reference: CPython's faulthandler report ("Fatal Python error: Aborted").
"""

import signal
import time

from _launch import TINY_MODEL, LiveRun


def test_aborted_rank_prints_its_python_stack():
    run = LiveRun(TINY_MODEL + ["--train-iters", "1000"], nproc=2)
    try:
        assert run.wait_for("[pretrain_moe] megatron-core", 1, time.monotonic() + 120), run.log()
        run.rank(1).send_signal(signal.SIGABRT)
        log = run.finish(60)
    finally:
        run.stop()
    assert "Fatal Python error: Aborted" in log, log[-3000:]
    # The main thread's stack ends in the entrypoint's main(), below megatron's pretrain().
    report = log[log.index("Fatal Python error: Aborted"):]
    assert 'pretrain_moe.py", line' in report and "in main" in report, report[:3000]
    assert "[ranks] exit codes:" in log and "-6" in log.split("[ranks] exit codes:")[1], log[-2000:]
