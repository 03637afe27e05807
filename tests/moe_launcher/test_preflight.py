"""Bad flags and environment: the real launcher refuses before megatron validates or builds
anything -- one line naming the flag and the fix, printed once, exit status 2, no traceback,
nothing written to --save.

Each rule is judged in this process by what pretrain_moe.main runs before any work
(tests/_judge.py), as rank 0 of its world. The contract of a refusal on every rank is proven by
real launches, each once: a world of four ranks (every rank exits with status 2, rank 0 prints
the line, nothing is written), an unsupported megatron-core (refused before megatron is
imported), and torchrun with two ranks, as users start it, to show the job stops and the
message is printed once.
"""

from __future__ import annotations

import os
import contextlib
import importlib.util
import inspect
import io
import re
import time
import types

import pytest
import torch

from _judge import checked_args, judge, with_launcher_defaults
from _launch import REPO, TINY_MODEL, launch, printed_losses


def without(flags: list[str], flag: str, values: int = 0) -> list[str]:
    i = flags.index(flag)
    return flags[:i] + flags[i + 1 + values:]


BASE = [*TINY_MODEL, "--train-iters", "2"]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format",
                 "fsdp_dtensor", "--data-parallel-sharding-strategy", "optim_grads_params"]
# name: (world size, flags, flag the refusal must name)
CASES = {
    "tp-does-not-divide-world": (4, ["--tensor-model-parallel-size", "3"],
                                 "--tensor-model-parallel-size"),
    "pp-larger-than-world": (2, ["--pipeline-model-parallel-size", "4"],
                             "--pipeline-model-parallel-size"),
    "ep-x-etp-exceeds-stage": (4, ["--expert-model-parallel-size", "4",
                                   "--expert-tensor-parallel-size", "2"],
                               "--expert-model-parallel-size"),
    "ep-x-pp-exceeds-world": (4, ["--pipeline-model-parallel-size", "2",
                                  "--expert-model-parallel-size", "4"],
                              "--expert-model-parallel-size"),
    "experts-not-divisible-by-ep": (3, ["--expert-model-parallel-size", "3"],
                                    "--expert-model-parallel-size"),
    "etp-does-not-divide-moe-ffn": (2, ["--expert-tensor-parallel-size", "2",
                                        "--moe-ffn-hidden-size", "65"],
                                    "--expert-tensor-parallel-size"),
    "ep-without-experts": (2, [*without(BASE, "--num-experts", 1), "--expert-model-parallel-size",
                               "2"], "--expert-model-parallel-size"),
    "pipeline-first-stage-takes-all-layers": (2, ["--pipeline-model-parallel-size", "2",
                                                  "--decoder-first-pipeline-num-layers", "2"],
                                              "--decoder-first-pipeline-num-layers"),
    "global-batch-not-divisible": (3, ["--global-batch-size", "8"], "--global-batch-size"),
    "data-path-missing": (1, [*without(BASE, "--mock-data"), "--data-path", "/nonexistent/corpus"],
                          "--data-path"),
    "transformer-engine-missing": (1, ["--transformer-impl", "transformer_engine"],
                                   "--transformer-impl"),
    # A GPU recipe where no CUDA device is visible (sbatch without --gpus-per-node): refused
    # before the CPU backend, not left to fail inside Transformer Engine or NCCL.
    "gpu-recipe-without-cuda": (2, ["--transformer-impl", "transformer_engine",
                                    "--moe-grouped-gemm", "--moe-token-dispatcher-type",
                                    "alltoall"],
                                "--transformer-impl transformer_engine asks for GPUs, but this "
                                "rank sees no CUDA device"),
    "nccl-without-cuda": (1, ["--distributed-backend", "nccl"],
                          "--distributed-backend nccl asks for GPUs"),
    "pipeline-nccl-without-cuda": (1, ["--pipeline-model-parallel-comm-backend", "nccl"],
                                   "--pipeline-model-parallel-comm-backend nccl asks for GPUs"),
    "megatron-fsdp-with-torch-dist": (1, ["--use-megatron-fsdp", "--ckpt-format", "torch_dist"],
                                      "--ckpt-format"),
    # megatron-core 0.19.2's Megatron-FSDP mesh has no pipeline axis (every rank fails at wrap).
    "megatron-fsdp-with-pipeline-parallelism": (2, ["--use-megatron-fsdp",
                                                    "--use-distributed-optimizer",
                                                    "--ckpt-format", "fsdp_dtensor",
                                                    "--pipeline-model-parallel-size", "2"],
                                                "--pipeline-model-parallel-size"),
    "save-without-save-interval": (1, [], "--save-interval"),
    "router-top-k-zero": (1, ["--moe-router-topk", "0"], "--moe-router-topk"),
    "micro-batch-size-zero": (1, ["--micro-batch-size", "0"], "--micro-batch-size"),
    "train-iters-zero": (1, ["--train-iters", "0"], "--train-iters"),
    # megatron divides by these at the first iteration (ZeroDivisionError on every rank).
    "log-interval-zero": (1, ["--log-interval", "0"], "--log-interval"),
    "eval-interval-zero": (1, ["--eval-interval", "0"], "--eval-interval"),
    # torch raises at the first forward or batch, on every rank.
    "seq-length-zero": (1, ["--seq-length", "0"], "--seq-length"),
    "dropout-above-one": (1, ["--hidden-dropout", "2"], "--hidden-dropout"),
    "negative-data-loader-workers": (1, ["--num-workers", "-1"], "--num-workers"),
    "negative-init-std": (1, ["--init-method-std", "-0.02"], "--init-method-std"),
    "adam-beta2-of-one": (1, ["--adam-beta2", "1.0"], "--adam-beta2"),
    "kv-channels-zero": (1, ["--kv-channels", "0"], "--kv-channels"),
    "expert-ffn-zero": (1, ["--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size"),
    "negative-mtp-layers": (1, ["--mtp-num-layers", "-1"], "--mtp-num-layers"),
    # megatron seeds positive seeds only: ValueError on every rank after process groups exist.
    "seed-zero": (1, ["--seed", "0"], "--seed"),
    # megatron's attention fails at the first forward (test_..._without_the_check below).
    "query-groups-not-dividing-heads": (1, ["--group-query-attention", "--num-query-groups", "3"],
                                        "--num-query-groups"),
    # megatron drops every token (below): experts that never train, without a word.
    "expert-capacity-factor-zero": (1, ["--moe-expert-capacity-factor", "0"],
                                    "--moe-expert-capacity-factor"),
    # megatron's router and experts assert at the first forward, or route without the balancer
    # (test_without_the_checks_megatron_routes_... below).
    "sinkhorn-with-an-aux-loss": (1, ["--moe-router-load-balancing-type", "sinkhorn"],
                                  "--moe-aux-loss-coeff"),
    "sinkhorn-in-a-list": (1, ["--moe-router-load-balancing-type", "aux_loss", "sinkhorn",
                               "--moe-aux-loss-coeff", "1e-2", "0"],
                           "--moe-router-load-balancing-type"),
    "quantile-balancing-in-a-list": (1, ["--moe-router-load-balancing-type", "quantile_balancing",
                                         "seq_aux_loss", "--moe-aux-loss-coeff", "0", "1e-3"],
                                     "--moe-router-load-balancing-type"),
    "quantile-balancing-by-groups": (1, ["--moe-router-load-balancing-type", "quantile_balancing",
                                         "--moe-aux-loss-coeff", "0", "--moe-router-num-groups",
                                         "2", "--moe-router-group-topk", "2"],
                                     "--moe-router-num-groups"),
    "probs-on-input-with-top-2": (1, ["--moe-apply-probs-on-input"], "--moe-apply-probs-on-input"),
    # megatron's router raises at the first forward: its fused top-k is Transformer Engine's.
    "router-fusion-without-transformer-engine": (1, ["--moe-router-fusion"], "--moe-router-fusion"),
    # megatron fails on every rank once the model is built, or at the first step
    # (test_without_the_check_megatron_fails_on_these_fsdp_and_optimizer_choices below).
    "activation-dump-needs-transformer-engine": (1, ["--save-activations-interval", "1"],
                                                 "--save-activations-interval"),
    "dgrad-dump-needs-transformer-engine": (1, ["--save-dgrads-interval", "1"],
                                            "--save-dgrads-interval"),
    "tokens-per-expert-dump-on-local-experts": (1, ["--save-tokens-per-expert-interval", "1"],
                                                "--save-tokens-per-expert-interval"),
    "persistent-checkpoint-worker-needs-nvrx": (1, ["--async-save",
                                                    "--use-persistent-ckpt-worker"],
                                                "--use-persistent-ckpt-worker"),
    "persistent-checkpoint-worker-without-cuda": (1, ["--async-save",
                                                      "--use-persistent-ckpt-worker",
                                                      "--async-strategy", "mcore"],
                                                  "--use-persistent-ckpt-worker"),
    "sgd-with-the-distributed-optimizer": (1, ["--optimizer", "sgd",
                                               "--use-distributed-optimizer"], "--optimizer"),
    "megatron-fsdp-bf16-main-weights-clipped": (1, [*MEGATRON_FSDP,
                                                    "--megatron-fsdp-main-params-dtype", "bf16"],
                                                "--megatron-fsdp-main-params-dtype"),
    "megatron-fsdp-auto-main-weights-clipped": (1, [*MEGATRON_FSDP,
                                                    "--megatron-fsdp-main-params-dtype", "auto"],
                                                "--megatron-fsdp-main-params-dtype"),
    "megatron-fsdp-meta-device-with-cpu-initialization": (1, [*MEGATRON_FSDP,
                                                              "--init-model-with-meta-device"],
                                                          "--init-model-with-meta-device"),
    # a bare assert of megatron's names its flag from the source line (`assert not args.bf16`)
    "fp16-and-bf16": (1, ["--fp16"], "--bf16: megatron refuses this command line"),
    "layernorm-1p-on-the-local-spec": (1, ["--apply-layernorm-1p"], "--apply-layernorm-1p"),
    # torch's norms get fp32 input with bf16 weights at the first forward (below).
    "fp32-residual-on-torch-norms": (1, ["--fp32-residual-connection"],
                                     "--fp32-residual-connection"),
    "load-is-a-file": (1, ["--load", "/etc/hostname"], "--load"),
    # megatron makes its TensorBoard writer and wandb run on the last rank only (test below).
    "tensorboard-dir-unwritable": (2, ["--tensorboard-dir", "/proc/tensorboard"],
                                   "--tensorboard-dir /proc/tensorboard cannot be written"),
    "wandb-save-dir-unwritable": (2, ["--wandb-project", "p", "--wandb-save-dir", "/proc/wandb"],
                                  "--wandb-save-dir /proc/wandb cannot be written"),
    "load-holds-no-checkpoint": (1, ["--load", str(REPO / "examples")], "--load"),
    # megatron-core 0.19.2 would build the pattern's 3 layers and drop --num-layers silently.
    "hybrid-pattern-length-differs-from-num-layers": (1, ["--hybrid-layer-pattern", "*E*"],
                                                      "--num-layers"),
    # On CPU the local spec: its attention asserts context_parallel_size == 1 at model build.
    "context-parallel-without-transformer-engine": (2, ["--context-parallel-size", "2"],
                                                    "--context-parallel-size"),
    # megatron-core 0.19.2 fails every such save on every rank (test below).
    "torch-fsdp2-saving-torch-dist": (2, ["--use-torch-fsdp2"], "fix: pass --ckpt-format "
                                                                "torch_dcp"),
    "torch-fsdp2-with-fsdp-dtensor": (2, ["--use-torch-fsdp2", "--ckpt-format", "fsdp_dtensor"],
                                      "use --ckpt-format torch_dcp"),
    # megatron-core 0.19.2 asks for --spec local, then cannot import it (test below).
    "attention-backend-local": (1, ["--attention-backend", "local"],
                                "--attention-backend local cannot run"),
    "attention-backend-local-with-spec-local": (1, ["--attention-backend", "local", "--spec",
                                                    "local"],
                                                "--attention-backend local cannot run"),
    # The local HybridModel spec builds attention, dense MLP and MoE layers only.
    "hybrid-family-without-transformer-engine": (1, ["--hybrid-layer-pattern", "*M*E"],
                                                 "--hybrid-layer-pattern"),
    # Megatron-LM #7452: MTP per-token loss normalised per micro-batch (no sound fix; refused).
    "mtp-per-token-loss-with-eod-mask": (1, ["--mtp-num-layers", "1",
                                             "--calculate-per-token-loss", "--eod-mask-loss"],
                                         "--calculate-per-token-loss"),
    # megatron-core 0.19.2's Muon: refused in fp16 when the optimizer is built (a traceback);
    # under the layer-wise distributed optimizer, wrapped for bf16 only (fp32 dies at step 1).
    "muon-in-fp16": (1, [*without(BASE, "--bf16", 0), "--fp16", "--optimizer", "muon"],
                     "--fp16"),
    "muon-distributed-optimizer-in-fp32": (1, [*without(BASE, "--bf16", 0), "--optimizer", "muon",
                                               "--use-distributed-optimizer"],
                                           "--use-distributed-optimizer"),
    # megatron-core 0.19.2's adaptive Muon dies at its first step with emerging-optimizers 0.3.0.
    "adaptive-muon-cannot-step": (1, ["--optimizer", "adaptive_muon"], "--optimizer"),
    # megatron-core 0.19.2's QK-clip views Megatron-FSDP's shards as whole weights: every rank
    # dies at the first clip (tests/megatron_patches/moe/test_qk_clip_cpu.py).
    "qk-clip-with-megatron-fsdp": (2, ["--qk-clip", "--use-megatron-fsdp",
                                       "--use-distributed-optimizer", "--ckpt-format",
                                       "fsdp_dtensor"], "--qk-clip"),
    # megatron's HuggingFaceTokenizer would download a hub id on every rank.
    "tokenizer-model-is-a-hub-id": (1, ["--tokenizer-type", "HuggingFaceTokenizer",
                                        "--tokenizer-model", "Qwen/Qwen3-30B-A3B"],
                                    "--tokenizer-model"),
    # megatron's rerun state machine opens it on every rank and raises there.
    "result-rejected-tracker-in-a-missing-folder": (
        1, ["--result-rejected-tracker-filename", "/no-such-folder/rejected_results.txt"],
        "--result-rejected-tracker-filename"),
    # megatron's get_model gives the meta-device weights memory and initializes none of them.
    "meta-device-without-fsdp-or-checkpoint": (1, ["--init-model-with-meta-device"],
                                               "--init-model-with-meta-device"),
    "no-initialization-without-checkpoint": (1, ["--no-initialization"], "--no-initialization"),
    # megatron's builder pads anyway; its FLOPs count meets the missing padded size.
    "unpadded-vocabulary-without-its-size": (1, ["--no-pad-vocab-size"], "--no-pad-vocab-size"),
    # megatron raises as it builds the loaders, or at the first evaluation
    "multiple-validation-sets-without-full-validation": (1, ["--multiple-validation-sets"],
                                                         "--multiple-validation-sets"),
    "validation-set-names-without-their-sets": (1, ["--validation-set-names", "held-out"],
                                                "--validation-set-names"),
    # megatron judges SHARP as it makes its process groups; on the dp group it always fails
    "sharp-on-the-data-parallel-group": (1, ["--use-sharp"], "--use-sharp"),
    "sharp-group-without-sharp": (1, ["--sharp-enabled-group", "dp"], "--sharp-enabled-group"),
    "sharp-on-one-optimizer-instance": (1, ["--use-sharp", "--sharp-enabled-group",
                                            "dp_replica"], "--sharp-enabled-group"),
    # megatron takes the provider's datasets for iterators: a TypeError at the first step
    "external-data-loader": (1, ["--dataloader-type", "external"], "--dataloader-type"),
    # a choice of megatron's parser that its rerun state machine has no mode for
    "rerun-mode-report-stats": (1, ["--rerun-mode", "report_stats"], "--rerun-mode"),
    # packages megatron imports once it has started; without ADLR's userlib it exits 0.
    "fault-tolerance-needs-nvrx": (1, ["--enable-ft-package"], "--enable-ft-package"),
    "device-memory-log-needs-nvml": (1, ["--log-device-memory-used"],
                                     "--log-device-memory-used"),
    "adlr-autoresume-needs-its-userlib": (1, ["--adlr-autoresume"], "--adlr-autoresume"),
    # megatron's validate_args prints why and calls exit(): status 0 on every rank.
    "checkpoint-activations-no-longer-valid": (1, ["--checkpoint-activations"],
                                               "--checkpoint-activations"),
    # megatron's enum conversion raises KeyError (a traceback) on a name it does not know.
    "attention-backend-unknown-name": (1, ["--attention-backend", "flash_attn"],
                                       "--attention-backend"),
    "exit-signal-unknown-name": (1, ["--exit-signal", "TERM"], "--exit-signal"),
    # megatron's parse_args swaps every parsed flag for the YAML file's namespace.
    "yaml-cfg-replaces-the-command-line": (1, ["--yaml-cfg", str(REPO / "run.yaml")],
                                           "--yaml-cfg"),
    "tokenizer-model-folder-without-a-tokenizer": (1, ["--tokenizer-type", "HuggingFaceTokenizer",
                                                       "--tokenizer-model", str(REPO / "examples")],
                                                   "--tokenizer-model"),
}


def assert_refused(run, world: int, flag: str, save_dir, seconds: float) -> None:
    output = run.log
    errors = [line for line in output.splitlines() if line.startswith("pretrain_moe: error:")]
    assert run.exit_codes == [2] * world, f"exit codes {run.exit_codes}:\n{output[-3000:]}"
    assert len(errors) == 1, f"expected one refusal line, got {errors}:\n{output[-3000:]}"
    assert flag in errors[0] and "fix" in errors[0].lower(), errors[0]
    assert "Traceback" not in output, output[-3000:]
    assert "building GPT model" not in output and "initializing torch distributed" not in output
    assert not os.path.exists(save_dir), f"{save_dir} was written"
    assert seconds < 120, f"took {seconds:.0f}s"


def case_command_line(case: str, save) -> tuple[int, list[str], str]:
    world, flags, flag = CASES[case]
    flags = flags if flags and flags[0] == BASE[0] else [*BASE, *flags]
    if case != "save-without-save-interval":
        flags = [*flags, "--save-interval", "1"]
    if "--eval-interval" not in flags[len(BASE):]:
        flags = [*flags, "--eval-interval", "1000"]
    return world, [*flags, "--save", str(save)], flag


@pytest.mark.parametrize("case", CASES)
def test_bad_flags_are_refused_before_megatron_starts(case, tmp_path, monkeypatch):
    world, argv, flag = case_command_line(case, tmp_path / "ckpt")
    line = judge(world, argv, monkeypatch)
    assert line is not None, f"{case}: accepted"
    assert line.startswith("pretrain_moe: error: ") and "\n" not in line, line
    assert flag in line and "fix" in line.lower(), line
    assert os.listdir(tmp_path) == [], "something was written"



@pytest.mark.slow
def test_without_the_check_megatron_fsdp_fails_on_every_pipeline_rank():
    """What megatron-fsdp-pipeline-parallel refuses, on megatron-core's own mesh function at
    PP 2 (2 gloo ranks): every rank fails (the launcher's run got as far as wrapping the model,
    then printed this error's traceback on every rank)."""
    log = launch(2, [], script=REPO / "tests" / "_fsdp_pipeline_mesh_worker.py",
                 timeout=300).check().log
    # (the ranks' lines may run together in the merged log)
    failed = re.findall(r"rank (\d) mesh failed: EinopsError: .*?Shape mismatch, 2 != 1", log)
    assert sorted(failed) == ["0", "1"], log[-3000:]

def as_rank_0_of_one(monkeypatch) -> None:
    """The environment megatron's parser reads its rank and world from: rank 0 of one."""
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)


