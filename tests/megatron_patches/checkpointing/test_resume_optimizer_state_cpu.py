"""A resume that would load optimizer state megatron-core 0.19.2 cannot load is refused by
checkpoint-load-integrity (moe_launcher/checkpoint_files/optimizer_state.py): a checkpoint saved
with --no-save-optim (torch_dist, Megatron-FSDP's fsdp_dtensor, the torch format), a checkpoint
of the distributed optimizer resumed by the plain one and the other way round (torch_dist and the
torch format), a checkpoint of a bf16 run resumed in fp32 (or the other way round; torch_dist,
fsdp_dtensor, the torch format), in fp16 by the torch format's distributed optimizer, and a
torch-format checkpoint resumed with another --optimizer.

The checkpoints are real saves, the distributed optimizer's on 2 ranks (its state is then byte
objects, not tensors). Each resume is judged in this process with megatron's own arguments for
the command line (tests/_judge.py), accepted ones too; each refused one is launched, with the
patch (one line, every rank exits non-zero, nothing written to --save) and without it
(MEGATRON_PATCHES_DISABLE, with checkpoint-load-guard): megatron's own load then fails on every
rank once the model is built, so the refusal is not a false one.

Optimizer tensors the checkpoint lacks for another reason (another --optimizer; the distributed
optimizer's buckets, keyed by dtype, from bf16 into fp16) are refused by checkpoint-load-guard on
the state dict megatron is about to load, naming the tensors and the flags changed since the
save; those resumes are launched, with the guard and without it.
"""

from __future__ import annotations

import shutil

import pytest

from _judge import checked_args
from _launch import TINY_MODEL, launch, printed_losses
from moe_launcher.checkpoint_files import optimizer_state

pytestmark = pytest.mark.slow

PATCH = "checkpoint-load-integrity"
GUARD = "checkpoint-load-guard"
BASE = [*TINY_MODEL, "--train-iters", "2"]
DISTRIBUTED = ["--use-distributed-optimizer"]
FULLY_RESHARDABLE = [*DISTRIBUTED, "--dist-ckpt-optim-fully-reshardable"]
TORCH_FORMAT = ["--ckpt-format", "torch"]
FP32 = "<fp32: without --bf16>"  # a resume's flag: TINY_MODEL trains in bf16
MEGATRON_FSDP = ["--use-megatron-fsdp", *DISTRIBUTED, "--ckpt-format", "fsdp_dtensor",
                 "--data-parallel-sharding-strategy", "optim_grads_params"]
