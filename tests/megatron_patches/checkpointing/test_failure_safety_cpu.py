"""Failure safety in real 2-rank gloo runs of pretrain_moe.py: nothing lost, every refusal explained.

* SIGKILL of a random rank at random (seeded) moments of a run that saves every iteration:
  after every kill the tracker names a complete checkpoint (every file the metadata lists is
  there and long enough; the #1836 audit passes where installed), no checkpoint at or below the
  tracker changed by a byte, and the restart resumes from the tracker and goes on training.
* A save that runs out of room (RLIMIT_FSIZE; the launcher ignores SIGXFSZ so writes fail with
  EFBIG): the run stops with one line naming the checkpoint directory; the previous checkpoint
  and the tracker are byte-for-byte unchanged; no partial directory is left.
* Damaged checkpoints (truncated / deleted .distcp, missing .metadata, empty tracker, tracker
  naming a missing directory, #1836 expert shapes where the layout guard is installed): every
  rank refuses within seconds with a message naming the directory and what is wrong, before
  megatron reads a tensor. The load-integrity refusal (a truncated file) and the load guard's
  (#1836 shapes) run under torchrun, which stops the job at the first rank's exit: every rank
  still says why.

The counts of kills, corruptions and their outcomes are printed (`-s`) and asserted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from _launch import TINY_MODEL, LiveRun, launch
from moe_launcher.checkpoint_files.commit_protocol import TRACKER
from moe_launcher.checkpoint_files.file_checks import file_problems

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("FAILSAFE_SEED", "1836"))
KILLS = int(os.environ.get("FAILSAFE_KILLS", "6"))
TRAIN_ITERS = 16
COMMON = [*TINY_MODEL, "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
          "--moe-token-dispatcher-type", "alltoall", "--save-interval", "1"]
EP2 = ["--expert-model-parallel-size", "2"]
ETP2 = ["--expert-tensor-parallel-size", "2"]  # the layout #1836 damaged


def snapshot(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file()}


def tracker_dir(save: Path) -> Path:
    text = (save / TRACKER).read_text().strip()
    return save / f"iter_{int(text):07d}"


def audit_exit_status(iteration_dir: Path) -> int | None:
    """The #1836 audit's verdict (0 complete, 1 damaged, 2 unreadable), in process (the same
    as `python -m megatron_patches.checkpoint_audit DIR`); None where it is not installed."""
    try:
        from moe_launcher.checkpoint_files.audit import UnreadableCheckpoint, audit
    except ImportError:
        return None
    try:
        return audit(str(iteration_dir)).exit_status
    except UnreadableCheckpoint:
        return 2


def test_sigkill_at_random_moments_never_loses_a_checkpoint(tmp_path):
    rng = random.Random(SEED)
    save = tmp_path / "ckpt"
    args = [*COMMON, *EP2, "--train-iters", str(TRAIN_ITERS), "--save", str(save),
            "--load", str(save)]
    committed: dict[str, dict[str, str]] = {}  # checkpoints at or below the tracker
    kills = kills_mid_save = 0
    lost_or_wrong = []
    expected_resume = None
    started = time.monotonic()
    for cycle in range(KILLS):
        run = LiveRun(args)
        saves_before_kill = rng.randint(1, 2)
        if not run.wait_for("saving checkpoint at iteration", saves_before_kill,
                            time.monotonic() + 150):
            run.finish(60)
            break  # training finished before this kill
        time.sleep(rng.uniform(0.0, 0.4))
        mid_save = run.count("saving checkpoint at iteration") > run.count(
            "successfully saved checkpoint")
        victims = run.ranks()
        if run.proc.poll() is not None or not victims:
            run.finish(60)
            break
        rng.choice(victims).send_signal(signal.SIGKILL)
        kills += 1
        kills_mid_save += mid_save
        log = run.finish(90)
        if expected_resume is None and "successfully loaded checkpoint" in log:
            lost_or_wrong.append(f"cycle {cycle}: loaded a checkpoint the tracker never named")
        if expected_resume is not None and (
                f"successfully loaded checkpoint from {save}" not in log
                or f"at iteration {expected_resume}" not in log):
            lost_or_wrong.append(f"cycle {cycle}: did not resume from iteration {expected_resume}")

        # The tracker names a complete checkpoint; nothing at or below it changed.
        if not (save / TRACKER).exists():  # killed during the very first save
            if committed:
                lost_or_wrong.append(f"cycle {cycle}: the tracker vanished")
            continue
        target = tracker_dir(save)
        if problems := file_problems(str(target)):
            lost_or_wrong.append(f"cycle {cycle}: {target.name} damaged: {problems}")
        if audit_exit_status(target) not in (None, 0):
            lost_or_wrong.append(f"cycle {cycle}: audit rejects {target.name}")
        for name, files in committed.items():
            if not (save / name).is_dir() or snapshot(save / name) != files:
                lost_or_wrong.append(f"cycle {cycle}: committed {name} changed or vanished")
        for directory in save.glob("iter_*"):
            if directory.name <= target.name and directory.name not in committed:
                committed[directory.name] = snapshot(directory)
        expected_resume = int(target.name.split("_")[1])

    # A last run resumes from the tracker and trains to the end.
    final = launch(2, args, timeout=300).check()
    assert f"at iteration {expected_resume}" in final.log, final.log[-3000:]
    assert f"iteration {TRAIN_ITERS:8d}/{TRAIN_ITERS:8d}" in final.log
    assert tracker_dir(save).name == f"iter_{TRAIN_ITERS:07d}"
    assert not file_problems(str(tracker_dir(save)))
    for name, files in committed.items():
        assert snapshot(save / name) == files, f"committed {name} changed"
    assert not list(save.glob("_partial_*")) and not list(save.glob("_replaced_*"))
    print(f"\n[failsafe] SIGKILL: {kills} kills ({kills_mid_save} during a save), "
          f"{len(committed)} committed checkpoints checked after each, "
          f"{len(lost_or_wrong)} lost or wrong checkpoints, "
          f"{time.monotonic() - started:.0f}s")
    assert kills >= min(KILLS, 6), f"only {kills} kills happened"
    assert not lost_or_wrong, lost_or_wrong


# --------------------------------------------------------------------------------------------
# A good ETP=2 checkpoint (iterations 1 and 2) shared by the disk-full and damage tests.
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("good") / "ckpt"
    launch(2, [*COMMON, *ETP2, "--train-iters", "4", "--exit-interval", "2",
               "--save", str(save)], timeout=300).check()
    assert (save / TRACKER).read_text().strip() == "2"
    return save


def resume_args(save: Path) -> list[str]:
    return [*COMMON, *ETP2, "--train-iters", "4", "--load", str(save), "--save", str(save)]


def refusals(log: str) -> list[str]:
    # Two ranks share the pipe, so a refusal may start mid-line after another rank's output.
    marker = "pretrain_moe: error:"
    return [marker + part for line in log.splitlines() if marker in line
            for part in line.split(marker)[1:]]


def test_disk_full_during_save_keeps_previous_checkpoint(good_checkpoint, tmp_path):
    save = tmp_path / "ckpt"
    shutil.copytree(good_checkpoint, save)
    before = {d.name: snapshot(d) for d in save.glob("iter_*")}
    tracker = (save / TRACKER).read_bytes()
    limit = 1_000_000  # below one rank's .distcp file (~2.3 MB)

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    started = time.monotonic()
    run = LiveRun(resume_args(save), preexec=small_files)
    log = run.finish(240)
    assert run.proc.returncode != 0, log[-3000:]
    errors = refusals(log)
    assert errors and all(f"saving iteration 3 to {save} failed" in e for e in errors), log[-4000:]
    assert f"file-size limit {limit} bytes" in errors[0]
    assert "(file too large" in errors[0], errors[0]
    assert "Fix: raise the file-size limit (ulimit -f)" in errors[0], errors[0]
    assert "free space in" not in errors[0] and "full traceback" not in errors[0], errors[0]
    assert (save / TRACKER).read_bytes() == tracker
    assert {d.name: snapshot(d) for d in save.glob("iter_*")} == before
    assert not list(save.glob("_partial_*")), list(save.iterdir())
    print(f"\n[failsafe] disk full: 1 save refused in {time.monotonic() - started:.0f}s, "
          f"previous checkpoint and tracker unchanged")


@contextlib.contextmanager
def small_filesystem(path: Path, size: int):
    """A tmpfs of `size` bytes mounted at `path` (needs the right to mount: root here)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for a real ENOSPC: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_no_space_left_during_save_says_free_space(good_checkpoint, tmp_path):
    """A real ENOSPC: --save on a filesystem that holds the previous checkpoint and little more."""
    held = sum(p.stat().st_size for p in good_checkpoint.rglob("*") if p.is_file())
    with small_filesystem(tmp_path / "small", held + 2**20) as small:
        save = small / "ckpt"
        shutil.copytree(good_checkpoint, save)
        before = {d.name: snapshot(d) for d in save.glob("iter_*")}
        tracker = (save / TRACKER).read_bytes()
        run = LiveRun(resume_args(save))
        log = run.finish(240)
        assert run.proc.returncode != 0, log[-3000:]
        errors = refusals(log)
        assert errors and all(f"saving iteration 3 to {save} failed" in e for e in errors), log[-4000:]
        for error in errors:
            assert "(no space left on the device" in error and " MiB free there)" in error, error
            assert f"Fix: free space in (or point --save away from) {save}" in error, error
            assert "full traceback" not in error, error
        assert (save / TRACKER).read_bytes() == tracker
        assert {d.name: snapshot(d) for d in save.glob("iter_*")} == before
        assert not list(save.glob("_partial_*")), list(save.iterdir())
    print(f"\n[failsafe] no space left: {errors[0]}")


