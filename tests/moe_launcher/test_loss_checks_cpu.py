"""megatron's loss checks run on the project's loss: a loss that turns NaN or Inf stops the run
through megatron's rerun state machine (--check-for-nan-in-loss-and-grad is on by default).
The spiky-loss check (--check-for-spiky-loss) goes through the same call and judges a loss only
after megatron has seen 100 of them (rerun_state_machine.is_unexpectedly_large, one per
micro-batch from the second iteration on); a spike is not fatal: megatron reruns the step, finds
it reproducible and trains on (its validate_result with fatal=False)."""

import re

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


# 4 micro-batches an iteration: iterations 2-26 give megatron its 100 samples, 28 is judged.
SPIKE_AT, SPIKE_ITERS = 28, 30


@pytest.mark.slow
@pytest.mark.parametrize("checked", [True, False], ids=["check-for-spiky-loss", "unchecked"])
def test_a_spiky_loss_is_flagged_and_rerun_and_training_goes_on(checked, tmp_path):
    flags = [*TINY_MODEL, "--train-iters", str(SPIKE_ITERS), "--tensorboard-dir",
             str(tmp_path / "tb"), *(["--check-for-spiky-loss"] if checked else [])]
    # +100 on every token loss (about 6 each): a loss sum ~17x the largest of the 100 before
    run = launch(1, flags, script=REPO / "tests" / "_bad_loss_entry.py",
                 env={"BAD_LOSS": "100", "BAD_LOSS_AT": str(SPIKE_AT)}).check()
    flagged = re.findall(r"Unexpected result .* at iteration #(\d+) .*\(message='Spiky loss'\)",
                         run.log)
    reproduced = "First rerun: unexpected result is reproducible within the tolerance" in run.log
    if checked:
        # megatron 0.19.2's message names the iteration after the one it judged (its rerun state
        # machine has already counted the running iteration and prints that count + 1)
        assert flagged and set(flagged) == {str(SPIKE_AT + 1)}, run.log[-4000:]
        assert reproduced, run.log[-4000:]
    else:
        assert not flagged and not reproduced, run.log[-4000:]
    logged = tensorboard_scalars(tmp_path / "tb", "lm loss")
    assert sorted(logged) == list(range(1, SPIKE_ITERS + 1))  # trained on, every iteration
    assert logged[SPIKE_AT] > 100 > max(v for i, v in logged.items() if i != SPIKE_AT)



def _spiked_run(tmp_path, name: str, spike: str, env: dict | None = None) -> dict:
    """TINY_MODEL with expert bias and the spiky-loss check; `spike` added to every token loss
    at SPIKE_AT ("0": no spike, no rerun). Returns the tensorboard scalars by tag."""
    board = tmp_path / name
    flags = [*TINY_MODEL, "--train-iters", str(SPIKE_ITERS), "--tensorboard-dir", str(board),
             "--check-for-spiky-loss", "--moe-router-enable-expert-bias",
             "--moe-router-score-function", "sigmoid"]
    launch(1, flags, script=REPO / "tests" / "_bad_loss_entry.py",
           env={"BAD_LOSS": spike, "BAD_LOSS_AT": str(SPIKE_AT), **(env or {})}).check()
    return {tag: tensorboard_scalars(board, tag) for tag in
            ("lm loss", "load_balancing_loss", "expert_load/tokens_mean/layer_1")}


@pytest.mark.slow
def test_a_rerun_step_trains_and_logs_as_the_step_itself(tmp_path):
    """rerun-restores-moe-step-state (and expert-load-metrics counting a step once). The
    reference is the same run without the spike, where megatron reruns nothing: the spike adds a
    constant to every token loss, so the step's gradients are the true loss's. Patched, after
    megatron's in-place rerun of iteration 28 the run trains on exactly as the reference, and
    iteration 28 logs the reference's load-balancing loss and expert load. Unpatched, the first
    run's finalize has already moved the expert bias, so the rerun routes with another bias and
    the step moves it twice (iterations 29-30 differ), and megatron's MoE tracker logs both runs'
    load-balancing loss."""
    reference = _spiked_run(tmp_path, "reference", "0")
    patched = _spiked_run(tmp_path, "patched", "100")
    unpatched = _spiked_run(tmp_path, "unpatched", "100",
                            env={"MEGATRON_PATCHES_DISABLE": "rerun-restores-moe-step-state"})
    after = range(SPIKE_AT + 1, SPIKE_ITERS + 1)
    assert all(patched["lm loss"][i] == reference["lm loss"][i] for i in after)
    assert all(unpatched["lm loss"][i] != reference["lm loss"][i] for i in after)
    balance = "load_balancing_loss"
    assert patched[balance][SPIKE_AT] == reference[balance][SPIKE_AT] > 0
    assert unpatched[balance][SPIKE_AT] == pytest.approx(2 * reference[balance][SPIKE_AT],
                                                         rel=1e-2)
    load = "expert_load/tokens_mean/layer_1"  # 8 sequences x 64 tokens x top-2 over 8 experts
    assert patched[load][SPIKE_AT] == unpatched[load][SPIKE_AT] == reference[load][SPIKE_AT] == 128
