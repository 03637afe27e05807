"""megatron's loss checks run on the project's loss: a loss that turns NaN or Inf stops the run
through megatron's rerun state machine (--check-for-nan-in-loss-and-grad is on by default).
The spiky-loss check (--check-for-spiky-loss) goes through the same call and judges a loss only
after megatron has seen 100 of them (rerun_state_machine.is_unexpectedly_large)."""

import pytest

from _launch import REPO, TINY_MODEL, launch, tensorboard_scalars


@pytest.mark.slow
@pytest.mark.parametrize("bad, name", [("nan", "NaN"), ("inf", "Inf")])
def test_a_nan_or_inf_loss_stops_the_run_with_megatrons_message(bad, name, tmp_path):
    run = launch(1, [*TINY_MODEL, "--train-iters", "4", "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "100", "--tensorboard-dir", str(tmp_path / "tb")],
                 script=REPO / "tests" / "_bad_loss_entry.py", env={"BAD_LOSS": bad})
    assert run.returncode != 0, f"trained on with a {name} loss:\n{run.log[-3000:]}"
    assert f"Unexpected result {bad}" in run.log, run.log[-3000:]
    assert f"found {name} in local forward loss calculation" in run.log, run.log[-3000:]
    logged = tensorboard_scalars(tmp_path / "tb", "lm loss")
    assert 4 not in logged, f"iterations logged after the {name}: {sorted(logged)}"