def _truncate(d: Path) -> str:
    victim = sorted(d.glob("iter_0000002/*.distcp"))[-1]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    return f"its file {victim.name} is truncated"


def _delete_distcp(d: Path) -> str:
    victim = sorted(d.glob("iter_0000002/*.distcp"))[0]
    victim.unlink()
    return f"its file {victim.name} is missing"


def _delete_metadata(d: Path) -> str:
    (d / "iter_0000002" / ".metadata").unlink()
    return ".metadata is missing"


def _empty_tracker(d: Path) -> str:
    (d / TRACKER).write_text("")  # what megatron's in-place rewrite leaves after a crash
    return "not an iteration number"


def _tracker_to_missing(d: Path) -> str:
    shutil.rmtree(d / "iter_0000002")
    return "iter_0000002: the directory does not exist"


def _damage_1836(d: Path) -> str:
    pytest.importorskip("megatron_patches.checkpointing.checkpoint_completeness_guard")
    damage = pytest.importorskip("_damage_metadata")
    damage.damage_like_1836(str(d), etp=2)
    return "decoder.layers.mlp.experts.experts.linear_fc1.weight"


DAMAGE = {
    "truncated-distcp": _truncate,
    "deleted-distcp": _delete_distcp,
    "missing-metadata": _delete_metadata,
    "empty-tracker": _empty_tracker,
    "tracker-names-missing-dir": _tracker_to_missing,
    "expert-shapes-1836": _damage_1836,
}


