"""Patch full-validation-single-set (1 rank): --full-validation with one validation set
(--valid-data-path) prints its validation loss at --eval-interval and at the end of training.

Reference: megatron's own full validation over a list of sets (--multiple-validation-sets with
the same one set), which megatron-core 0.19.2 gets right: both losses equal it as printed.
Without the patch every rank fails at the first evaluation with a TypeError.
"""

from __future__ import annotations

import re

import pytest

from _corpus import write_indexed_corpus
from _launch import TINY_MODEL, launch

pytestmark = pytest.mark.slow

NAME = "full-validation-single-set"
# " validation loss at iteration 2 | lm loss value: ..." (" validation-0 ..." for a list of sets);
# " ... on validation set |" is the evaluation at the end of training.
VALIDATION_LOSS = re.compile(
    r"^ validation(?:-0)? loss at iteration (\d+)( on validation set)? \| lm loss value: (\S+) \|",
    re.M)


def full_validation(tmp_path, *extra: str, env: dict | None = None):
    train, valid = str(tmp_path / "train_text_document"), str(tmp_path / "valid_text_document")
    if not (tmp_path / "valid_text_document.idx").exists():
        write_indexed_corpus(train, vocab=512)
        write_indexed_corpus(valid, vocab=512, documents=16)
    model = [flag for flag in TINY_MODEL if flag != "--mock-data"]
    return launch(1, [*model, "--train-data-path", train, "--valid-data-path", valid,
                      "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "2",
                      "--eval-interval", "2", "--full-validation", *extra], env=env,
                  timeout=300)


def test_one_set_reports_the_loss_of_megatrons_list_of_sets(tmp_path):
    one_set = VALIDATION_LOSS.findall(full_validation(tmp_path).check().log)
    as_a_list = full_validation(tmp_path, "--multiple-validation-sets").check()
    assert len(one_set) == 2, one_set  # at iteration 2, and at the end of training
    assert one_set == VALIDATION_LOSS.findall(as_a_list.log)


def test_without_the_patch_every_rank_fails_at_the_first_evaluation(tmp_path):
    run = full_validation(tmp_path, env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert run.returncode != 0, run.log[-3000:]
    assert "TypeError: 'int' object is not subscriptable" in run.log, run.log[-3000:]
    assert "iteration        2/" in run.log and not VALIDATION_LOSS.search(run.log)