def test_without_the_check_megatron_replaces_num_layers_by_the_patterns(monkeypatch):
    """What the hybrid-layer-pattern check refuses: megatron-core 0.19.2's validation alone
    takes --num-layers 2 with a 3-layer pattern and makes it 3, without a word (#1778 class)."""
    import contextlib
    import io
    import sys

    from moe_launcher.megatron_validation import parse_command_line, validated_args
    from moe_launcher.platform_defaults import with_platform_defaults

    as_rank_0_of_one(monkeypatch)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # megatron's parser replaces it
    argv, _ = with_platform_defaults([*BASE, "--hybrid-layer-pattern", "*E*",
                                      "--eval-interval", "1000"], on_cpu=True)
    args = parse_command_line(argv)
    assert args.num_layers == 2
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        assert validated_args(args).num_layers == 3
    said = [line for line in printed.getvalue().splitlines()
            if ("num_layers" in line or "num-layers" in line) and " ...." not in line]
    assert said == [], said  # only megatron's dump of every argument names it


def test_without_the_check_megatron_drops_the_flags_for_a_yaml_config_and_fails(monkeypatch,
                                                                               tmp_path):
    """What the --yaml-cfg refusal stops: megatron-core 0.19.2's own parse_args, given a config
    shaped as Megatron-LM's examples/gpt3/gpt_config.yaml (nested language_model and
    model_parallel sections, top-level training keys), replaces the parsed flags by the file's
    namespace and then fails on an attribute the file does not set, on every rank."""
    from megatron.training.yaml_arguments import load_yaml

    config = tmp_path / "gpt_config.yaml"
    config.write_text("language_model:\n  num_layers: 2\n  hidden_size: 64\n"
                      "model_parallel:\n  tensor_model_parallel_size: 1\n"
                      "micro_batch_size: 2\nglobal_batch_size: 8\nseq_length: 64\n")
    assert not hasattr(load_yaml(str(config)), "num_experts")  # --num-experts below is gone
    with pytest.raises(AttributeError, match="disable_msc_deprecated"):
        megatron_alone(monkeypatch, [*BASE, "--yaml-cfg", str(config)])


