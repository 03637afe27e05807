"""Expert-tensor-parallel torch_dist checkpoints on megatron-core 0.19.2 are complete (#1836):
an ETP=k checkpoint holds exactly the model bytes of the ETP=1 checkpoint of the same model,
every tensor's saved chunks tile its global shape (checked by the checkpoint audit), and an
ETP=2 checkpoint loads into an ETP=1 layout with identical parameters.
(Bit-exact resume in the same layout is covered per layout in test_train_resume_cpu.py.)"""


import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from _launch import TINY_MODEL, audit_report, launch

ARGS = [*TINY_MODEL, "--use-distributed-optimizer", "--train-iters", "1", "--save-interval", "1"]
BASELINE = (2, ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"])
LAYOUTS = {
    # TP != ETP in each: attention and experts are split differently.
    "etp2-ep2": (4, ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]),
    "tp2-etp4": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "4"]),
    "etp2-ep2-pp2": (8, ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                         "--expert-tensor-parallel-size", "2"]),
}


def _save(tmp_path, name, nproc, layout):
    checkpoint = tmp_path / name
    launch(nproc, [*ARGS, *layout, "--save", str(checkpoint)]).check()
    return checkpoint


def _model_bytes(report: dict) -> int:
    # The distributed optimizer's flat buckets are padded per layout; compare model tensors.
    return sum(t["saved_bytes"] for t in report["tensors"] if not t["key"].startswith("chained_"))


def _model_tensors(checkpoint, out) -> dict:
    dcp_to_torch_save(str(checkpoint / "iter_0000001"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v) and not k.startswith("chained_")}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    checkpoint = _save(tmp_path_factory.mktemp("etp1"), "etp1", *BASELINE)
    return checkpoint, audit_report(checkpoint)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_etp_checkpoint_is_complete(layout, baseline, tmp_path):
    report = audit_report(_save(tmp_path, layout, *LAYOUTS[layout]))
    assert report["verdict"] == baseline[1]["verdict"]
    assert all(t["ok"] for t in report["tensors"])
    experts = [t for t in report["tensors"] if t["expert"]]
    assert experts and all(t["shape_ok"] and t["missing_fraction"] == 0 for t in experts)
    assert _model_bytes(report) == _model_bytes(baseline[1])


def test_etp2_checkpoint_loads_into_etp1_with_identical_parameters(baseline, tmp_path):
    etp2 = _save(tmp_path, "etp2", *LAYOUTS["etp2-ep2"])
    reloaded = tmp_path / "etp1-from-etp2"
    # Weights only: the distributed optimizer's default state format is layout-bound.
    launch(BASELINE[0], [*ARGS, *BASELINE[1], "--load", str(etp2), "--no-load-optim",
                         "--no-load-rng", "--save", str(reloaded), "--save-interval", "1000"]
           ).check()
    saved = _model_tensors(etp2, tmp_path / "etp2.pt")
    resaved = _model_tensors(reloaded, tmp_path / "resaved.pt")
    assert saved.keys() == resaved.keys() and len(saved) > 5
    for key in saved:
        assert torch.equal(saved[key], resaved[key]), key
