"""--dist-ckpt-optim-fully-reshardable checkpoints of the distributed optimizer (torch Adam):
the resume in the same layout matches the uninterrupted run bit for bit, and a load in another
DP/TP layout holds, element by element, the optimizer state saved.

Several gradient buckets with bucket-end padding (--overlap-grad-reduce and a small
--ddp-bucket-size) are what NVIDIA/Megatron-LM#5077 needs to show: megatron-core 0.19.2 saves
every parameter after the first padded bucket end from a shifted offset (patch
distopt-reshardable-bucket-offsets). Without Transformer Engine / apex the load itself fails
with KeyError: 'step' (patch distopt-torch-adam-resume).
"""

import re
from pathlib import Path

import pytest
import torch

from _launch import TINY_MODEL, launch, tensorboard_scalars

REPO = Path(__file__).resolve().parents[3]
OBSERVED = REPO / "tests" / "_observed_launch.py"
NPROC = 2
K = 1  # iterations before the checkpoint; the runs go to 2K
# megatron uses --ddp-bucket-size only with --overlap-grad-reduce (one bucket otherwise); 10k
# elements make 20 buckets of the tiny model, ends padded to multiples of 128 (4 of them padded
# before another bucket, which is where #5077 shifts the offsets).
COMMON = [*TINY_MODEL, "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
          "--dist-ckpt-optim-fully-reshardable", "--overlap-grad-reduce",
          "--ddp-bucket-size", "10000", "--train-iters", str(2 * K)]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _model_space(directory: Path, kind: str) -> dict[str, dict]:
    """Every parameter's whole (TP-unsplit) main param and Adam moments, from all ranks'
    model-space snapshots; asserts each element is held by exactly one rank of its TP slice."""
    pieces: dict[str, dict[int, tuple]] = {}
    for rank in range(NPROC):
        for name, held in torch.load(directory / f"model_{kind}_rank{rank}.pt").items():
            slot = pieces.setdefault(name, {})
            local_numel = torch.Size(held["local_shape"]).numel()
            if held["tp_rank"] not in slot:
                slot[held["tp_rank"]] = (held, {key: torch.full((local_numel,), float("nan"))
                                                for key in held["state"]},
                                         torch.zeros(local_numel, dtype=torch.int32))
            _, flat, count = slot[held["tp_rank"]]
            for key, value in held["state"].items():
                flat[key][held["start"]:held["end"]] = value.float()
            count[held["start"]:held["end"]] += 1
    whole = {}
    for name, slot in pieces.items():
        tp_ranks = sorted(slot)
        first = slot[tp_ranks[0]][0]
        for _, _, count in slot.values():
            assert torch.all(count == 1), f"{kind}: {name} held by {count.unique().tolist()} ranks"
        dim = first["partition_dim"]
        whole[name] = {}
        for key in first["state"]:
            parts = [slot[r][1][key].reshape(first["local_shape"]) for r in tp_ranks]
            if dim is None:  # a copy on every TP rank
                assert all(torch.equal(parts[0], part) for part in parts), f"{kind}: {name}"
                whole[name][key] = parts[0]
            elif "linear_fc1.weight" in name:  # TINY_MODEL is --swiglu
                # A TP rank holds [gate_r; up_r]: the whole matrix is [gate_0..; up_0..].
                halves = [part.chunk(2, dim=dim) for part in parts]
                whole[name][key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
            else:
                whole[name][key] = torch.cat(parts, dim)
    return whole


def _assert_equal_state(saved: dict, loaded: dict, what: str) -> None:
    assert saved.keys() == loaded.keys(), f"{what}: different parameters"
    for name in saved:
        assert saved[name].keys() == loaded[name].keys(), f"{what}: {name}: different state"
        for key, value in saved[name].items():
            assert torch.equal(value, loaded[name][key]), (
                f"{what}: {name} {key} differs at "
                f"{(value != loaded[name][key]).nonzero()[:3].tolist()}")


@pytest.mark.slow
def test_fully_reshardable_resume_same_and_other_layout(tmp_path):
    for directory in ("full", "same", "tp2"):
        (tmp_path / "snap" / directory).mkdir(parents=True)
    ckpt = tmp_path / "ckpt"
    full = launch(NPROC, [*COMMON, "--save", str(ckpt), "--save-interval", str(K),
                          "--tensorboard-dir", str(tmp_path / "tb_full")],
                  env={"SNAPSHOT_DIR": str(tmp_path / "snap" / "full")}, script=OBSERVED).check()
    assert "distopt-reshardable-bucket-offsets: applied" in full.log
    assert _padded_bucket_ends_before_another(full.log) > 1, full.log[-3000:]  # #5077's case
    saved = _model_space(tmp_path / "snap" / "full", f"save{K}")
    # Every parameter has trained Adam moments, so equal states below are not zeros on both sides.
    assert all(torch.count_nonzero(state["exp_avg_sq"]) for state in saved.values())

    same = launch(NPROC, [*COMMON, "--load", str(ckpt), "--ckpt-step", str(K),
                          "--tensorboard-dir", str(tmp_path / "tb_same")],
                  env={"SNAPSHOT_DIR": str(tmp_path / "snap" / "same")}, script=OBSERVED).check()
    _assert_equal_state(saved, _model_space(tmp_path / "snap" / "same", "load"), "DP2 -> DP2")
    uninterrupted = tensorboard_scalars(tmp_path / "tb_full", "lm loss")
    resumed = tensorboard_scalars(tmp_path / "tb_same", "lm loss")
    assert sorted(resumed) == list(range(K + 1, 2 * K + 1)), "resume did not start at K+1"
    for iteration, loss in resumed.items():
        assert loss == uninterrupted[iteration], f"iteration {iteration}: {loss} != " \
                                                 f"{uninterrupted[iteration]}"

    launch(NPROC, [*COMMON, *TP2, "--load", str(ckpt), "--ckpt-step", str(K),
                   "--exit-interval", str(K + 1)],
           env={"SNAPSHOT_DIR": str(tmp_path / "snap" / "tp2")}, script=OBSERVED).check()
    _assert_equal_state(saved, _model_space(tmp_path / "snap" / "tp2", "load"), "DP2 -> TP2")


BUCKET = re.compile(r"Params for bucket (\d+) \((\d+) elements, (\d+) padded size")


def _padded_bucket_ends_before_another(log: str) -> int:
    """From megatron's bucket log (rank 0, each gradient buffer's buckets numbered from 1): how
    many buckets end with padding and are followed by another bucket of their buffer, i.e. the
    ends #5077's offsets run past."""
    buffers, found = [], 0
    for number, numel, padded in BUCKET.findall(log):
        if int(number) == 1:
            buffers.append([])
        buffers[-1].append(int(padded) > int(numel))
    for buckets in buffers:
        found += sum(buckets[:-1])
    return found


@pytest.mark.slow
def test_unpatched_fully_reshardable_resume_loads_shifted_state(tmp_path):
    """megatron-core 0.19.2's own save (MEGATRON_PATCHES_DISABLE=distopt-reshardable-bucket-
    offsets, save and resume), several padded buckets: the resume in the same layout loads
    optimizer state that is not the state saved (shifted, tails zero-filled)."""
    disable = {"MEGATRON_PATCHES_DISABLE": "distopt-reshardable-bucket-offsets"}
    for directory in ("full", "same"):
        (tmp_path / "snap" / directory).mkdir(parents=True)
    ckpt = tmp_path / "ckpt"
    full = launch(NPROC, [*COMMON, "--save", str(ckpt), "--save-interval", str(K),
                          "--exit-interval", str(K)],
                  env={**disable, "SNAPSHOT_DIR": str(tmp_path / "snap" / "full")},
                  script=OBSERVED).check()
    assert ("distopt-reshardable-bucket-offsets: skipped (disabled by MEGATRON_PATCHES_DISABLE)"
            in full.log)
    padded = _padded_bucket_ends_before_another(full.log)
    assert padded > 1, f"{padded} padded bucket ends before another bucket:\n{full.log[-3000:]}"
    saved = _model_space(tmp_path / "snap" / "full", f"save{K}")
    launch(NPROC, [*COMMON, "--load", str(ckpt), "--ckpt-step", str(K), "--exit-interval",
                   str(K + 1)],
           env={**disable, "SNAPSHOT_DIR": str(tmp_path / "snap" / "same")},
           script=OBSERVED).check()
    loaded = _model_space(tmp_path / "snap" / "same", "load")
    assert saved.keys() == loaded.keys()
    differ = {name for name in saved if any(
        not torch.equal(value, loaded[name][key]) for key, value in saved[name].items())}
    zeroed = sum(int(torch.count_nonzero(loaded[name]["exp_avg_sq"] == 0)) for name in saved)
    print(f"unpatched: {padded} padded bucket ends before another bucket; {len(differ)} of "
          f"{len(saved)} parameters resume with other optimizer state; {zeroed} exp_avg_sq "
          f"elements loaded as 0 (saved: "
          f"{sum(int(torch.count_nonzero(s['exp_avg_sq'] == 0)) for s in saved.values())})")
    assert differ, "megatron-core's own resume loaded the state saved: #5077 not shown"