def megatron_alone(monkeypatch, argv: list[str]):
    """megatron-core's own parse_args and validate_args on argv, as rank 0 of one."""
    import sys

    from megatron.training.arguments import parse_args, validate_args

    as_rank_0_of_one(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["pretrain_moe.py", *argv])
    return validate_args(parse_args(), {})


def test_without_the_checks_megatron_exits_0_or_raises_on_these_flags(monkeypatch, capsys):
    """What the parse and validation refusals stop, on megatron-core 0.19.2 alone:
    --checkpoint-activations ends validate_args with exit() after a printed line (status 0: a
    job that reads as completed), --rerun-mode report_stats passes validation and is no mode
    of the rerun state machine (initialize_megatron's conversion), an enum flag's unknown name
    is a KeyError out of argparse, --enable-msc without multistorageclient a RuntimeError out
    of parse_args."""
    from megatron.core.rerun_state_machine import RerunMode

    with pytest.raises(SystemExit) as stopped:
        megatron_alone(monkeypatch, [*BASE, "--checkpoint-activations"])
    assert stopped.value.code is None  # the interpreter's exit status 0
    assert "--checkpoint-activations is no longer valid" in capsys.readouterr().out
    args = megatron_alone(monkeypatch, [*BASE, "--rerun-mode", "report_stats"])
    with pytest.raises(ValueError, match="'report_stats' is not a valid RerunMode"):
        RerunMode(args.rerun_mode)
    with pytest.raises(KeyError, match="flash_attn"):
        megatron_alone(monkeypatch, [*BASE, "--attention-backend", "flash_attn"])
    if importlib.util.find_spec("multistorageclient") is None:
        with pytest.raises(RuntimeError, match="multistorageclient package is not installed"):
            megatron_alone(monkeypatch, [*BASE, "--enable-msc"])


