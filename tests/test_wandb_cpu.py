"""--wandb-project logs loss and throughput (wandb in offline mode, real run files on disk)."""

import glob
import json

from _launch import TINY_MODEL, launch


def test_wandb_offline_run_holds_loss_and_throughput(tmp_path):
    run = launch(1, [*TINY_MODEL, "--train-iters", "3", "--wandb-project", "moe-tests",
                     "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wandb")],
                 env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}).check()
    assert "default --tensorboard-dir" in run.log  # wandb scalars flow through that writer

    summaries = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "files" /
                              "wandb-summary.json"))
    assert len(summaries) == 1, f"no offline wandb run under {tmp_path}:\n{run.log[-3000:]}"
    summary = json.loads(open(summaries[0]).read())
    assert summary["_step"] == 3
    assert 0 < summary["lm loss"] < 10
    assert summary["throughput"] >= 0
    assert "load_balancing_loss" in summary
