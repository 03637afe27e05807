"""Ordinary Megatron-LM MoE command lines: each one trains, or is refused before any work in one
line. Nothing else (a traceback, a crash at the first step, a silent fresh start) is allowed.

What each part proves, honestly:
- TRAINS: really trained, 1 rank x 2 iterations, by the launcher's whole path
  (pretrain_moe.main: defaults, preflight, megatron's validation, pretrain()) in ONE process
  (tests/_flag_matrix_worker.py runs them one after another, resetting megatron's global
  state between them) -- one process start instead of one per case.
- REFUSED: judged in this process by what pretrain_moe.main runs before it initialises
  anything (tests/_judge.py). This proves the one refusal line and that nothing was written;
  the exit-status/every-rank/no-traceback contract of that refusal is proven end to end once
  (test_megatron_refusal_end_to_end) and by tests/moe_launcher/test_preflight.py.
- ACCEPTED_LAYOUTS: multi-rank layouts only judged here (every check before work passes);
  training them is proven by the multi-rank tests (test_checkpoint_guard, test_train_resume).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from _judge import judge, launcher_checks
from _launch import REPO, TINY_MODEL, launch

BASE = [*TINY_MODEL, "--train-iters", "2"]


def without(flags: list[str], *names: str) -> list[str]:
    """flags without the named switches (flags that take no value)."""
    return [f for f in flags if f not in names]


def replaced(flags: list[str], flag: str, value: str) -> list[str]:
    i = flags.index(flag)
    return [*flags[:i + 1], value, *flags[i + 2:]]


NO_GATE = without(BASE, "--swiglu")  # GELU experts

# name: command line (1 rank). Each must train for 2 iterations.
TRAINS = {
    "base-swiglu-rmsnorm-rope": BASE,
    # megatron's local spec with the patch local-mla-core-attention (refused before it)
    "attention-multi-latent-local-spec": [*BASE, "--multi-latent-attention", "--q-lora-rank", "32",
                                          "--kv-lora-rank", "16", "--qk-head-dim", "16",
                                          "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"],
    # an exact vocabulary: 520 embedding rows, not a multiple of --make-vocab-size-divisible-by
    "vocabulary-exact-size": [*BASE, "--no-pad-vocab-size", "--padded-vocab-size", "520"],
    "attention-gqa-qk-layernorm": [*BASE, "--group-query-attention", "--num-query-groups", "2",
                                   "--qk-layernorm"],
    "activation-gelu-experts": NO_GATE,
    "activation-squared-relu": [*NO_GATE, "--squared-relu"],
    "norm-layernorm-learned-positions": [
        *replaced(replaced(BASE, "--normalization", "LayerNorm"),
                  "--position-embedding-type", "learned_absolute")],
    "router-sigmoid-expert-bias-seq-aux": [*BASE, "--moe-router-score-function", "sigmoid",
                                           "--moe-router-enable-expert-bias",
                                           "--moe-router-load-balancing-type", "seq_aux_loss",
                                           "--moe-router-dtype", "fp32"],
    "router-top1-pre-softmax-global-aux": [*replaced(BASE, "--moe-router-topk", "1"),
                                           "--moe-router-pre-softmax",
                                           "--moe-router-load-balancing-type",
                                           "global_aux_loss"],
    "capacity-dropping-alltoall": [*BASE, "--moe-token-dispatcher-type", "alltoall",
                                   "--moe-expert-capacity-factor", "1.0",
                                   "--moe-token-drop-policy", "probs",
                                   "--moe-pad-expert-input-to-capacity"],
    "shared-experts": [*BASE, "--moe-shared-expert-intermediate-size", "64"],
    "mtp-one-layer": [*BASE, "--mtp-num-layers", "1"],
    "dense-first-layer": [*BASE, "--moe-layer-freq", "[0,1]"],
    "precision-fp32": without(BASE, "--bf16"),
    "cross-entropy-fusion-fp32": [*without(BASE, "--bf16"), "--cross-entropy-loss-fusion"],
    "recompute-full-distributed-optimizer": [*BASE, "--recompute-granularity", "full",
                                             "--recompute-method", "uniform",
                                             "--recompute-num-layers", "1",
                                             "--use-distributed-optimizer"],
    "overlap-grad-reduce-param-gather": [*BASE, "--use-distributed-optimizer",
                                         "--overlap-grad-reduce", "--overlap-param-gather"],
    "optimizer-sgd-selective-recompute": [*BASE, "--optimizer", "sgd",
                                          "--recompute-granularity", "selective"],
    # {save} is replaced by a fresh folder: a requeued first run (--load == --save, nothing
    # saved yet) starts fresh; torch_dist and torch formats both write.
    "checkpoint-torch-dist-requeued-first-run": [*BASE, "--save", "{save}", "--load", "{save}",
                                                 "--save-interval", "2",
                                                 "--ckpt-format", "torch_dist"],
    "checkpoint-torch-format": [*BASE, "--save", "{save}", "--save-interval", "2",
                                "--ckpt-format", "torch"],
    "data-split-eval": [*replaced(replaced(BASE, "--eval-iters", "1"), "--eval-interval", "2"),
                        "--split", "90,10,0"],
}

# name: (world size, command line, the flag the refusal must name)
REFUSED = {
    # megatron's own checks, refused through megatron's validation / config construction
    "seq-length-over-max-positions": (1, replaced(BASE, "--seq-length", "128"),
                                      "--seq-length"),
    "hidden-not-divisible-by-heads": (1, replaced(BASE, "--num-attention-heads", "3"),
                                      "--num-attention-heads"),
    "moe-tp2-without-sequence-parallel": (2, [*BASE, "--tensor-model-parallel-size", "2"],
                                          "--sequence-parallel"),
    "te-cross-entropy-fusion": (1, [*BASE, "--cross-entropy-loss-fusion",
                                    "--cross-entropy-fusion-impl", "te"],
                                "--cross-entropy-fusion-impl"),
    "router-groups-do-not-divide-experts": (1, [*BASE, "--moe-router-num-groups", "3",
                                                "--moe-router-group-topk", "1"],
                                            "--moe-router-num-groups"),
    "group-topk-without-groups": (1, [*BASE, "--moe-router-group-topk", "2"],
                                  "--moe-router-num-groups"),
    # megatron's parser: argparse's errors
    "unknown-flag": (1, [*BASE, "--num-expert", "8"], "--num-expert"),
    "bad-value": (1, replaced(BASE, "--moe-router-topk", "two"), "--moe-router-topk"),
    # this project's checks
    "no-train-iters-or-samples": (1, [*TINY_MODEL], "--train-iters"),
    "top-k-over-experts": (1, replaced(BASE, "--moe-router-topk", "9"), "--moe-router-topk"),
    "top-k-over-group-reach": (1, [*replaced(BASE, "--moe-router-topk", "3"),
                                   "--moe-router-num-groups", "4", "--moe-router-group-topk", "1"],
                               "--moe-router-topk"),
    "group-topk-over-groups": (1, [*BASE, "--moe-router-num-groups", "2",
                                   "--moe-router-group-topk", "3"], "--moe-router-group-topk"),
    "gelu-experts-with-bias-local-spec": (1, without(NO_GATE, "--disable-bias-linear"),
                                          "--disable-bias-linear"),
    "squared-relu-experts-with-bias-local-spec": (
        1, [*without(NO_GATE, "--disable-bias-linear"), "--squared-relu"],
        "--disable-bias-linear"),
    "save-not-creatable": (1, [*BASE, "--save", "/proc/pretrain_moe/ckpt", "--save-interval", "1"],
                           "--save"),
    "save-under-a-file": (1, [*BASE, "--save", "{file}/ckpt", "--save-interval", "1"], "--save"),
    "load-missing-and-not-save": (1, [*BASE, "--load", "{missing}"], "--load"),
    "overlap-moe-expert-parallel-comm": (1, [*BASE, "--overlap-moe-expert-parallel-comm"],
                                         "--overlap-moe-expert-parallel-comm"),
    "context-parallel-without-te": (2, [*BASE, "--context-parallel-size", "2"],
                                    "--context-parallel-size"),
    # features whose package this machine lacks (the optional-package table)
    "flex-dispatcher-without-deepep": (1, [*BASE, "--moe-token-dispatcher-type", "flex"],
                                       "--moe-token-dispatcher-type"),
    "permute-fusion-without-te": (1, [*BASE, "--moe-permute-fusion"], "--moe-permute-fusion"),
    "grouped-gemm-without-te": (1, [*BASE, "--moe-grouped-gemm"], "--moe-grouped-gemm"),
    "fp8-without-te": (1, [*BASE, "--fp8-format", "hybrid"], "--fp8-format"),
    "tp-comm-overlap-without-te": (2, [*BASE, "--tensor-model-parallel-size", "2",
                                       "--sequence-parallel", "--tp-comm-overlap"],
                                   "--tp-comm-overlap"),
    "latent-moe-without-te": (1, [*BASE, "--moe-latent-size", "32"], "--moe-latent-size"),
    # (transformers is installed: prepare_data and the HF converter need it; sentencepiece is not)
    "sentencepiece-tokenizer-without-sentencepiece": (
        1, [*replaced(BASE, "--tokenizer-type", "SentencePieceTokenizer"),
            "--tokenizer-model", "tokenizer.model"], "--tokenizer-type"),
    "transformer-engine-impl-without-te": (1, [*BASE, "--transformer-impl",
                                               "transformer_engine"], "--transformer-impl"),
    # HybridModel: `|` segments that the pipeline size does not divide (megatron's check)
    "hybrid-segments-not-divisible-by-pp": (
        2, [*replaced(BASE, "--num-layers", "6"), "--hybrid-layer-pattern", "*E|*E|*E",
            "--pipeline-model-parallel-size", "2"], "--hybrid-layer-pattern"),
}

# name: (world size, command line): pass every check before work (training them: see top).
ACCEPTED_LAYOUTS = {
    "tp2-sequence-parallel": (2, [*BASE, "--tensor-model-parallel-size", "2",
                                  "--sequence-parallel"]),
    "ep2-alltoall": (2, [*BASE, "--expert-model-parallel-size", "2",
                         "--moe-token-dispatcher-type", "alltoall"]),
    "pp2": (2, [*BASE, "--pipeline-model-parallel-size", "2"]),
    "tp2-ep2-etp1": (4, [*BASE, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                         "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                         "1"]),
}


def test_matrix_size():
    assert len(TRAINS) + len(REFUSED) + len(ACCEPTED_LAYOUTS) >= 40


def filled(argv: list[str], tmp_path) -> list[str]:
    (tmp_path / "a-file").write_text("")
    names = {"{save}": str(tmp_path / "ckpt"), "{missing}": str(tmp_path / "no-such-ckpt"),
             "{file}": str(tmp_path / "a-file")}
    return [names.get(word, word.replace("{file}", names["{file}"])) for word in argv]


@pytest.mark.parametrize("case", REFUSED)
def test_refused_in_one_line_before_any_work(case, tmp_path, monkeypatch):
    world, argv, flag = REFUSED[case]
    before = sorted(os.listdir(tmp_path))
    line = judge(world, filled(argv, tmp_path), monkeypatch)
    assert line is not None, f"{case}: accepted, but it cannot train"
    assert line.startswith("pretrain_moe: error: ") and "\n" not in line, line
    assert flag in line and "fix:" in line, line
    assert sorted(os.listdir(tmp_path)) == sorted({*before, "a-file"}), "something was written"


@pytest.mark.parametrize("case", ACCEPTED_LAYOUTS)
def test_parallel_layouts_pass_every_check(case, monkeypatch):
    world, argv = ACCEPTED_LAYOUTS[case]
    assert judge(world, argv, monkeypatch) is None


def test_gelu_and_squared_relu_get_the_fusion_setting_that_trains(monkeypatch):
    """megatron's config refuses its own default bias-GELU fusion for squared ReLU; the model
    default turns it off, and a user's explicit choice is left alone."""
    launcher_checks()  # the patches main applies
    from moe_launcher.platform_defaults import with_model_defaults, with_platform_defaults

    # megatron's validation and config alone (the local-spec bias check is preflight's)
    squared_relu, _ = with_platform_defaults([*without(NO_GATE, "--disable-bias-linear"),
                                              "--squared-relu"])
    argv, lines = with_model_defaults(squared_relu)
    assert "--no-bias-gelu-fusion" in argv and len(lines) == 1 and "squared ReLU" in lines[0]
    assert with_model_defaults([*squared_relu, "--no-bias-gelu-fusion"])[1] == []
    assert with_model_defaults(BASE) == (BASE, [])  # SwiGLU: megatron's fused kernel works
    from megatron.training.arguments import parse_args

    from moe_launcher.megatron_validation import pretrain_config, validated_args
    from moe_launcher.runtime.refusals import PreflightError

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(sys, "argv", ["pretrain_moe.py", *squared_relu])
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(PreflightError,
                                                                  match="bias_activation_fusion"):
        pretrain_config(validated_args(parse_args()))
    monkeypatch.setattr(sys, "argv", ["pretrain_moe.py", *argv])
    with contextlib.redirect_stdout(io.StringIO()):
        config = pretrain_config(validated_args(parse_args()))
    assert config.model.transformer.bias_activation_fusion is False


