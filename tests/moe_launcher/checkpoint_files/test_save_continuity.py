"""A --save that holds a committed checkpoint is for the run that continues it (issue 47): each
command line judged by the launcher's checks before work (tests/_judge.py), and what is moved
aside for a run that starts over or rolls back. Real runs under torchrun:
tests/megatron_patches/checkpointing/test_save_continuity_cpu.py."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from _judge import judge
from _launch import TINY_MODEL
from moe_launcher.checkpoint_files import save_continuity
from moe_launcher.checkpoint_files.commit_protocol import TRACKER, write_tracker

BASE = [*TINY_MODEL, "--train-iters", "4", "--save-interval", "2"]


def saved_run(save: Path, iterations=(2, 4)) -> dict[str, bytes]:
    """A --save as a finished run leaves it (the folders' contents do not matter here); returns
    every file's bytes."""
    for iteration in iterations:
        folder = save / f"iter_{iteration:07d}"
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(os.urandom(64))
    write_tracker(str(save), str(iterations[-1]))
    return files(save)


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("case", ["no-load", "load-elsewhere", "finetune-in-place"])
def test_a_run_that_does_not_continue_a_saved_run_is_refused(case, tmp_path, monkeypatch):
    save, other = tmp_path / "ckpt", tmp_path / "other"
    before = saved_run(save)
    saved_run(other)
    extra = {"no-load": [], "load-elsewhere": ["--load", str(other)],
             "finetune-in-place": ["--load", str(save), "--finetune"]}[case]
    line = judge(1, [*BASE, "--save", str(save), *extra], monkeypatch)
    assert line and line.startswith("pretrain_moe: error: ") and "\n" not in line, line
    assert f"--save {save} holds another run's checkpoints (latest iter_0000004" in line, line
    assert f"fix: --load {save}" in line and save_continuity.START_OVER_ENV in line, line
    reason = {"no-load": "it has no --load", "load-elsewhere": f"its --load is {other}",
              "finetune-in-place": "--finetune starts the iteration count over"}[case]
    assert reason in line, line
    assert files(save) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "other"]


def test_runs_that_continue_or_write_nothing_there_go_on(tmp_path, monkeypatch):
    save, other, empty = tmp_path / "ckpt", tmp_path / "other", tmp_path / "empty"
    saved_run(save)
    saved_run(other)
    empty.mkdir()
    for argv in ([*BASE, "--save", str(save), "--load", str(save)],          # a resume, a requeue
                 [*BASE, "--save", str(save), "--load", str(save), "--ckpt-step", "2"],  # rollback
                 [*BASE, "--save", str(empty), "--load", str(other), "--finetune"],  # fine-tune
                 [*BASE, "--save", str(tmp_path / "new"), "--load", str(other)],
                 [*BASE, "--load", str(save)],                              # writes nothing
                 [*BASE, "--save", str(save), "--load", str(other), "--skip-train"]):  # an eval
        assert judge(1, argv, monkeypatch) is None, argv
    monkeypatch.setenv(save_continuity.START_OVER_ENV, "1")
    assert judge(1, [*BASE, "--save", str(save)], monkeypatch) is None


def args(**values) -> argparse.Namespace:
    return argparse.Namespace(**{"save": None, "load": None, "finetune": False,
                                 "ckpt_step": None, **values})


def test_starting_over_moves_every_folder_and_the_tracker_aside_byte_for_byte(tmp_path):
    save = tmp_path / "ckpt"
    before = saved_run(save)
    use = save_continuity.save_use(args(save=str(save)))
    line = save_continuity.set_aside(use)
    aside = [p for p in save.iterdir() if p.name.startswith(save_continuity.SET_ASIDE_PREFIX)]
    assert len(aside) == 1 and sorted(p.name for p in save.iterdir()) == [aside[0].name]
    assert files(aside[0]) == before
    assert "iter_0000002, iter_0000004" in line and str(aside[0]) in line, line


def test_a_rollback_keeps_the_later_iterations_aside_and_names_its_own_in_the_tracker(tmp_path):
    save = tmp_path / "ckpt"
    before = saved_run(save, iterations=(2, 4, 6))
    use = save_continuity.save_use(args(save=str(save), load=str(save), ckpt_step=2))
    assert use.continues and use.replaced == ("iter_0000004", "iter_0000006")
    line = save_continuity.set_aside(use)
    assert (save / TRACKER).read_text() == "2"
    (aside,) = [p for p in save.iterdir() if p.name.startswith(save_continuity.SET_ASIDE_PREFIX)]
    assert sorted(p.name for p in save.iterdir()) == sorted([aside.name, "iter_0000002", TRACKER])
    kept = files(aside)
    assert kept.pop(TRACKER) == b"6"
    assert kept == {name: data for name, data in before.items()
                    if name.startswith(("iter_0000004", "iter_0000006"))}
    assert "--ckpt-step 2 rolls back from iter_0000006" in line, line
    # a resume without --ckpt-step, or one at the latest iteration, moves nothing
    assert save_continuity.save_use(args(save=str(save), load=str(save))).replaced == ()


def test_what_is_set_aside_goes_only_when_asked(tmp_path):
    save = tmp_path / "ckpt"
    saved_run(save, iterations=(2, 4))
    use = save_continuity.save_use(args(save=str(save), load=str(save), ckpt_step=2))
    line = save_continuity.set_aside(use, environ={save_continuity.DROP_REPLACED_ENV: "1"})
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", TRACKER]
    assert line.startswith("deleted iter_0000004") and save_continuity.DROP_REPLACED_ENV in line
