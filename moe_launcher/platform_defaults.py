"""Flags the launcher supplies for the platform, so users pass the same command line everywhere.

Each default is added only when the user did not pass the flag (or its opposite) and is
reported with one log line saying why.
"""

import dataclasses
import os

import torch

from moe_launcher.command_line import flag_value
from moe_launcher.dependencies import TRANSFORMER_ENGINE, installed


@dataclasses.dataclass(frozen=True)
class PlatformDefault:
    flags: tuple[str, ...]  # the argv words to add
    reason: str

    def is_decided(self, argv: list[str]) -> bool:
        """True when the user already passed this flag (with any value)."""
        name = self.flags[0]
        return any(arg == name or arg.startswith(name + "=") for arg in argv)


# Without Transformer Engine / apex (CPU, or a bare GPU install) megatron's fused kernels and
# TE layers are unavailable.
WITHOUT_TE = (
    PlatformDefault(("--transformer-impl", "local"), "Transformer Engine is not installed: megatron's local spec"),
    PlatformDefault(("--no-rope-fusion",), "rope fusion needs Transformer Engine"),
    PlatformDefault(("--no-persist-layer-norm",), "persistent layer norm needs apex"),
    PlatformDefault(("--no-masked-softmax-fusion",), "fused softmax kernels need CUDA"),
    PlatformDefault(("--no-gradient-accumulation-fusion",), "gradient-accumulation fusion needs apex/TE"),
)
# With Transformer Engine: grouped-GEMM experts, the layout this project is tuned for.
WITH_TE = (
    PlatformDefault(("--moe-grouped-gemm",), "Transformer Engine present: grouped-GEMM experts"),
)
ON_CPU = (
    PlatformDefault(("--distributed-backend", "gloo"), "no CUDA: gloo process groups"),
    PlatformDefault(("--use-cpu-initialization",), "no CUDA: initialise weights on CPU (layout-independent init)"),
)


def platform_defaults(on_cpu: bool, have_te: bool) -> tuple[PlatformDefault, ...]:
    defaults = ON_CPU if on_cpu else ()
    return defaults + (WITH_TE if (have_te and not on_cpu) else WITHOUT_TE)


def with_platform_defaults(argv: list[str], on_cpu: bool | None = None,
                           have_te: bool | None = None) -> tuple[list[str], list[str]]:
    """Returns argv with the missing platform flags appended, and one log line per added flag."""
    on_cpu = (not torch.cuda.is_available()) if on_cpu is None else on_cpu
    have_te = installed(TRANSFORMER_ENGINE) if have_te is None else have_te
    return _add_missing(argv, platform_defaults(on_cpu, have_te))


def _add_missing(argv: list[str], defaults) -> tuple[list[str], list[str]]:
    """argv with the defaults the user did not decide appended, and one log line per default."""
    added, lines = [], []
    for default in defaults:
        if not default.is_decided(argv):
            added += default.flags
            lines.append(f"[pretrain_moe] default {' '.join(default.flags)}: {default.reason}")
    return argv + added, lines


# megatron's optimizers that orthogonalise each weight matrix's update (Muon's Newton-Schulz
# iteration), whose --muon-tp-mode says how a matrix sharded over tensor-parallel ranks is
# orthogonalised.
MUON_OPTIMIZERS = ("muon", "dist_muon", "adaptive_muon")


def _model_defaults(argv: list[str]) -> tuple[PlatformDefault, ...]:
    """Settings megatron defaults to but cannot train with, or trains another model with, for
    this command line."""
    defaults = []
    moe = flag_value(argv, "--num-experts") not in (None, "0")
    gated = "--swiglu" in argv or "--quick-geglu" in argv
    with_bias = "--disable-bias-linear" not in argv  # without bias megatron drops the fusion
    # megatron fuses bias + GELU by default (--no-bias-gelu-fusion turns it off), but its
    # config refuses that fusion for squared ReLU, and its expert MLP has no fused GELU with
    # the routing probabilities ("Only support fusion of swiglu and quick_gelu with
    # per_token_scale in MLP", at the first step).
    if with_bias and ("--squared-relu" in argv or (moe and not gated)):
        activation = "squared ReLU" if "--squared-relu" in argv else "GELU MoE experts"
        defaults.append(PlatformDefault(("--no-bias-gelu-fusion",),
                                        f"{activation}: megatron has no fused bias-activation "
                                        "kernel for them"))
    # megatron-core 0.19.2's --muon-tp-mode defaults to blockwise: each rank orthogonalises its
    # own shard of a tensor-parallel matrix (and scales it by the shard's shape), so the update,
    # and the model trained, change with --tensor-model-parallel-size or
    # --expert-tensor-parallel-size (a TP1 run and a TP2 one part from the second step on).
    # duplicated (its optimizer class's own default) orthogonalises the whole matrix, gathered,
    # as at TP1 (tests/moe_launcher/test_muon_cpu.py).
    sharded = _size(argv, "--tensor-model-parallel-size") > 1 or _size(
        argv, "--expert-tensor-parallel-size") > 1
    if flag_value(argv, "--optimizer") in MUON_OPTIMIZERS and sharded:
        defaults.append(PlatformDefault(
            ("--muon-tp-mode", "duplicated"),
            "megatron's blockwise default orthogonalises each tensor-parallel shard on its own, "
            "so the update would depend on the TP/ETP layout; duplicated orthogonalises whole "
            "matrices, as at TP 1 (--muon-tp-mode blockwise keeps megatron's)"))
    return tuple(defaults)