def test_without_the_check_no_pad_vocab_size_pads_and_fails_the_flops_count(monkeypatch):
    """What unpadded-vocabulary-size refuses, on megatron-core 0.19.2 alone: its tokenizer
    leaves the padded size unset, its GPT config then pads the vocabulary itself, and its FLOPs
    count (the first iteration's log line) multiplies by the missing size. With
    --padded-vocab-size the model gets exactly that many rows (the flag matrix trains it)."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.training import num_floating_point_operations

    args = megatron_alone(monkeypatch, with_launcher_defaults([*BASE, "--no-pad-vocab-size"]))
    build_tokenizer(args)
    config = gpt_config_from_args(args)
    assert args.padded_vocab_size is None and config.should_pad_vocab, config
    with pytest.raises(TypeError, match="NoneType"):
        num_floating_point_operations(args, args.global_batch_size)
    exact = checked_args(1, [*BASE, "--no-pad-vocab-size", "--padded-vocab-size", "520"],
                         monkeypatch)
    config = gpt_config_from_args(exact)
    assert (config.vocab_size, config.should_pad_vocab) == (520, False)


def test_without_the_check_megatron_exits_0_without_adlr_autoresume(monkeypatch, capsys):
    """What the --adlr-autoresume requirement refuses, on megatron-core 0.19.2: its globals look
    for ADLR's userlib and, without it, exit with status 0 on every rank."""
    from megatron.training.global_vars import _set_adlr_autoresume

    monkeypatch.setenv("SUBMIT_SCRIPTS", str(REPO / "examples"))  # a folder without userlib
    with pytest.raises(SystemExit) as stopped:
        _set_adlr_autoresume(types.SimpleNamespace(adlr_autoresume=True))
    assert stopped.value.code is None
    assert "ADLR autoresume is not available, exiting" in capsys.readouterr().out


def test_adlr_autoresume_passes_where_submit_scripts_holds_its_userlib(monkeypatch, tmp_path):
    """megatron imports ADLR's userlib from $SUBMIT_SCRIPTS (default: the working folder),
    which is not on sys.path before megatron adds it: the requirement looks there too."""
    from moe_launcher import dependencies

    monkeypatch.setenv("SUBMIT_SCRIPTS", str(tmp_path))
    assert not dependencies.installed(dependencies.ADLR_USERLIB)
    (tmp_path / "userlib").mkdir()
    (tmp_path / "userlib" / "__init__.py").write_text("")
    (tmp_path / "userlib" / "auto_resume.py").write_text("class AutoResume:\n    pass\n")
    assert dependencies.installed(dependencies.ADLR_USERLIB)
    assert judge(1, [*BASE, "--adlr-autoresume"], monkeypatch) is None


def test_pipeline_ucc_needs_a_torch_built_with_it(monkeypatch):
    """PyPI's torch has no UCC: megatron-core 0.19.2 failed on every rank as it made its
    pipeline groups with it (the flag sweep's training pass)."""
    if torch.distributed.is_ucc_available():
        pytest.skip("this torch has UCC: megatron can make its pipeline groups with it")
    line = judge(1, [*BASE, "--pipeline-model-parallel-comm-backend", "ucc"], monkeypatch)
    assert line is not None and "is_ucc_available() is False" in line, line


def test_msc_without_its_package_is_refused(monkeypatch, tmp_path):
    if importlib.util.find_spec("multistorageclient") is not None:
        pytest.skip("multistorageclient is installed: megatron takes --enable-msc")
    line = judge(1, [*BASE, "--enable-msc"], monkeypatch)
    assert line is not None and line.startswith("pretrain_moe: error: --enable-msc: "), line
    assert "pip install multi-storage-client" in line and "\n" not in line, line