def test_optional_package_table_passes_present_packages():
    """The table refuses only what is missing: with every package present nothing is refused
    (here `available` stands in for an install this machine does not have)."""
    import argparse

    from moe_launcher import dependencies

    asks_everything = argparse.Namespace(
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
        moe_permute_fusion=True, moe_router_fusion=True, moe_grouped_gemm=True, fp8="hybrid",
        fp4=None, tp_comm_overlap=True, moe_latent_size=32, use_precision_aware_optimizer=True,
        tokenizer_type="HuggingFaceTokenizer", transformer_impl="transformer_engine",
        async_save=True, use_persistent_ckpt_worker=True, async_strategy="nvrx",
        enable_ft_package=True, log_device_memory_used=True, adlr_autoresume=True)
    assert dependencies.first_missing(asks_everything, available=lambda package: True) is None
    assert dependencies.first_missing(asks_everything).package == dependencies.DEEP_EP


@pytest.mark.slow
def test_megatron_refusal_end_to_end(tmp_path):
    """A check only megatron makes (MoE with TP 2 needs --sequence-parallel), end to end: every
    rank exits with status 2, one line, no traceback, nothing written."""
    save = tmp_path / "ckpt"
    run = launch(2, [*BASE, "--tensor-model-parallel-size", "2", "--save", str(save),
                     "--save-interval", "1"], timeout=180)
    errors = [line for line in run.log.splitlines() if "pretrain_moe: error:" in line]
    assert run.exit_codes == [2, 2], run.log[-3000:]
    assert len(errors) == 1 and "--sequence-parallel" in errors[0], errors
    assert "Traceback" not in run.log, run.log[-3000:]
    assert "initializing torch distributed" not in run.log and not save.exists()


