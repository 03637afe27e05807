"""torch-format-shard-guard (NVIDIA/Megatron-LM#1719): `--ckpt-format torch` names a rank's file
by its TP, PP and EP ranks only, so with expert tensor parallelism other than TP two ranks
holding different halves of every expert write one file.

* Without the patch (MEGATRON_PATCHES_DISABLE), the reference being megatron-core 0.19.2's own
  behaviour: ETP 2 on 2 ranks saves one model file, and the run resumed from it trains other
  losses than the uninterrupted run.
* With it: that run, and EP2 x ETP2 on 4 ranks, are refused on every rank before anything is
  written, rank 0 saying why in one line; the damaged checkpoint the unpatched run saved is
  refused at --load, judged from the layout saved in it. The torch-format layouts it must not refuse resume
  bit-exactly in tests/test_train_resume_cpu.py (torch-tp2-etp1-ep2, torch-ep2).
"""

from __future__ import annotations

import subprocess
import sys

from _launch import REPO, TINY_MODEL, launch, tensorboard_scalars

TORCH_FORMAT = [*TINY_MODEL, "--ckpt-format", "torch"]
ETP2 = ["--expert-tensor-parallel-size", "2"]
UNPATCHED = {"MEGATRON_PATCHES_DISABLE": "torch-format-shard-guard"}


def test_unpatched_etp2_torch_checkpoint_loses_half_of_every_expert(tmp_path):
    save, full_tb, resumed_tb = tmp_path / "ckpt", tmp_path / "tb_full", tmp_path / "tb_resumed"
    args = [*TORCH_FORMAT, *ETP2, "--train-iters", "4", "--save-interval", "2"]
    full = launch(2, [*args, "--save", str(save), "--tensorboard-dir", str(full_tb)],
                  env=UNPATCHED).check()
    assert "torch-format-shard-guard: skipped (disabled" in full.log
    # Two ranks, each with its half of every expert, and one file for both.
    files = sorted(p.relative_to(save).as_posix() for p in (save / "iter_0000002").rglob("*.pt"))
    assert [f for f in files if f.endswith("model_optim_rng.pt")] == [
        "iter_0000002/mp_rank_00/model_optim_rng.pt"], files
    # The audit CLI reads the format: the layout saved, the file both ranks wrote, the loss.
    audited = subprocess.run([sys.executable, "-m", "megatron_patches.checkpoint_audit",
                              str(save)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert audited.returncode == 1, audited.stdout + audited.stderr
    assert "layout saved: 2 ranks, TP 1, PP 1, CP 1, EP 1, expert TP 2" in audited.stdout
    assert "mp_rank_00/model_optim_rng.pt: " in audited.stdout
    assert "written by ranks [0, 1]" in audited.stdout and "DAMAGED" in audited.stdout
    assert "NVIDIA/Megatron-LM#1719" in audited.stdout, audited.stdout
    # The resume at megatron's default --ckpt-format (torch_dist): megatron reads the torch-format
    # file all the same, without a word.
    launch(2, [*TINY_MODEL, *ETP2, "--train-iters", "4", "--load", str(save), "--ckpt-step", "2",
               "--tensorboard-dir", str(resumed_tb)], env=UNPATCHED).check()
    uninterrupted = tensorboard_scalars(full_tb, "lm loss")
    resumed = tensorboard_scalars(resumed_tb, "lm loss")
    assert sorted(resumed) == [3, 4]
    assert all(resumed[i] != uninterrupted[i] for i in (3, 4)), (resumed, uninterrupted)

    # The same load with the patch: refused from the layout saved in the checkpoint, on every
    # rank, before any iteration.
    loaded = launch(2, [*TINY_MODEL, *ETP2, "--train-iters", "4", "--load", str(save),
                        "--ckpt-step", "2"])
    errors = [line for line in loaded.log.splitlines() if line.startswith("pretrain_moe: error:")]
    assert loaded.exit_codes == [2, 2] and len(errors) == 1, loaded.log[-3000:]
    assert f"--load {save}/iter_0000002: it was saved in --ckpt-format torch at TP 1, expert TP " \
           "2 on 2 ranks: ranks [0, 1] held different pieces" in errors[0], errors
    assert "NVIDIA/Megatron-LM#1719" in errors[0] and "fix: resume from" in errors[0]
    assert "iteration        3/" not in loaded.log and "Traceback" not in loaded.log
    # So is megatron's conversion of it to torch_dist, before it writes anything.
    converted = tmp_path / "converted"
    conversion = launch(2, [*args, "--load", str(save), "--ckpt-step", "2",
                            "--ckpt-convert-format", "torch_dist",
                            "--ckpt-convert-save", str(converted)])
    errors = [line for line in conversion.log.splitlines()
              if line.startswith("pretrain_moe: error:")]
    assert conversion.exit_codes == [2, 2] and len(errors) == 1, conversion.log[-3000:]
    assert "held different pieces" in errors[0] and not converted.exists(), errors


def assert_refused(run, world: int, save) -> None:
    errors = [line for line in run.log.splitlines() if line.startswith("pretrain_moe: error:")]
    assert run.exit_codes == [2] * world, run.log[-3000:]
    assert len(errors) == 1, errors
    assert "NVIDIA/Megatron-LM#1719" in errors[0] and "fix: --ckpt-format torch_dist" in errors[0]
    assert "iteration        1/" not in run.log and "Traceback" not in run.log
    assert not save.exists(), sorted(save.rglob("*"))


def test_etp_other_than_tp_is_refused_before_anything_is_written(tmp_path):
    save = tmp_path / "ckpt"
    run = launch(2, [*TORCH_FORMAT, *ETP2, "--train-iters", "2", "--save", str(save),
                     "--save-interval", "2"])
    assert_refused(run, 2, save)
    assert "ranks [0, 1] hold different pieces" in run.log
    four = launch(4, [*TORCH_FORMAT, *ETP2, "--expert-model-parallel-size", "2",
                      "--use-distributed-optimizer", "--train-iters", "2", "--save", str(save),
                      "--save-interval", "2"])
    assert_refused(four, 4, save)
