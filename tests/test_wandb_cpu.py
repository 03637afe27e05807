"""--wandb-project logs loss and throughput (wandb in offline mode, real run files on disk)."""

import glob

from _launch import TINY_MODEL, launch
from _wandb_records import history


def test_wandb_offline_run_holds_loss_and_throughput(tmp_path):
    run = launch(1, [*TINY_MODEL, "--train-iters", "3", "--wandb-project", "moe-tests",
                     "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wandb")],
                 env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}).check()

    runs = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, f"no offline wandb run under {tmp_path}:\n{run.log[-3000:]}"
    rows = history(runs[0])
    losses = {row["_step"]: row["lm loss"] for row in rows if "lm loss" in row}
    throughputs = {row["_step"]: row["throughput"] for row in rows if "throughput" in row}
    assert sorted(losses) == [1, 2, 3] and sorted(throughputs) == [1, 2, 3]
    assert all(0 < loss < 10 for loss in losses.values())
    assert all(value >= 0 for value in throughputs.values())
    # The loss wandb holds is the one megatron printed for that iteration.
    assert f"lm loss: {losses[1]:E}" in run.log
