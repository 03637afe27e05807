"""Megatron-FSDP's asynchronous parameter all-gathers are done when they return on the CPU
backend (gloo_bridges._gathers_done_on_return: overlapped with the rank's thread on gloo's
worker threads they corrupted the heap), and still gather every rank's shard. torch's own
coalescing manager, unbridged, is the reference that the gather would otherwise still run."""

import re

import pytest

from _launch import REPO, launch


@pytest.mark.slow
def test_megatron_fsdp_gathers_are_done_when_they_return():
    log = launch(2, [], script=REPO / "tests" / "_fsdp_gather_worker.py", timeout=300).check().log
    lines = dict(re.findall(r"^gather (\w+): (.*)$", log, re.M))
    assert lines["torch"] == "done on return False, gathered right True", log[-3000:]
    assert lines["megatron_fsdp"] == "done on return True, gathered right True", log[-3000:]