# name: (world, flags)
SAVES = {
    "distributed": (2, DISTRIBUTED),
    "plain": (1, []),
    "no-optimizer": (1, ["--no-save-optim"]),
    "megatron-fsdp": (2, MEGATRON_FSDP),
    "megatron-fsdp-no-optimizer": (2, [*MEGATRON_FSDP, "--no-save-optim"]),
    "torch-distributed": (1, [*TORCH_FORMAT, *DISTRIBUTED]),
    "torch-plain": (1, TORCH_FORMAT),
    "torch-no-optimizer": (1, [*TORCH_FORMAT, "--no-save-optim"]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> a --save folder holding iteration 1 of a run saved with SAVES[name]."""
    folders = {}
    for name, (world, flags) in SAVES.items():
        folder = tmp_path_factory.mktemp(name)
        launch(world, [*BASE, "--exit-interval", "1", "--save", str(folder),
                       "--save-interval", "1", *flags], timeout=300).check()
        folders[name] = folder
    return folders


# name: (checkpoint, the resume's flags, what the refusal names)
REFUSED = {
    "no-optimizer-state": ("no-optimizer", [], "--no-save-optim"),
    "megatron-fsdp-no-optimizer-state": ("megatron-fsdp-no-optimizer", MEGATRON_FSDP,
                                         "--no-save-optim"),
    "distributed-into-plain": ("distributed", [], "resume with --use-distributed-optimizer"),
    "plain-into-distributed": ("plain", DISTRIBUTED, "resume without --use-distributed-optimizer"),
    "torch-no-optimizer-state": ("torch-no-optimizer", TORCH_FORMAT, "--no-save-optim"),
    "torch-distributed-into-plain": ("torch-distributed", TORCH_FORMAT,
                                     "resume with --use-distributed-optimizer"),
    "torch-plain-into-distributed": ("torch-plain", [*TORCH_FORMAT, *DISTRIBUTED],
                                     "resume without --use-distributed-optimizer"),
    "bf16-into-fp32": ("plain", [FP32], "resume in --bf16 as saved"),
    "distributed-bf16-into-fp32": ("distributed", [*DISTRIBUTED, FP32],
                                   "resume in --bf16 as saved"),
    "megatron-fsdp-bf16-into-fp32": ("megatron-fsdp", [*MEGATRON_FSDP, FP32],
                                     "resume in --bf16 as saved"),
    "torch-plain-bf16-into-fp32": ("torch-plain", [*TORCH_FORMAT, FP32],
                                   "resume in --bf16 as saved"),
    "torch-distributed-bf16-into-fp16": ("torch-distributed",
                                         [*TORCH_FORMAT, *DISTRIBUTED, FP32, "--fp16"],
                                         "resume in --bf16 as saved"),
    "torch-another-optimizer": ("torch-plain", [*TORCH_FORMAT, "--optimizer", "sgd"],
                                "resume with --optimizer adam as saved"),
}
FAILS_AT_THE_FIRST_STEP = {"torch-another-optimizer"}
ACCEPTED = {
    "distributed-as-saved": ("distributed", DISTRIBUTED),
    "distributed-fully-reshardable": ("distributed", FULLY_RESHARDABLE),
    "plain-as-saved": ("plain", []),
    "no-optimizer-weights-only": ("no-optimizer", ["--no-load-optim"]),
    "no-optimizer-finetune": ("no-optimizer", ["--finetune"]),
    "distributed-into-plain-weights-only": ("distributed", ["--no-load-optim"]),
    "torch-distributed-as-saved": ("torch-distributed", [*TORCH_FORMAT, *DISTRIBUTED]),
    "torch-plain-as-saved": ("torch-plain", TORCH_FORMAT),
    "bf16-into-fp16": ("plain", [FP32, "--fp16"]),
    "distributed-fully-reshardable-bf16-into-fp16": ("distributed",
                                                     [*FULLY_RESHARDABLE, FP32, "--fp16"]),
    "megatron-fsdp-bf16-into-fp16": ("megatron-fsdp", [*MEGATRON_FSDP, FP32, "--fp16"]),
    "torch-plain-bf16-into-fp16": ("torch-plain", [*TORCH_FORMAT, FP32, "--fp16"]),
    "torch-distributed-grads-in-fp32": ("torch-distributed",
                                        [*TORCH_FORMAT, *DISTRIBUTED,
                                         "--accumulate-allreduce-grads-in-fp32"]),
}


def resume(folder, flags: list[str], save) -> list[str]:
    """The resume's command line; FP32 among `flags` drops TINY_MODEL's --bf16."""
    argv = [*BASE, "--load", str(folder), "--save", str(save), "--save-interval", "1",
            *(flag for flag in flags if flag != FP32)]
    return [flag for flag in argv if flag != "--bf16"] if FP32 in flags else argv


def judged(world: int, folder, flags: list[str], tmp_path, monkeypatch) -> list[str]:
    args = checked_args(world, resume(folder, flags, tmp_path / "save"), monkeypatch)
    return optimizer_state.load_problems(str(folder), args.ckpt_step, args)


@pytest.mark.parametrize("case", REFUSED)
def test_a_resume_megatron_cannot_load_the_optimizer_of_is_judged_refused(case, saved, tmp_path,
                                                                          monkeypatch):
    checkpoint, flags, named = REFUSED[case]
    problems = judged(SAVES[checkpoint][0], saved[checkpoint], flags, tmp_path, monkeypatch)
    assert len(problems) == 1, f"{case}: {problems}"
    assert named in problems[0] and "fix: " in problems[0] and "--no-load-optim" in problems[0]


@pytest.mark.parametrize("case", ACCEPTED)
def test_a_resume_megatron_loads_is_judged_fine(case, saved, tmp_path, monkeypatch):
    checkpoint, flags = ACCEPTED[case]
    assert judged(SAVES[checkpoint][0], saved[checkpoint], flags, tmp_path, monkeypatch) == []


def test_a_checkpoint_it_cannot_read_is_left_to_the_load(saved, tmp_path, monkeypatch):
    """Rank 0 judges while every other rank waits for its verdict: a torch-format file cut short
    (which torch.load cannot read) must not raise there; the file checks and megatron's load
    judge it."""
    damaged = tmp_path / "damaged"
    shutil.copytree(saved["torch-no-optimizer"], damaged)
    (model_file,) = damaged.glob("iter_*/mp_rank_*/model_optim_rng.pt")
    model_file.write_bytes(model_file.read_bytes()[:100])
    args = checked_args(1, resume(damaged, TORCH_FORMAT, tmp_path / "save"), monkeypatch)
    assert optimizer_state.load_problems(str(damaged), None, args) == []


@pytest.mark.parametrize("patched", [True, False], ids=["refused", "megatron-fails-without"])
@pytest.mark.parametrize("case", REFUSED)
def test_the_launched_resume(case, patched, saved, tmp_path):
    checkpoint, flags, named = REFUSED[case]
    world = SAVES[checkpoint][0]
    # Without the check: also without checkpoint-load-guard, which refuses the distributed
    # optimizer's torch_dist state as tensors the plain one's checkpoint lacks.
    run = launch(world, resume(saved[checkpoint], flags, tmp_path / "save"),
                 env={} if patched else {"MEGATRON_PATCHES_DISABLE": f"{PATCH},{GUARD}"},
                 timeout=300)
    assert run.returncode != 0, run.log[-3000:]
    if patched:
        lines = [line for line in run.log.splitlines() if "pretrain_moe: error: " in line]
        assert len(lines) == 1 and named in lines[0], run.log[-3000:]
        assert "Traceback" not in run.log, run.log[-3000:]
        assert not (tmp_path / "save").exists()
        return
    # megatron's own load, after the model and optimizer are built, or (Adam's torch-format
    # param groups loaded into SGD's) SGD's first step: a traceback on every rank
    where = "in train_step" if case in FAILS_AT_THE_FIRST_STEP else "in load_checkpoint"
    assert where in run.log, run.log[-3000:]
    assert run.log.count("Traceback") >= world, run.log[-3000:]
    assert not printed_losses(run.log), run.log[-3000:]


# name: (checkpoint, the resume's flags, what the refusal names), refused by
# checkpoint-load-guard: optimizer tensors the checkpoint lacks
ABSENT = {
    "another-optimizer": ("plain", ["--optimizer", "sgd"], "--optimizer adam -> sgd"),
    # dp_reshardable buckets are keyed by dtype
    "distributed-bf16-into-fp16": ("distributed", [*DISTRIBUTED, FP32, "--fp16"],
                                   "--bf16 True -> False, --fp16 False -> True"),
}


@pytest.mark.parametrize("patched", [True, False], ids=["refused", "megatron-fails-without"])
@pytest.mark.parametrize("case", ABSENT)
def test_a_resume_whose_optimizer_tensors_the_checkpoint_lacks(case, patched, saved, tmp_path):
    checkpoint, flags, named = ABSENT[case]
    world = SAVES[checkpoint][0]
    run = launch(world, resume(saved[checkpoint], flags, tmp_path / "save"),
                 env={} if patched else {"MEGATRON_PATCHES_DISABLE": GUARD}, timeout=300)
    assert run.returncode != 0, run.log[-3000:]
    if patched:
        lines = [line for line in run.log.splitlines() if "pretrain_moe: error: " in line]
        assert len(lines) == 1 and named in lines[0] and "--no-load-optim" in lines[0], lines
        assert "optimizer.state." in lines[0] or "optimizer.distributed." in lines[0], lines[0]
        assert "Traceback" not in run.log, run.log[-3000:]
        return
    # megatron-core 0.19.2's torch_dist load: torch's planner misses the tensor on every rank
    assert run.log.count("from model not in state dict") >= world, run.log[-3000:]
