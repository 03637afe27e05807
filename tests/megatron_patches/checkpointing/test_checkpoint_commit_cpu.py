"""atomic-checkpoint-commit in real 1-rank gloo runs, each put into a chosen state of a save by
tests/_commit_hooks_launch.py (a kill, or a pause, at a named step of the commit).

* A job that loads a live run's --save (an evaluation or fine-tune with its own --save) while
  that run's save is staged reads the committed iteration and writes nothing there; the live run
  then commits and goes on. (A second writer of the same --save is refused: see
  test_checkpoint_commit.py, with a real second process holding the directory.)
* With --save-retain-interval, a crash at every step of a save that drops the older iteration
  leaves the tracker naming a complete checkpoint, and each restart resumes from it.
* A save that fails for a reason other than room (a stale NFS handle at the commit) is reported
  with its own error, not as a full disk, and its traceback is in a file the message names.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import time
from pathlib import Path

import pytest

from _launch import REPO, TINY_MODEL, LiveRun, launch
from megatron_patches.checkpointing.atomic_checkpoint_commit import SAVE_FAILURES
from moe_launcher.checkpoint_files.commit_protocol import TRACKER
from moe_launcher.checkpoint_files.file_checks import file_problems
from moe_launcher.checkpoint_files.writer_claim import WRITER_LOCK

pytestmark = pytest.mark.slow

HOOKED = REPO / "tests" / "_commit_hooks_launch.py"
ARGS = [*TINY_MODEL, "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
        "--save-interval", "1"]


def tree(directory: Path) -> dict[str, str]:
    """Every file and folder under `directory` with its content hash ('' for a folder)."""
    return {str(p.relative_to(directory)): hashlib.sha1(p.read_bytes()).hexdigest()
            if p.is_file() else "" for p in sorted(directory.rglob("*"))}


def tracked(save: Path) -> str:
    return f"iter_{int((save / TRACKER).read_text()):07d}"


def loaded_iteration(log: str, directory: Path) -> int | None:
    found = re.search(rf"successfully loaded checkpoint from {re.escape(str(directory))} "
                      rf"\[.*?\] at iteration (\d+)", log)
    return int(found.group(1)) if found else None


def hooked_run(args: list[str], hook: str) -> str:
    run = LiveRun(args, nproc=1, script=HOOKED, env={"COMMIT_HOOK": hook})
    return run.finish(300)


def test_loading_a_live_runs_directory_leaves_its_save_in_flight_alone(tmp_path):
    live, other = tmp_path / "live", tmp_path / "other"
    gate = tmp_path / "gate"
    started = time.monotonic()
    run = LiveRun([*ARGS, "--train-iters", "3", "--save", str(live), "--load", str(live)],
                  nproc=1, script=HOOKED, env={"COMMIT_HOOK": f"commit:iter_0000002:wait={gate}"})
    try:
        deadline = time.monotonic() + 300
        while not Path(f"{gate}.reached").exists():
            assert time.monotonic() < deadline and run.proc.poll() is None, run.log()[-3000:]
            time.sleep(0.2)
        # The live run has committed iteration 1 and staged iteration 2.
        assert tracked(live) == "iter_0000001"
        assert len(list(live.glob("_partial_*_iter_0000002"))) == 1
        before = tree(live)

        # An evaluation / fine-tune: --load the live run's directory, --save its own.
        reader = launch(1, [*ARGS, "--train-iters", "3", "--load", str(live), "--save", str(other)],
                        timeout=300).check()
        assert loaded_iteration(reader.log, live) == 1, reader.log[-3000:]
        assert tree(live) == before, "the reader changed the live run's directory"
        assert tracked(other) == "iter_0000003"

        # The live run commits its save and trains on to the end.
        gate.touch()
        log = run.finish(300)
        assert run.proc.returncode == 0, log[-3000:]
        assert "successfully saved checkpoint from iteration       3" in log
        assert tracked(live) == "iter_0000003" and not file_problems(str(live / "iter_0000003"))
        assert not list(live.glob("_partial_*")), sorted(p.name for p in live.iterdir())
    finally:
        run.stop()
    print(f"\n[commit] live save left alone by a job loading its directory, "
          f"{time.monotonic() - started:.0f}s")


def test_crash_at_every_step_of_a_retaining_save_keeps_a_loadable_tracker(tmp_path):
    # --save-retain-interval 2: saving iteration 2 drops iteration 1, saving 4 drops 3.
    save = tmp_path / "ckpt"
    args = [*ARGS, "--save-retain-interval", "2", "--train-iters", "4",
            "--save", str(save), "--load", str(save)]
    started = time.monotonic()
    # Where the crash comes, and the checkpoints the tracker may then name. The last crash hits
    # the background removal of iteration 1 (at once, the hook's kill from a thread) while
    # training goes on, so the run may have committed iteration 3 by then.
    steps = [("commit:iter_0000002:kill", {"iter_0000001"}),
             ("write_tracker:iter_0000002:kill", {"iter_0000001"}),
             ("remove_retired:iter_0000001:kill", {"iter_0000002", "iter_0000003"})]
    resume_from = None
    for hook, allowed in steps:
        log = hooked_run(args, hook)
        assert loaded_iteration(log, save) == resume_from, (hook, log[-3000:])
        assert tracked(save) in allowed, (hook, sorted(p.name for p in save.iterdir()))
        problems = file_problems(str(save / tracked(save)))
        assert not problems, (hook, problems)
        resume_from = int(tracked(save).split("_")[1])
    retired = list(save.glob("_retired_*_iter_0000001"))  # the last crash came mid-removal,
    assert len(retired) == 1 and retired[0].is_dir()  # of a name carrying the writer's claim

    final = launch(1, args, timeout=300).check()
    assert loaded_iteration(final.log, save) == resume_from, final.log[-3000:]
    assert tracked(save) == "iter_0000004" and not file_problems(str(save / "iter_0000004"))
    kept = sorted(p.name for p in save.iterdir() if p.name != WRITER_LOCK)
    assert kept == ["iter_0000002", "iter_0000004", TRACKER], kept
    print(f"\n[commit] retention: {len(steps)} crashes, tracker complete after each, "
          f"{time.monotonic() - started:.0f}s")


def test_a_save_failing_for_another_reason_than_room_keeps_its_error_and_traceback(tmp_path):
    save = tmp_path / "ckpt"
    run = LiveRun([*ARGS, "--train-iters", "2", "--save", str(save)], nproc=1, script=HOOKED,
                  env={"COMMIT_HOOK": "commit:iter_0000002:raise=ESTALE"})
    log = run.finish(300)
    assert run.proc.returncode == 1, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("pretrain_moe: error:")]
    assert len(errors) == 1, log[-3000:]
    error = errors[0]
    assert f"saving iteration 2 to {save} failed on rank 0: OSError: [Errno {errno.ESTALE}] " \
           f"{os.strerror(errno.ESTALE)}" in error, error
    assert "free space" not in error and "MiB free" not in error, error
    found = re.search(r"full traceback in (\S+)\)", error)
    assert found, error
    written = Path(found.group(1))
    assert written == save / SAVE_FAILURES / "iter_0000002.rank0.txt", error
    text = written.read_text()
    assert "Traceback (most recent call last)" in text and "commit_protocol.commit(" in text, text
    assert text.rstrip().endswith(f"OSError: [Errno {errno.ESTALE}] {os.strerror(errno.ESTALE)}"), text
    assert "Traceback" not in log.replace(error, ""), log[-3000:]  # one line, no traceback
    assert tracked(save) == "iter_0000001" and not list(save.glob("_partial_*"))
    print(f"\n[commit] {error}")


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_crash_inside_megatrons_tracker_write(patched, tmp_path):
    """A kill where megatron-core 0.19.2 rewrites the tracker in place (truncated, the iteration
    not yet written), hooked at megatron's own call. Without atomic-checkpoint-commit the tracker
    is left empty and the restart exits 0 without training (megatron's read_metadata calls
    sys.exit() on it; checkpoint-load-integrity, which would refuse it, is left out too). With it
    megatron's write goes to a scratch copy: the tracker names iteration 1 and the restart goes on
    from there."""
    save = tmp_path / "ckpt"
    args = [*ARGS, "--train-iters", "3", "--save", str(save), "--load", str(save)]
    env = {} if patched else {
        "MEGATRON_PATCHES_DISABLE": "atomic-checkpoint-commit,checkpoint-load-integrity"}
    crashed = LiveRun(args, nproc=1, script=HOOKED,
                      env={**env, "COMMIT_HOOK": "megatron_tracker_write:iter_0000002:kill"})
    log = crashed.finish(300)
    assert crashed.proc.returncode != 0 and "iteration        3/" not in log, log[-3000:]
    restart = launch(1, args, env=env, timeout=300)
    if patched:
        assert (save / TRACKER).read_text() == "3", restart.log[-3000:]
        assert loaded_iteration(restart.log, save) == 1, restart.log[-3000:]
        assert restart.returncode == 0 and "iteration        3/" in restart.log
    else:
        assert (save / TRACKER).read_bytes() == b"" and (save / "iter_0000002").is_dir()
        assert restart.returncode == 0, restart.log[-3000:]
        assert f"ERROR: Invalid metadata file {save / TRACKER}. Exiting" in restart.log
        assert not re.search(r"iteration +\d+/", restart.log), restart.log[-3000:]