# As users launch: torchrun's own stop timing (tests/_ranks.py gives every rank its time).
UNDER_TORCHRUN = {"truncated-distcp", "expert-shapes-1836"}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint_is_refused_on_every_rank(damage, good_checkpoint, tmp_path):
    save = tmp_path / "ckpt"
    shutil.copytree(good_checkpoint, save)
    expected = DAMAGE[damage](save)
    started = time.monotonic()
    torchrun = damage in UNDER_TORCHRUN
    run = launch(2, resume_args(save), timeout=240, torchrun=torchrun)
    seconds = time.monotonic() - started
    (tmp_path / "run.log").write_text(run.log)
    errors = refusals(run.log)
    assert run.returncode != 0, run.log[-3000:]
    assert "successfully loaded checkpoint" not in run.log
    assert "iteration        3/" not in run.log, "trained on a damaged checkpoint"
    # Every rank refused alike: one line, rank 0's, no traceback (the #1836 guard's refusal
    # too, which reaches the entrypoint inside torch's per-rank checkpoint report).
    assert len(errors) == 1 and "[rank" not in errors[0], run.log[-4000:]
    # (torchrun prints a traceback of its own when a rank exits non-zero: not of the ranks)
    assert not re.search(r'File "[^"]*(megatron|moe_launcher|pretrain_moe)', run.log), \
        run.log[-4000:]
    if damage == "expert-shapes-1836":
        assert f"refusing to load {save}/iter_0000002" in errors[0], errors[0]
        assert f"{expected}: checkpoint global shape" in errors[0], errors[0]
    else:
        assert str(save) in errors[0] and expected in errors[0], errors[0]
    if torchrun:  # torchrun's report: the first rank to stop exited with the refusal status
        assert "exitcode  : 1" in run.log, run.log[-3000:]
    else:
        assert run.exit_codes == [1, 1], run.log[-3000:]  # each rank stopped by itself
    print(f"\n[failsafe] damage {damage}: refused on both ranks in {seconds:.0f}s")


def test_unpatched_truncated_checkpoint_fails_mid_load_naming_nothing(good_checkpoint, tmp_path):
    """The same truncated file with checkpoint-load-integrity left out (megatron-core 0.19.2 as
    shipped): torch's reader hits the end of the file inside the load, on the rank that reads
    it; every rank dies with a traceback whose error names neither the checkpoint nor the file."""
    save = tmp_path / "ckpt"
    shutil.copytree(good_checkpoint, save)
    _truncate(save)
    run = launch(2, resume_args(save), timeout=240,
                 env={"MEGATRON_PATCHES_DISABLE": "checkpoint-load-integrity"})
    (tmp_path / "run.log").write_text(run.log)
    assert "checkpoint-load-integrity: skipped (disabled by MEGATRON_PATCHES_DISABLE)" in run.log
    assert run.returncode != 0 and "iteration        3/" not in run.log, run.log[-3000:]
    assert refusals(run.log) == [], run.log[-3000:]
    assert "torch.distributed.checkpoint.api.CheckpointException" in run.log, run.log[-4000:]
    errors = [line for line in run.log.splitlines()
              if re.match(r"\[rank\d\]: [\w.]*(Error|Exception)\b", line)]
    assert any(line.endswith("EOFError") for line in errors), run.log[-4000:]
    assert not [line for line in errors if str(save) in line or ".distcp" in line], errors