def with_model_defaults(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv with the model settings megatron would crash on replaced, unless the user decided."""
    return _add_missing(argv, _model_defaults(argv))


def with_logging_defaults(argv: list[str]) -> tuple[list[str], list[str]]:
    """With `--wandb-project`, the flags megatron needs to send loss and throughput to wandb: it
    logs scalars to wandb only through its TensorBoard writer, and throughput only with
    `--log-throughput --log-timers-to-tensorboard`."""
    if flag_value(argv, "--wandb-project") is None:
        return argv, []
    base = flag_value(argv, "--wandb-save-dir") or flag_value(argv, "--save") or "runs"
    return _add_missing(argv, (
        PlatformDefault(("--tensorboard-dir", os.path.join(base, "tensorboard")),
                        "wandb scalars go through megatron's TensorBoard writer"),
        PlatformDefault(("--log-throughput",), "throughput to the log and wandb"),
        PlatformDefault(("--log-timers-to-tensorboard",), "megatron sends throughput to wandb only with it"),
    ))


# megatron's rule (validate_args): with tensor or context parallelism a TP/CP communication
# kernel is queued before the GEMM that waits for it, and only one hardware queue per device
# (CUDA_DEVICE_MAX_CONNECTIONS=1) makes the GPU start it first, so megatron asserts that value
# before Blackwell. Torch FSDP2 and Megatron-FSDP assert the opposite (they overlap their own
# collectives on several queues), and --overlap-moe-expert-parallel-comm wants several queues
# (megatron only warns there). From Blackwell on megatron no longer requires it; its linear
# layers still recommend it for TP, so the default stays (export another value to override).
_PARALLEL_SIZES = ("--tensor-model-parallel-size", "--context-parallel-size")
_WANT_MANY_DEVICE_CONNECTIONS = ("--use-torch-fsdp2", "--use-megatron-fsdp",
                                 "--overlap-moe-expert-parallel-comm")


def _size(argv: list[str], flag: str) -> int:
    try:
        return int(flag_value(argv, flag) or 1)
    except ValueError:  # megatron's parser refuses it with its own message
        return 1


def _needs_one_device_connection(argv: list[str]) -> bool:
    """Whether megatron requires CUDA_DEVICE_MAX_CONNECTIONS=1 for this command line.

    Read from argv: megatron's parser takes no abbreviations, so these spellings are the only
    ones, and the launcher must decide before anything starts CUDA (see set_environment_defaults).
    """
    return (any(_size(argv, flag) > 1 for flag in _PARALLEL_SIZES)
            and not any(flag in argv for flag in _WANT_MANY_DEVICE_CONNECTIONS))


def set_environment_defaults(argv: list[str], environ) -> list[str]:
    """Sets environment variables megatron requires for this command line; returns log lines.

    pretrain_moe.py calls it before its first CUDA call: CUDA reads CUDA_DEVICE_MAX_CONNECTIONS
    when it initialises, so a value set later would pass megatron's check without taking
    effect. examples/moe/train.sh exports it for its recipes before Python starts; this covers
    pretrain_moe.py started any other way. A value already set wins.
    """
    if "CUDA_DEVICE_MAX_CONNECTIONS" in environ or not _needs_one_device_connection(argv):
        return []
    environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return ["[pretrain_moe] default CUDA_DEVICE_MAX_CONNECTIONS=1: megatron requires it for "
            "tensor/context parallelism without FSDP"]
