"""megatron's loss checks run on the project's loss: a loss that turns NaN stops the run through
megatron's rerun state machine (--check-for-nan-in-loss-and-grad is on by default)."""

import pytest

from _launch import REPO, TINY_MODEL, launch, tensorboard_scalars


@pytest.mark.slow
def test_nan_loss_stops_the_run_with_megatrons_message(tmp_path):
    run = launch(1, [*TINY_MODEL, "--train-iters", "4", "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "100", "--tensorboard-dir", str(tmp_path / "tb")],
                 script=REPO / "tests" / "_nan_loss_entry.py")
    assert run.returncode != 0, f"trained on with a NaN loss:\n{run.log[-3000:]}"
    assert "Unexpected result nan" in run.log, run.log[-3000:]
    assert "found NaN in local forward loss calculation" in run.log, run.log[-3000:]
    logged = tensorboard_scalars(tmp_path / "tb", "lm loss")
    assert 4 not in logged, f"iterations logged after the NaN: {sorted(logged)}"
