"""Two jobs on two hosts and one --save, where the filesystem's locks cannot tell them apart
(issue 33). Real 1-rank runs; the second job sees the cluster through tests/native/
other_node_shim.c, at the system-call boundary: another hostname, and the filesystem's record
locks either failing with ENOLCK (no lock manager) or all granted (locks each node grants on its
own, as Lustre localflock or NFS local_lock=posix do).

Before the heartbeat, the second job took the directory over and its recovery removed the first
job's staged iteration (`_partial_<claim>_iter_*`): the first job then died at its commit.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from _launch import REPO, TINY_MODEL, LiveRun
from moe_launcher.checkpoint_files.commit_protocol import TRACKER
from moe_launcher.checkpoint_files.file_checks import file_problems
from moe_launcher.checkpoint_files.writer_claim import WRITER_LOCK

pytestmark = pytest.mark.slow

HOOKED = REPO / "tests" / "_commit_hooks_launch.py"
ARGS = [*TINY_MODEL, "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
        "--save-interval", "2"]
OTHER_HOST = "other-node"
TRAINED = re.compile(r"iteration\s+\d+/\s*\d+ \|")


@pytest.mark.parametrize("locks", ["enolck", "grant"])
def test_a_job_on_another_host_is_refused_and_the_first_loses_nothing(
        locks, node_shim, tmp_path):
    save, gate = tmp_path / "ckpt", tmp_path / "gate"
    elsewhere = {"LD_PRELOAD": str(node_shim), "NODE_SHIM_HOSTNAME": OTHER_HOST,
                 "LOCK_SHIM": locks}
    # The first job commits iteration 2, then stops with iteration 4 staged, not yet committed:
    # what a second job's recovery would remove.
    # (Its own lock calls are the kernel's: what matters is what the second job's calls answer.)
    first = LiveRun([*ARGS, "--train-iters", "6", "--save", str(save)], nproc=1, script=HOOKED,
                    env={"COMMIT_HOOK": f"commit:iter_0000004:wait={gate}"})
    try:  # the first job is let go whatever happens, or it would wait at the gate for ever
        deadline = time.monotonic() + 300
        while not Path(f"{gate}.reached").exists():
            assert first.proc.poll() is None and time.monotonic() < deadline, first.log()
            time.sleep(0.2)
        claim_id = json.loads((save / WRITER_LOCK).read_text())["claim"]
        staged = save / f"_partial_{claim_id}_iter_0000004"  # named with the first job's claim
        assert staged.is_dir() and (save / "iter_0000002").is_dir()
        staged_files = sorted(p.name for p in staged.iterdir())

        second = LiveRun([*ARGS, "--train-iters", "6", "--save", str(save), "--load", str(save)],
                         nproc=1, env=elsewhere)
        second_log = second.finish(300)
        assert second.proc.returncode != 0, second_log
        refusals = [line for line in second_log.splitlines() if "pretrain_moe: error:" in line]
        assert len(refusals) == 1 and "Traceback" not in second_log, second_log
        refusal = refusals[0]
        assert f"refusing to write {save}" in refusal and socket.gethostname() in refusal
        assert "heartbeat" in refusal and "MEGATRON_PATCHES_SAVE_TAKE_OVER" in refusal, refusal
        assert sorted(p.name for p in staged.iterdir()) == staged_files  # nothing of it removed
        assert not TRAINED.search(second_log)  # refused before any work
    finally:
        gate.touch()
        log = first.finish(300)
    assert first.proc.returncode == 0, log
    assert (save / TRACKER).read_text().strip() == "6"
    for iteration in (2, 4, 6):
        assert file_problems(str(save / f"iter_{iteration:07d}")) == [], iteration
    record = json.loads((save / WRITER_LOCK).read_text())
    assert record["host"] == socket.gethostname() and record["released"] is True

    if locks != "grant":
        return  # (one resume shows the release; each takes a launch of its own)
    # The first job ended and said so: a job on the other host takes over at once (no false
    # refusal while the heartbeat is still fresh) and resumes where the first stopped.
    resumed = LiveRun([*ARGS, "--train-iters", "8", "--override-opt_param-scheduler",
                       "--save", str(save), "--load", str(save)],
                      nproc=1, env=elsewhere)
    resumed_log = resumed.finish(300)
    assert resumed.proc.returncode == 0, resumed_log[-3000:]
    assert (save / TRACKER).read_text().strip() == "8"
    assert json.loads((save / WRITER_LOCK).read_text())["host"] == OTHER_HOST


def test_a_requeued_attempt_waits_for_its_earlier_one_then_resumes_from_its_last_commit(
        tmp_path):
    """Slurm requeued job 77 after its node failed: the earlier attempt's process still holds
    the writer lock (here alive at a gate with iteration 4 staged, as a dead node's NFSv4 lease
    or a Lustre eviction keeps the lock). The new attempt waits the requeue bound, takes the
    directory over, and resumes from iteration 2, the last one committed; job 78 is refused at
    once."""
    save, gate = tmp_path / "ckpt", tmp_path / "gate"
    earlier = LiveRun([*ARGS, "--train-iters", "6", "--save", str(save)], nproc=1, script=HOOKED,
                      env={"COMMIT_HOOK": f"commit:iter_0000004:wait={gate}",
                           "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"})
    try:
        deadline = time.monotonic() + 300
        while not Path(f"{gate}.reached").exists():
            assert earlier.proc.poll() is None and time.monotonic() < deadline, earlier.log()
            time.sleep(0.2)
        resume = [*ARGS, "--train-iters", "6", "--save", str(save), "--load", str(save)]
        other = LiveRun(resume, nproc=1, env={"SLURM_JOB_ID": "78", "SLURM_RESTART_COUNT": "0"})
        other_log = other.finish(300)
        assert other.proc.returncode != 0 and "job 77" in other_log, other_log[-3000:]
        assert not TRAINED.search(other_log), other_log[-3000:]

        requeued = LiveRun(resume, nproc=1, env={
            "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1",
            "MEGATRON_PATCHES_REQUEUE_WAIT_S": "2"})
        log = requeued.finish(300)
    finally:
        earlier.rank(0).kill()  # SIGKILL: the failed node's attempt never comes back
        earlier.finish(60)
    assert requeued.proc.returncode == 0, log[-3000:]
    assert "taken over from this job's earlier attempt" in log, log[-3000:]
    assert re.search(r"loaded checkpoint from .* at iteration 2\b", log), log[-3000:]
    assert sorted(int(n) for n in re.findall(r"iteration\s+(\d+)/\s*6 \|", log)) == [3, 4, 5, 6]
    assert (save / TRACKER).read_text().strip() == "6"
    for iteration in (2, 4, 6):
        assert file_problems(str(save / f"iter_{iteration:07d}")) == [], iteration
    assert not [p.name for p in save.iterdir() if p.name.startswith("_partial_")]
    record = json.loads((save / WRITER_LOCK).read_text())
    assert (record["job"], record["restart"]) == ("77", 1)
