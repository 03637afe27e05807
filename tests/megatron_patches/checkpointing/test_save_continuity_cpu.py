"""A fresh run into a --save that holds another run's checkpoints (issue 47), under torchrun as
users launch it: refused on every rank before any work, the other run's bytes untouched; the
opt-in to start over and a deliberate rollback move what they would replace aside, byte for byte,
and train (forked ranks: what they judge is the command line and the folder, not the launch). (megatron-core alone replaces the other run's iterations and moves its tracker back,
rc 0, without a word: the reproduction in the issue.) The command-line cases are judged in-process
in tests/moe_launcher/checkpoint_files/test_save_continuity.py.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from _launch import TINY_MODEL, launch
from moe_launcher.checkpoint_files.commit_protocol import TRACKER
from moe_launcher.checkpoint_files.file_checks import file_problems
from moe_launcher.checkpoint_files.save_continuity import SET_ASIDE_PREFIX, START_OVER_ENV
from moe_launcher.checkpoint_files.writer_claim import WRITER_LOCK

pytestmark = pytest.mark.slow

ARGS = [*TINY_MODEL, "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
        "--save-interval", "2"]


def files(folder: Path) -> dict[str, bytes]:
    """Every checkpoint file's bytes (the writer record changes hands, by design)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != WRITER_LOCK}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """Run A: 2 ranks, iterations 2 and 4 saved."""
    save = tmp_path_factory.mktemp("first") / "ckpt"
    launch(2, [*ARGS, "--train-iters", "4", "--save", str(save)]).check()
    return save


@pytest.fixture
def saved(first_run, tmp_path) -> tuple[Path, dict[str, bytes]]:
    save = tmp_path / "ckpt"
    shutil.copytree(first_run, save)
    return save, files(save)


def set_aside(save: Path) -> Path:
    (aside,) = [p for p in save.iterdir() if p.name.startswith(SET_ASIDE_PREFIX)]
    return aside


def test_a_fresh_run_is_refused_on_every_rank_and_the_saved_run_keeps_its_bytes(saved):
    save, before = saved
    run = launch(2, [*ARGS, "--train-iters", "4", "--seed", "99", "--save", str(save)],
                 torchrun=True, timeout=180)
    errors = [line for line in run.log.splitlines() if line.startswith("pretrain_moe: error:")]
    assert run.returncode != 0 and len(errors) == 1, run.log[-3000:]
    assert f"--save {save} holds another run's checkpoints (latest iter_0000004" in errors[0]
    assert "exitcode  : 2" in run.log and 'pretrain_moe.py", line' not in run.log, run.log[-3000:]
    assert not re.search(r"iteration\s+\d+/\s*\d+ \|", run.log)  # refused before any work
    assert files(save) == before


def test_starting_over_keeps_the_saved_run_aside_and_trains(saved):
    save, before = saved
    run = launch(2, [*ARGS, "--train-iters", "2", "--seed", "99", "--save", str(save)],
                 env={START_OVER_ENV: "1"}, timeout=300).check()
    aside = set_aside(save)
    assert files(aside) == before  # the tracker (4) and both iterations, byte for byte
    assert f"moved iter_0000002, iter_0000004 aside into {aside}" in run.log, run.log[-3000:]
    assert (save / TRACKER).read_text() == "2" and file_problems(str(save / "iter_0000002")) == []
    assert not (save / "iter_0000004").exists()


def test_a_rollback_keeps_the_later_iteration_aside_and_resumes_from_its_step(saved):
    save, before = saved
    run = launch(2, [*ARGS, "--train-iters", "4", "--save", str(save), "--load", str(save),
                     "--ckpt-step", "2"], timeout=300).check()
    aside = set_aside(save)
    kept = files(aside)
    assert kept.pop(TRACKER) == b"4"
    assert kept == {name: data for name, data in before.items()
                    if name.startswith("iter_0000004")}
    assert "at iteration 2" in run.log and "--ckpt-step 2 rolls back" in run.log, run.log[-3000:]
    assert (save / TRACKER).read_text() == "4"  # this run's own iteration 4
    assert file_problems(str(save / "iter_0000004")) == []
    assert files(save / "iter_0000002") == {
        name.removeprefix("iter_0000002/"): data for name, data in before.items()
        if name.startswith("iter_0000002/")}


def test_a_resume_and_a_fine_tune_elsewhere_go_on_and_touch_none_of_the_saved_files(saved,
                                                                                  tmp_path):
    """No false refusal: the run that continues its --save (with retention: it drops only its
    own iteration 6, never the saved run's 2), a fine-tune of it into a new --save, and an
    evaluation of that fine-tune whose command line names the saved run's --save (megatron
    writes nothing with --skip-train)."""
    save, before = saved
    run = launch(2, [*ARGS, "--train-iters", "8", "--override-opt_param-scheduler",
                     "--save-retain-interval", "4", "--save", str(save), "--load", str(save)],
                 timeout=300).check()
    assert "at iteration 4" in run.log, run.log[-3000:]
    saved_iterations = {name: data for name, data in before.items() if name.startswith("iter_")}
    assert {name: files(save).get(name) for name in saved_iterations} == saved_iterations
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000002", "iter_0000004", "iter_0000008"]  # 6 was this run's, dropped at 8
    tuned = tmp_path / "tuned"
    launch(2, [*ARGS, "--train-iters", "2", "--finetune", "--load", str(save), "--ckpt-step",
               "4", "--save", str(tuned)], timeout=300).check()
    assert (tuned / TRACKER).read_text() == "2" and not list(tuned.glob(SET_ASIDE_PREFIX + "*"))
    resumed = files(save)
    evaluation = launch(2, [*ARGS, "--train-iters", "2", "--skip-train", "--eval-iters", "1",
                            "--load", str(tuned), "--save", str(save)],
                        timeout=300).check()
    assert re.search(r"validation loss at iteration 2 .*lm loss value", evaluation.log), \
        evaluation.log[-3000:]
    assert files(save) == resumed
