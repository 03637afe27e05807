"""Context parallelism: the forward step gives each CP rank megatron's slice of the sequence
(the model itself cannot run CP on CPU: megatron's local attention asserts CP == 1, so preflight
refuses such runs; see test_preflight)."""

import re

import pytest

from _launch import REPO, launch


@pytest.mark.slow
def test_each_context_parallel_rank_reads_its_slice_of_the_sequence():
    run = launch(4, [], script=REPO / "tests" / "_cp_batch_worker.py", timeout=180).check()
    lines = re.findall(r"^rank \d cp_rank \d: .*$", run.log, flags=re.M)
    assert len(lines) == 4 and all(line.endswith("slice ok") for line in lines), run.log[-3000:]
