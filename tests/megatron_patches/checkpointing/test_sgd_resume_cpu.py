"""Patch sgd-resume-state (issue 43 item 3): `--optimizer sgd` with momentum saves in torch_dist
and resumes with the uninterrupted run's losses, momentum included. Without the patch every rank
dies at the load (megatron's SGD has no state function: `'NoneType' object is not callable`)."""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, tensorboard_scalars

pytestmark = pytest.mark.slow

NAME = "sgd-resume-state"
K = 2
SGD = [*TINY_MODEL, "--optimizer", "sgd", "--sgd-momentum", "0.9", "--train-iters", str(2 * K),
       "--save-interval", str(K), "--ckpt-format", "torch_dist"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("sgd")
    launch(1, [*SGD, "--save", str(root / "ckpt"), "--tensorboard-dir", str(root / "tb")]).check()
    return root


def resumed(uninterrupted, tmp_path, env=None):
    return launch(1, [*SGD, "--load", str(uninterrupted / "ckpt"), "--ckpt-step", str(K),
                      "--tensorboard-dir", str(tmp_path / "tb")], env=env)


def test_sgd_resumes_with_the_uninterrupted_losses(uninterrupted, tmp_path):
    resumed(uninterrupted, tmp_path).check()
    before = tensorboard_scalars(uninterrupted / "tb", "lm loss")
    after = tensorboard_scalars(tmp_path / "tb", "lm loss")
    assert sorted(after) == list(range(K + 1, 2 * K + 1))
    assert after == {i: before[i] for i in after}


def test_unpatched_sgd_cannot_resume(uninterrupted, tmp_path):
    run = resumed(uninterrupted, tmp_path, env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert run.returncode != 0
    assert "'NoneType' object is not callable" in run.log, run.log[-3000:]