def test_every_flag_alone_is_accepted_or_refused_in_one_line(monkeypatch):
    """Each of megatron-core's flags that takes no value, and an unknown name for each flag with
    choices, added alone to the tiny model: the checks before work accept it or refuse it in
    one line, and raise nothing else (a traceback, or megatron's exit() with status 0)."""
    import argparse

    from megatron.training.argument_utils import ArgumentGroupFactory
    from megatron.training.arguments import add_megatron_arguments

    from moe_launcher.runtime.refusals import PreflightError

    # megatron builds its parser anew at every parse and reads its config classes' source for
    # the help strings each time (~95% of a check's 0.13 s); they depend on the source only,
    # so this test reads each class once.
    read_docstrings = ArgumentGroupFactory._get_field_docstrings
    docstrings = {}

    def read_once(factory, config_class):
        if config_class not in docstrings:
            docstrings[config_class] = read_docstrings(factory, config_class)
        return dict(docstrings[config_class])

    monkeypatch.setattr(ArgumentGroupFactory, "_get_field_docstrings", read_once)
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    additions = []
    for action in parser._actions:
        flag = action.option_strings[0] if action.option_strings else None
        if flag is None or action.dest == "help" or flag in BASE:
            continue
        if action.nargs == 0:
            additions.append([flag])
        elif action.choices:
            additions.append([flag, "no-such-choice"])
    assert len(additions) > 300, len(additions)
    outcomes = {}
    for addition in additions:
        try:
            with monkeypatch.context() as scoped:
                checked_args(1, [*BASE, *addition], scoped)
            outcomes[" ".join(addition)] = "accepted"
        except PreflightError as refused:
            assert "\n" not in refused.line(), refused.line()
            outcomes[" ".join(addition)] = "refused"
        except BaseException as error:  # noqa: BLE001 -- what the test looks for
            outcomes[" ".join(addition)] = f"{type(error).__name__}: {error}"
    escaped = {flags: outcome for flags, outcome in outcomes.items()
               if outcome not in ("accepted", "refused")}
    assert escaped == {}, escaped
    assert all(outcomes[f"{flag} no-such-choice"] == "refused" for flag in
               ("--attention-backend", "--exit-signal", "--moe-token-dispatcher-type"))


def test_without_the_check_megatron_fails_on_attention_backend_local(monkeypatch):
    """What attention-backend-local refuses, megatron-core 0.19.2's own code: its validation
    fails on --attention-backend local without --spec local (a TypeError, indexing the unset
    --spec), and with it, importing --spec as its config builder does fails (ValueError)."""
    import contextlib
    import io
    import sys

    from megatron.core.transformer.spec_utils import import_module

    from moe_launcher.megatron_validation import parse_command_line, validated_args
    from moe_launcher.platform_defaults import with_platform_defaults
    from moe_launcher.runtime.refusals import PreflightError

    as_rank_0_of_one(monkeypatch)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # megatron's parser replaces it
    argv, _ = with_platform_defaults([*BASE, "--attention-backend", "local",
                                      "--eval-interval", "1000"], on_cpu=True)
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(PreflightError) as failed:
        validated_args(parse_command_line(argv))
    assert "TypeError" in str(failed.value) and "arguments.py" in str(failed.value)
    with contextlib.redirect_stdout(io.StringIO()):
        spec = validated_args(parse_command_line([*argv, "--spec", "local"])).spec
    with pytest.raises(ValueError):
        import_module(spec)


def test_gated_delta_net_at_tp_needs_sequence_parallelism():
    """Megatron-LM #7452 finding 11 (GPU only: GDN needs TE and flash-linear-attention, so the
    check is judged on the args): gated delta net layers (`G` in a hybrid pattern, or a GPT
    model's --experimental-attention-variant gated_delta_net, megatron's same GatedDeltaNet)
    at TP > 1 without --sequence-parallel are refused, naming the flag and the fix; with it, at
    TP 1, or without them, it passes."""
    import types

    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from moe_launcher.preflight import check_gated_delta_net_tensor_parallel_norm as check
    from moe_launcher.runtime.refusals import PreflightError

    # the GPT path builds the hybrid path's module (its spec names the class)
    assert "module=GatedDeltaNet" in inspect.getsource(specs.get_gated_delta_net_module_spec)
    assert specs.GatedDeltaNet is GatedDeltaNet

    def args(pattern, tp, sp, variant=None):
        return types.SimpleNamespace(hybrid_layer_pattern=pattern, hybrid_override_pattern=None,
                                     tensor_model_parallel_size=tp, sequence_parallel=sp,
                                     experimental_attention_variant=variant)

    for refused_args in (args("GGG*-E", 2, False), args(None, 2, False, "gated_delta_net")):
        with pytest.raises(PreflightError) as refused:
            check(refused_args)
        assert "--sequence-parallel" in str(refused.value) and "#7452" in str(refused.value)
    for fine in (args("GGG*-E", 2, True), args("GGG*-E", 1, False), args("MM*-E", 2, False),
                 args(None, 4, False), args(None, 2, True, "gated_delta_net"),
                 args(None, 2, False, "dsa")):
        assert check(fine) is None


