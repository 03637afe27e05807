"""Strict device mode of the CPU backend: a host tensor on a group that is NCCL on a GPU (the
default group, new_group without backend="gloo") is refused, as NCCL would refuse it; device
tensors, gloo groups and object collectives pass (2 real gloo ranks)."""

import re

import pytest

from _launch import REPO, launch

REFUSED = [
    "host all_reduce on default group",
    "host tensor from .cpu() on default group",
    "host-derived tensor on default group",
    "host all_reduce on new_group without backend",
    "host all_gather_into_tensor on default group",
    "host broadcast on default group",
    "host batch_isend_irecv on default group",
]
PASSED = [
    "device all_reduce on default group",
    "host made device by .cuda() on default group",
    "device all_gather (uneven bridge) on default group",
    "device reduce_scatter (bridge) on default group",
    "device batch_isend_irecv on default group",
    "host all_reduce on gloo group",
    "all_gather_object on default group",
    "broadcast_object_list on default group",
]


@pytest.mark.slow
def test_host_tensors_refused_only_where_nccl_would_refuse_them():
    log = launch(2, [], script=REPO / "tests" / "_strict_device_worker.py", timeout=300).check().log
    verdicts = dict(re.findall(r"^case (.+?): (passed|refused: .*)$", log, re.M))
    assert set(verdicts) == set(REFUSED + PASSED), log[-3000:]
    for case in REFUSED:
        assert verdicts[case].startswith("refused: torch.distributed."), (case, verdicts[case])
        assert "NCCL would refuse a host tensor" in verdicts[case]
    assert "all_reduce got a host tensor on the default process group" in verdicts[REFUSED[0]]
    for case in PASSED:
        assert verdicts[case] == "passed", (case, verdicts[case])