@pytest.mark.slow
def test_matrix_trains(tmp_path):
    cases = {}
    for name, argv in TRAINS.items():
        (tmp_path / name).mkdir()
        cases[name] = [word.replace("{save}", str(tmp_path / name / "ckpt")) for word in argv]
    cases_file, results_file = tmp_path / "cases.json", tmp_path / "results.json"
    cases_file.write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "_flag_matrix_worker.py"),
                           str(cases_file), str(results_file)], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    failed = {name: results.get(name, {"outcome": "not run", "detail": done.stdout[-3000:]})
              for name in TRAINS if results.get(name, {}).get("outcome") != "trained"}
    assert not failed, json.dumps(failed, indent=1)
    for name in ("checkpoint-torch-dist-requeued-first-run", "checkpoint-torch-format"):
        assert (tmp_path / name / "ckpt" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.slow
def test_resume_with_a_longer_schedule_is_refused_with_both_fixes(tmp_path):
    """Training further (a raised --train-iters moves megatron's decay end) without saying which
    schedule to keep fails megatron's scheduler check at the load: every rank refuses in one
    line naming the flags and both fixes, and the run trains on once one of them is given."""
    save = str(tmp_path / "ckpt")
    resume = [*TINY_MODEL, "--save", save, "--load", save, "--save-interval", "100"]
    launch(2, [*resume, "--train-iters", "2"]).check()
    refused = launch(2, [*resume, "--train-iters", "4"])
    errors = [line for line in refused.log.splitlines() if "pretrain_moe: error:" in line]
    assert refused.exit_codes == [1, 1] and len(errors) == 1, refused.log[-3000:]  # rank 0's
    assert all("--train-iters" in line and "--override-opt_param-scheduler" in line
               and "--use-checkpoint-opt_param-scheduler" in line for line in errors), errors
    assert "Traceback" not in refused.log and "iteration        3/" not in refused.log
    trained = launch(2, [*resume, "--train-iters", "4", "--override-opt_param-scheduler"]).check()
    assert "iteration        4/" in trained.log, trained.log[-3000:]
