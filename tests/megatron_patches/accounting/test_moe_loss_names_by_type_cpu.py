"""moe-loss-names-by-type: a run with DeepSeek's sequence-wise balance loss (seq_aux_loss, the
DeepSeek and Moonlight recipes' type) logs that loss only. megatron-core 0.19.2's training_log
tests `"aux_loss" in` the type string, so without the patch it also reports a
`load_balancing_loss` no router records: 0 on every log line and a series of zeros in
TensorBoard (what wandb gets too). The reference is what the routers record: the sequence-wise
loss, the same with and without the patch; and an aux_loss run keeps its load_balancing_loss."""

from __future__ import annotations

import re

from _launch import TINY_MODEL, launch, tensorboard_scalars

NAME = "moe-loss-names-by-type"
SEQ_AUX = [*TINY_MODEL, "--moe-router-load-balancing-type", "seq_aux_loss", "--train-iters", "2"]


def _logged(log: str, name: str) -> list[str]:
    return re.findall(rf"\| {name}: ([0-9.E+-]+)", log)


def test_a_sequence_wise_loss_run_logs_no_load_balancing_loss_of_zero(tmp_path):
    patched = launch(1, [*SEQ_AUX, "--tensorboard-dir", str(tmp_path / "patched")]).check()
    assert f"[megatron_patches] {NAME}: applied" in patched.log
    unpatched = launch(1, [*SEQ_AUX, "--tensorboard-dir", str(tmp_path / "unpatched")],
                       env={"MEGATRON_PATCHES_DISABLE": NAME}).check()

    assert _logged(unpatched.log, "load_balancing_loss") == ["0.000000E+00"] * 2
    assert tensorboard_scalars(tmp_path / "unpatched", "load_balancing_loss") == {1: 0.0, 2: 0.0}
    assert _logged(patched.log, "load_balancing_loss") == []
    assert tensorboard_scalars(tmp_path / "patched", "load_balancing_loss") == {}
    # what the routers record is logged alike
    seq = _logged(patched.log, "seq_load_balancing_loss")
    assert len(seq) == 2 and seq == _logged(unpatched.log, "seq_load_balancing_loss")
    assert tensorboard_scalars(tmp_path / "patched", "seq_load_balancing_loss") == \
        tensorboard_scalars(tmp_path / "unpatched", "seq_load_balancing_loss")

    aux = launch(1, [*TINY_MODEL, "--train-iters", "2"]).check()  # aux_loss: TINY_MODEL's type
    assert len(_logged(aux.log, "load_balancing_loss")) == 2
    assert all(float(value) > 0 for value in _logged(aux.log, "load_balancing_loss"))