# Learning-rate schedules on BASE (--train-iters 2, --lr 1e-3): the flag a refusal names, or
# None where megatron builds the schedule.
SCHEDULES = {
    "warmup-as-long-as-training": (["--lr-warmup-iters", "2"], "--lr-warmup-iters"),
    "warmup-shorter-than-training": (["--lr-warmup-iters", "1"], None),
    "warmup-as-long-as-the-decay": (["--train-iters", "4", "--lr-decay-iters", "2",
                                     "--lr-warmup-iters", "2"], "--lr-warmup-iters"),
    "decay-over-no-iterations": (["--lr-decay-iters", "0"], "--lr-decay-iters"),
    "warmup-fraction-of-one": (["--lr-warmup-fraction", "1.0"], "--lr-warmup-fraction"),
    "warmup-fraction-of-a-half": (["--lr-warmup-fraction", "0.5"], None),
    "samples-warmup-as-long-as-training": ([*without(BASE, "--train-iters", 1), "--train-samples",
                                            "32", "--lr-warmup-samples", "32"],
                                           "--lr-warmup-samples"),
    "samples-warmup-shorter": ([*without(BASE, "--train-iters", 1), "--train-samples", "32",
                                "--lr-warmup-samples", "16"], None),
    "wsd-without-its-decay": (["--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
    "wsd-with-its-decay": (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "1"], None),
    "min-lr-above-lr": (["--min-lr", "1e-2"], "--min-lr"),
    "negative-min-lr": (["--min-lr", "-1e-4"], "--min-lr"),
    "warmup-starting-above-lr": (["--lr-warmup-init", "1e-2"], "--lr-warmup-init"),
    "negative-weight-decay": (["--weight-decay", "-0.1"], "--weight-decay"),
    "falling-weight-decay": (["--weight-decay-incr-style", "linear", "--start-weight-decay",
                              "0.1", "--end-weight-decay", "0.01"], "--start-weight-decay"),
    "rising-weight-decay": (["--weight-decay-incr-style", "linear", "--start-weight-decay",
                             "0.01", "--end-weight-decay", "0.1"], None),
    "override-and-use-checkpoint-schedule": (["--override-opt_param-scheduler",
                                              "--use-checkpoint-opt_param-scheduler"],
                                             "--override-opt_param-scheduler"),
    "no-lr": (without(BASE, "--lr", 1), "--lr"),
}


def megatron_schedule_failure(argv: list[str]) -> str | None:
    """What megatron-core itself makes of these flags: its validation and then its
    get_optimizer_param_scheduler (which training runs after building the model) on the args it
    validated, this project's checks left out. None where it builds the schedule."""
    from megatron.training import global_vars, training

    from moe_launcher.megatron_validation import parse_command_line, validated_args
    from moe_launcher.runtime.refusals import PreflightError

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = validated_args(parse_command_line(with_launcher_defaults(argv)))
            global_vars.set_args(args)
            training.get_optimizer_param_scheduler(types.SimpleNamespace(param_groups=[{}]))
    except PreflightError as error:
        return error.line()  # megatron's validate_args failed (the launcher refuses that too)
    except Exception as error:  # noqa: BLE001 -- whatever megatron's scheduler raises
        return f"{type(error).__name__}: {error}"
    finally:
        global_vars.unset_global_variables()
    return None


@pytest.mark.parametrize("case", SCHEDULES)
def test_a_schedule_megatron_cannot_build_is_refused_before_work(case, monkeypatch):
    """megatron-core 0.19.2 builds the learning-rate schedule after the model: one it cannot run
    failed there on every rank (bare AssertionErrors; a TypeError without --lr). The reference
    is megatron's own get_optimizer_param_scheduler: the launcher refuses exactly the schedules
    it fails on, naming the flag."""
    extra, flag = SCHEDULES[case]
    argv = extra if extra[0] == BASE[0] else [*BASE, *extra]
    line = judge(1, argv, monkeypatch)
    megatron = megatron_schedule_failure(argv)
    if flag is None:
        assert (line, megatron) == (None, None)
        return
    assert megatron is not None, f"{case}: megatron builds this schedule"
    assert line is not None and line.startswith("pretrain_moe: error: "), (case, megatron)
    assert flag in line and "fix: " in line, line


def test_mtp_per_token_loss_passes_where_every_micro_batch_has_the_same_counts(monkeypatch):
    """Without --eod-mask-loss every micro-batch's original/rolled ratio is the step's
    (seq_length / (seq_length - 1) per MTP depth): megatron's weighting is exact, not refused."""
    assert judge(1, [*BASE, "--mtp-num-layers", "1", "--calculate-per-token-loss"],
                 monkeypatch) is None
    assert judge(1, [*BASE, "--mtp-num-layers", "1", "--eod-mask-loss"], monkeypatch) is None


def test_without_the_checks_megatron_fails_on_query_groups_and_drops_every_token():
    """What attention-head-groups and the capacity rule of router-top-k refuse, on megatron-core's
    own modules: its config takes 3 query groups for 4 heads and its attention then fails at the
    first forward; a capacity factor of 0 gives every expert room for no token, so megatron's
    token dropping empties the routing map (a MoE that trains no expert)."""
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    import _megatron_cpu as cpu

    model = cpu.build_gpt(cpu.tiny_config(num_query_groups=3), 16)
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        cpu.train_step_loss(model, batch=2, seq_length=16)

    probs = torch.rand(64, 8).softmax(-1)
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter(1, probs.topk(2).indices, True)
    _, kept = apply_router_token_dropping(probs, chosen, router_topk=2, capacity_factor=0.0)
    assert chosen.sum() == 128 and kept.sum() == 0


def test_a_negative_capacity_factor_is_megatrons_dropless_routing(monkeypatch):
    """megatron-core's TransformerConfig reads a negative --moe-expert-capacity-factor as None
    (dropless): accepted, as megatron trains it; 0 is refused (above)."""
    import _megatron_cpu as cpu

    assert cpu.tiny_config(num_moe_experts=4,
                           moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None
    assert judge(1, [*BASE, "--moe-expert-capacity-factor", "-1"], monkeypatch) is None


def _routing_map(load_balancing: str | list[str], coefficients: float | list[float]):
    """The first layer's routing of fixed logits in a megatron GPT built with these types."""
    import _megatron_cpu as cpu

    model = cpu.build_gpt(cpu.tiny_config(num_moe_experts=8, moe_router_topk=2,
                                          moe_router_load_balancing_type=load_balancing,
                                          moe_aux_loss_coeff=coefficients), 16)
    logits = torch.randn(32, 1, 8, generator=torch.Generator().manual_seed(0))
    return model.decoder.layers[0].mlp.router.routing(logits)[1]


def test_without_the_checks_megatron_routes_without_the_balancer_or_fails_at_the_first_forward():
    """What router-load-balancing refuses, on megatron-core's own modules: sinkhorn or quantile
    balancing in a list of types routes exactly as plain top-k (the balancer is never applied;
    alone, sinkhorn routes these logits otherwise); sinkhorn with an aux-loss coefficient,
    quantile balancing by groups and probabilities on the input at top-2 assert at the first
    forward."""
    import _megatron_cpu as cpu

    top_k = _routing_map("aux_loss", 0.01)
    for balancer in ("sinkhorn", "quantile_balancing"):
        assert torch.equal(_routing_map(["aux_loss", balancer], [0.01, 0.0]), top_k), balancer
    assert not torch.equal(_routing_map("sinkhorn", 0.0), top_k)

    for overrides, message in (
            (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01),
             "Sinkhorn routing does not support aux loss"),
            (dict(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0,
                  moe_router_num_groups=2, moe_router_group_topk=2),
             "does not support group-limited routing"),
            (dict(moe_apply_probs_on_input=True), "only works with `moe_router_topk`=1")):
        model = cpu.build_gpt(cpu.tiny_config(num_moe_experts=8, moe_router_topk=2,
                                              **overrides), 16)
        with pytest.raises(AssertionError, match=message):
            cpu.train_step_loss(model, batch=2, seq_length=16)


def test_without_the_check_megatron_fails_on_fp32_residuals_through_torch_norms():
    """What fp32-residual-local-norm refuses, on megatron-core's own local spec without apex
    (torch's norms): a bf16 GPT with fp32 residuals fails at its first forward; the same GPT
    without them trains. (megatron's arguments refuse fp32 residuals without bf16/fp16.)"""
    import _megatron_cpu as cpu

    def bf16_gpt(**config):
        return cpu.build_gpt(cpu.tiny_config(num_moe_experts=4, normalization="RMSNorm",
                                             bf16=True, params_dtype=torch.bfloat16, **config),
                             16).bfloat16()

    with pytest.raises(RuntimeError, match="dtype"):
        cpu.train_step_loss(bf16_gpt(fp32_residual_connection=True), batch=2, seq_length=16)
    assert torch.isfinite(cpu.train_step_loss(bf16_gpt(), batch=2, seq_length=16))


def test_megatron_fsdp_low_precision_main_weights_pass_without_clipping(monkeypatch):
    assert judge(1, [*BASE, *MEGATRON_FSDP, "--megatron-fsdp-main-params-dtype", "bf16",
                     "--clip-grad", "0"], monkeypatch) is None


# case -> (the check left out, what megatron-core 0.19.2 raises)
MEGATRON_FAILS = {
    "activation-dump-needs-transformer-engine": (
        "optional-packages", "TypeError: isinstance() arg 2 must be a type"),
    "dgrad-dump-needs-transformer-engine": (
        "optional-packages", "TypeError: isinstance() arg 2 must be a type"),
    # (on this machine without CUDA the worker's own check would refuse next)
    "persistent-checkpoint-worker-needs-nvrx": (
        "optional-packages,persistent-checkpoint-worker-without-cuda",
        "A compatible `nvidia-resiliency-ext` installation is required"),
    "sgd-with-the-distributed-optimizer": ("distributed-optimizer-state-function",
                                           "Only Adam, HybridDeviceOptimizer, and optimizers "
                                           "with an init_state_fn"),
    "megatron-fsdp-bf16-main-weights-clipped": ("megatron-fsdp-main-weights-clip",
                                                "assert param.grad.type() == "
                                                "'torch.cuda.FloatTensor'"),
    "megatron-fsdp-meta-device-with-cpu-initialization": (
        "megatron-fsdp-meta-device-cpu-initialization",
        "does not have a reset_parameters or _reset_parameters method"),
    "multiple-validation-sets-without-full-validation": (
        "validation-sets", "NotImplementedError: --multiple-validation-sets currently requires "
        "--full-validation"),
    "external-data-loader": ("external-data-loader",
                             "TypeError: 'MockGPTDataset' object is not an iterator"),
    "sharp-on-the-data-parallel-group": (
        "sharp-group", "AssertionError: data parallel group with CP (with GTP_remat) is not "
        "initialized"),
    # trains iteration 1, then its save fails (the refused command line's --save-interval 1)
    "torch-fsdp2-saving-torch-dist": ("checkpoint-format", "failed on rank 0: KeyError: 0"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", MEGATRON_FAILS)
def test_without_the_check_megatron_fails_on_these_choices(case, tmp_path):
    check, error = MEGATRON_FAILS[case]
    _, argv, _ = case_command_line(case, tmp_path / "ckpt")
    run = launch(1, argv, env={"PREFLIGHT_LEFT_OUT": check},
                 script=REPO / "tests" / "_preflight_left_out.py", timeout=300)
    assert run.returncode != 0 and error in run.log, run.log[-3000:]


@pytest.mark.slow
def test_without_the_check_the_tokens_per_expert_dump_is_never_written(tmp_path):
    """What tokens-per-expert-dump-experts refuses: megatron-core 0.19.2 trains the local spec's
    experts as asked, exit 0, and writes no tokens_per_expert dump into --save."""
    _, argv, _ = case_command_line("tokens-per-expert-dump-on-local-experts", tmp_path / "ckpt")
    run = launch(1, argv, env={"PREFLIGHT_LEFT_OUT": "tokens-per-expert-dump-experts"},
                 script=REPO / "tests" / "_preflight_left_out.py", timeout=300).check()
    assert "iteration        2/" in run.log, run.log[-3000:]
    assert sorted(os.listdir(tmp_path / "ckpt")) and not (tmp_path / "ckpt" /
                                                          "tokens_per_expert").exists()


def test_without_the_check_megatron_refuses_seed_0_as_it_seeds_every_rank():
    """What positive-sizes spares --seed 0 (a common choice): megatron-core's own seeding, which
    initialisation runs on every rank once process groups exist, raises on it."""
    from megatron.training.initialize import _set_random_seed

    with pytest.raises(ValueError, match="should be a positive integer"):
        _set_random_seed(0)


def test_wandb_needs_a_folder_of_its_own_or_save(monkeypatch, tmp_path):
    argv = [*BASE, "--wandb-project", "p", "--eval-interval", "1000"]
    line = judge(2, argv, monkeypatch)
    assert line is not None and "--wandb-save-dir" in line and "fix: " in line, line
    assert judge(2, [*argv, "--wandb-save-dir", str(tmp_path / "wandb")], monkeypatch) is None
    assert os.listdir(tmp_path) == []


def test_without_the_check_megatron_fails_one_rank_on_its_logging_folders(tmp_path):
    """What logging-folders spares a run: megatron-core's own global_vars make the TensorBoard
    writer and the wandb run on the last rank only, so an unwritable --tensorboard-dir, or wandb
    with neither --wandb-save-dir nor --save, fails that rank alone (torchrun stops the others;
    the launcher's refusal line is rank 0's, so the run stopped without a word why)."""
    import argparse

    from megatron.training import global_vars

    def made(rank: int, **flags):
        args = argparse.Namespace(**{
            "rank": rank, "world_size": 2, "tensorboard_dir": None, "tensorboard_queue_size": 1,
            "wandb_project": "", "wandb_exp_name": "t", "wandb_save_dir": None,
            "wandb_entity": "", "save": None, **flags})
        try:
            global_vars._set_tensorboard_writer(args)
            global_vars._set_wandb_writer(args)
            return None
        except Exception as error:  # noqa: BLE001 -- whatever megatron raises
            return type(error).__name__
        finally:
            global_vars.unset_global_variables()

    unwritable = {"tensorboard_dir": "/proc/tensorboard"}
    assert (made(0, **unwritable), made(1, **unwritable)) == (None, "FileNotFoundError")
    assert (made(0, wandb_project="p"), made(1, wandb_project="p")) == (None, "TypeError")


def test_without_the_check_megatron_raises_on_a_tracker_in_a_missing_folder(tmp_path):
    """What the result-rejected-tracker check spares every rank: megatron-core's own rerun state
    machine, made as megatron's initialisation makes it, raises on such a file."""
    from megatron.core.rerun_state_machine import RerunStateMachine

    with pytest.raises(RuntimeError, match="cannot be appended to"):
        RerunStateMachine(result_rejected_tracker_filename=str(tmp_path / "none" / "r.txt"))
    assert not (tmp_path / "none").exists()


def test_every_rank_of_a_world_refuses_and_rank_0_explains(tmp_path):
    save = tmp_path / "ckpt"
    world, argv, flag = case_command_line("ep-x-etp-exceeds-stage", save)
    started = time.monotonic()
    run = launch(world, argv, timeout=180)
    assert_refused(run, world, flag, save, time.monotonic() - started)


def test_help_lists_every_flag():
    """Every refusal of a flag megatron's parser rejects points at `pretrain_moe.py --help`.
    megatron-core 0.19.2's help of --moe-paged-stash-buffer-size-factor-cuda has a bare `%`,
    which argparse's help expansion rejects: the command died with a ValueError traceback."""
    run = launch(1, ["--help"], timeout=180)
    assert run.returncode == 0 and "Traceback" not in run.log, run.log[-3000:]
    assert "usage: pretrain_moe.py" in run.log, run.log[-3000:]
    # argparse's own rendering of megatron's help: the bare `%` printed as itself.
    assert "(e.g. 1.10 = 10%)." in run.log
    assert all(flag in run.log for flag in ("--moe-router-topk", "--expert-tensor-parallel-size",
                                            "--moe-paged-stash-buffer-size-factor-cuda"))


def test_unsupported_megatron_core_is_refused_with_status_2(tmp_path):
    dist_info = tmp_path / "site" / "megatron_core-0.18.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\n"
                                        "Version: 0.18.0\n")
    started = time.monotonic()
    run = launch(1, [*BASE, "--save", str(tmp_path / "ckpt"), "--save-interval", "1"],
                 env={"PYTHONPATH": f"{tmp_path / 'site'}:{REPO}"}, timeout=180)
    assert_refused(run, 1, "megatron-core 0.18.0", tmp_path / "ckpt", time.monotonic() - started)
    assert "MCORE=legacy bash scripts/setup.sh" in run.log


def test_every_rank_stops_and_one_rank_explains(tmp_path):
    save = tmp_path / "ckpt"
    started = time.monotonic()
    run = launch(2, [*BASE, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                     "2", "--save", str(save), "--save-interval", "1", "--eval-interval", "1000"],
                 timeout=180, torchrun=True)  # as users start it: torchrun stops the job early
    errors = [line for line in run.log.splitlines() if line.startswith("pretrain_moe: error:")]
    assert run.returncode != 0
    assert len(errors) == 1 and "--expert-model-parallel-size" in errors[0], errors
    # torchrun's report: the root cause is a rank that exited with the preflight status.
    assert "exitcode  : 2" in run.log, run.log[-3000:]
    assert 'pretrain_moe.py", line' not in run.log  # no traceback from the launcher itself
    assert not save.exists()
    assert time.monotonic() - started < 150


# The flags that build the model without initializing its weights (Megatron-FSDP aside).
UNINITIALIZED = ("--no-initialization", "--init-model-with-meta-device")


@pytest.mark.parametrize("flag", UNINITIALIZED)
def test_uninitialized_weights_need_a_checkpoint_to_load(flag, tmp_path, monkeypatch):
    """Refused where no checkpoint will be loaded (none at all, or the run's own --save before
    its first checkpoint); passes where --load, or megatron's fallback --pretrained-checkpoint,
    holds one."""
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "iter_0000002").mkdir(parents=True)
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("2")
    uninitialized = [*BASE, flag]
    own_save = ["--save", str(tmp_path / "run"), "--load", str(tmp_path / "run"),
                "--save-interval", "1"]
    for refused in ([], own_save):
        line = judge(1, [*uninitialized, *refused], monkeypatch)
        assert line is not None and line.startswith(f"pretrain_moe: error: {flag} "), line
    assert judge(1, [*uninitialized, "--load", str(checkpoint)], monkeypatch) is None
    assert judge(1, [*uninitialized, *own_save, "--pretrained-checkpoint", str(checkpoint)],
                 monkeypatch) is None


@pytest.mark.slow
def test_without_the_check_uninitialized_weights_are_memory_unless_a_checkpoint_loads(tmp_path):
    """What uninitialized-weights-need-a-checkpoint refuses, and what it lets through, on
    megatron-core 0.19.2 (1 rank): left out, a fresh run with either flag ends its first
    iteration with other weights (params norm) than the same run without it, which megatron
    initializes from the same seed; resumed from that run's checkpoint of iteration 2, the
    flag's run trains iterations 3 and 4 with the uninterrupted run's losses."""
    run = [*TINY_MODEL, "--train-iters", "4", "--log-params-norm"]
    checkpoint = tmp_path / "ckpt"
    reference = launch(1, [*run, "--save", str(checkpoint), "--save-interval", "2"],
                       timeout=300).check()
    initialized = printed_losses(reference.log, "params norm")
    expected = printed_losses(reference.log)
    for flag in UNINITIALIZED:
        fresh = launch(1, [*run, flag],
                       env={"PREFLIGHT_LEFT_OUT": "uninitialized-weights-need-a-checkpoint"},
                       script=REPO / "tests" / "_preflight_left_out.py", timeout=300)
        norms = printed_losses(fresh.log, "params norm")
        assert norms.get(1) != initialized[1], (flag, fresh.log[-3000:])
        resumed = launch(1, [*run, flag, "--load", str(checkpoint), "--ckpt-step", "2"],
                         timeout=300).check()
        assert printed_losses(resumed.log) == {3: expected[3], 4: expected[4]}, \
            (flag, resumed.log[-3000:])


def test_megatron_fsdp_refuses_a_torch_dist_load(tmp_path, monkeypatch):
    """Megatron-FSDP loads fsdp_dtensor checkpoints only: a torch_dist one (import-hf's, a DDP
    run's) died on every rank with KeyError: 'model' after the model was built (seen with an
    import at EP2 x ETP2); its metadata.json says which it is. An fsdp_dtensor one (torch DCP's
    .metadata, no metadata.json) passes."""
    import json

    fsdp_run = [*BASE, "--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format",
                "fsdp_dtensor"]
    for name, files in (("torch_dist", {"metadata.json": json.dumps(
            {"sharded_backend": "torch_dist"})}), ("fsdp_dtensor", {".metadata": ""})):
        iteration = tmp_path / name / "iter_0000002"
        iteration.mkdir(parents=True)
        for file, text in files.items():
            (iteration / file).write_text(text)
        (tmp_path / name / "latest_checkpointed_iteration.txt").write_text("2")
    line = judge(1, [*fsdp_run, "--load", str(tmp_path / "torch_dist")], monkeypatch)
    assert line == (f"pretrain_moe: error: --load {tmp_path / 'torch_dist' / 'iter_0000002'} is "
                    "a torch_dist checkpoint, but --use-megatron-fsdp loads fsdp_dtensor "
                    "checkpoints only (megatron-core 0.19.2 fails on every rank with KeyError: "
                    "'model'); fix: convert its weights with `python -m moe_launcher.convert "
                    f"to-fsdp-dtensor {tmp_path / 'torch_dist'} OUT_DIR` and --load OUT_DIR, or "
                    "train without --use-megatron-fsdp (--use-distributed-optimizer, "
                    "--ckpt-format torch_dist)"), line
    assert judge(1, [*fsdp_run, "--load", str(tmp_path / "fsdp_dtensor")], monkeypatch) is None
    assert judge(1, [*fsdp_run, "--load", str(tmp_path / "torch_dist"), "--ckpt-step", "7"],
                 monkeypatch) is None  # no such iteration: the load checks judge it


def test_without_the_check_adaptive_muon_dies_at_its_first_update():
    """What adaptive-muon-step refuses, on one rank: megatron builds the model and the optimizer,
    then it stops at the first update with emerging-optimizers 0.3.0's AttributeError."""
    from moe_launcher.preflight import adaptive_muon_step_failure

    failure = adaptive_muon_step_failure()
    assert failure == "'TensorParallelAdaptiveMuon' object has no attribute 'scale_mode'"
    run = launch(1, [*BASE, "--optimizer", "adaptive_muon"],
                 env={"PREFLIGHT_LEFT_OUT": "adaptive-muon-step"},
                 script=REPO / "tests" / "_preflight_left_out.py")
    assert run.exit_codes == [1], run.log[-3000:]
    assert "[megatron_patches] layer census:" in run.log  # the model and optimizer were built
    assert f"AttributeError: {failure}" in run.log
