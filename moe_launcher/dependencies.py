"""Which Megatron-LM features need which optional package, and the refusal when one is missing.

megatron accepts these flags on any install and fails only once it uses the feature: after
process groups and the model are built, or at the first step (DeepEP's dispatcher, TE's
permute and router fusions and grouped GEMM, FP8, userbuffers, the HuggingFace tokenizer's
NameError, NVRx's persistent async-save worker as megatron initialises and its fault tolerance
after the model, NVML's device memory at the first log line; ADLR's autoresume, whose absence
megatron answers with exit status 0). Each
row of `REQUIREMENTS` names a feature, how to tell the command line asks for it, and the
package it needs; a command line that asks for a feature whose package is not importable is
refused before any work, with the install or the flag to drop. Where the package is present
the flag passes unchanged. The persistent async-save worker also needs a CUDA device.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import os
import sys
from typing import Callable

from moe_launcher.preflight import preflight_check
from moe_launcher.runtime.refusals import PreflightError


@dataclasses.dataclass(frozen=True)
class Package:
    module: str  # the import name whose presence decides
    install: str  # how to get it
    # a folder megatron adds to sys.path before it imports the module: (variable, default)
    search_path: tuple[str, str] | None = None


TRANSFORMER_ENGINE = Package("transformer_engine",
                             "install Transformer Engine (the NGC PyTorch image has it)")
DEEP_EP = Package("deep_ep", "install DeepEP (github.com/deepseek-ai/DeepEP)")
TRANSFORMERS = Package("transformers", "pip install transformers")
SENTENCEPIECE = Package("sentencepiece", "pip install sentencepiece")
TIKTOKEN = Package("tiktoken", "pip install tiktoken")
NVIDIA_RESILIENCY = Package("nvidia_resiliency_ext", "pip install nvidia-resiliency-ext")
NVML = Package("pynvml", "pip install nvidia-ml-py")
# megatron-core 0.19.2 imports ADLR's userlib.auto_resume from $SUBMIT_SCRIPTS (default: the
# working folder) and, where it is missing, prints so and calls sys.exit(): status 0.
ADLR_USERLIB = Package("userlib", "put ADLR's userlib (with auto_resume) in $SUBMIT_SCRIPTS",
                       search_path=("SUBMIT_SCRIPTS", "."))


def _persistent_checkpoint_worker(args) -> bool:
    """megatron starts its persistent async-save worker only with both flags (it turns
    --async-save off, with a warning, without --use-persistent-ckpt-worker)."""
    return bool(args.async_save and getattr(args, "use_persistent_ckpt_worker", False))


@dataclasses.dataclass(frozen=True)
class Requirement:
    flag: str  # the flag as the user wrote it, named in the refusal
    asks: Callable  # (megatron's parsed args) -> whether this command line uses the feature
    package: Package
    alternative: str  # the flag change that avoids the feature


REQUIREMENTS = (
    Requirement("--moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend deepep)",
                lambda a: a.moe_token_dispatcher_type == "flex"
                and a.moe_flex_dispatcher_backend == "deepep",
                DEEP_EP, "--moe-token-dispatcher-type alltoall"),
    Requirement("--moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend hybridep)",
                lambda a: a.moe_token_dispatcher_type == "flex"
                and a.moe_flex_dispatcher_backend == "hybridep",
                DEEP_EP, "--moe-token-dispatcher-type alltoall"),
    Requirement("--transformer-impl transformer_engine",
                lambda a: a.transformer_impl == "transformer_engine",
                TRANSFORMER_ENGINE, "pass --transformer-impl local"),
    Requirement("--moe-permute-fusion", lambda a: a.moe_permute_fusion,
                TRANSFORMER_ENGINE, "drop --moe-permute-fusion"),
    Requirement("--moe-router-fusion", lambda a: a.moe_router_fusion,
                TRANSFORMER_ENGINE, "drop --moe-router-fusion"),
    Requirement("--moe-grouped-gemm", lambda a: a.moe_grouped_gemm,
                TRANSFORMER_ENGINE, "drop --moe-grouped-gemm"),
    Requirement("--fp8-format", lambda a: a.fp8 is not None,
                TRANSFORMER_ENGINE, "drop --fp8-format (train in --bf16)"),
    Requirement("--fp4-format", lambda a: getattr(a, "fp4", None) is not None,
                TRANSFORMER_ENGINE, "drop --fp4-format (train in --bf16)"),
    Requirement("--tp-comm-overlap", lambda a: a.tp_comm_overlap,
                TRANSFORMER_ENGINE, "drop --tp-comm-overlap"),
    Requirement("--moe-latent-size", lambda a: a.moe_latent_size is not None,
                TRANSFORMER_ENGINE, "drop --moe-latent-size"),
    Requirement("--use-precision-aware-optimizer", lambda a: a.use_precision_aware_optimizer,
                TRANSFORMER_ENGINE, "drop --use-precision-aware-optimizer"),
    Requirement("--tokenizer-type HuggingFaceTokenizer",
                lambda a: a.tokenizer_type == "HuggingFaceTokenizer",
                TRANSFORMERS, "another --tokenizer-type"),
    Requirement("--tokenizer-type SentencePieceTokenizer/GPTSentencePieceTokenizer/"
                "Llama2Tokenizer",
                lambda a: a.tokenizer_type in ("SentencePieceTokenizer",
                                               "GPTSentencePieceTokenizer", "Llama2Tokenizer"),
                SENTENCEPIECE, "another --tokenizer-type"),
    Requirement("--tokenizer-type TikTokenizer", lambda a: a.tokenizer_type == "TikTokenizer",
                TIKTOKEN, "another --tokenizer-type"),
    # megatron-core 0.19.2's activation and dgrad dumps hook module types it lists with
    # Transformer Engine's classes, None without TE: a TypeError at the first iteration.
    Requirement("--save-activations-interval",
                lambda a: getattr(a, "save_activations_interval", None) is not None,
                TRANSFORMER_ENGINE, "drop --save-activations-interval"),
    Requirement("--save-dgrads-interval",
                lambda a: getattr(a, "save_dgrads_interval", None) is not None,
                TRANSFORMER_ENGINE, "drop --save-dgrads-interval"),
    # megatron-core 0.19.2 imports these once it has started: after the model (fault
    # tolerance's rank monitor client) or at the first log line (torch's NVML device memory).
    Requirement("--enable-ft-package", lambda a: a.enable_ft_package,
                NVIDIA_RESILIENCY, "drop --enable-ft-package"),
    Requirement("--log-device-memory-used", lambda a: a.log_device_memory_used,
                NVML, "drop --log-device-memory-used"),
    Requirement("--adlr-autoresume", lambda a: a.adlr_autoresume,
                ADLR_USERLIB, "drop --adlr-autoresume"),
    # megatron-core 0.19.2 starts the worker in initialize_megatron, on every rank:
    # ModuleNotFoundError from get_async_strategy where NVRx is missing (the default strategy).
    Requirement("--use-persistent-ckpt-worker (--async-save, --async-strategy nvrx)",
                lambda a: _persistent_checkpoint_worker(a)
                and getattr(a, "async_strategy", None) == "nvrx",
                NVIDIA_RESILIENCY, "add --async-strategy mcore"),
)


def installed(package: Package) -> bool:
    if package.search_path is None:
        return importlib.util.find_spec(package.module) is not None
    variable, default = package.search_path
    folders = [*sys.path, os.environ.get(variable, default)]
    return importlib.machinery.PathFinder.find_spec(package.module, folders) is not None


def first_missing(args, available: Callable[[Package], bool] = installed) -> Requirement | None:
    """The first requirement this command line asks for whose package is not available."""
    return next((r for r in REQUIREMENTS if r.asks(args) and not available(r.package)), None)


@preflight_check("optional-packages", machine=True)
def check_optional_packages(args) -> None:
    missing = first_missing(args)
    if missing:
        flag = missing.flag.split()[0]
        raise PreflightError(flag,
                             f"{missing.flag} needs the `{missing.package.module}` package, "
                             f"which is not installed; fix: {missing.package.install}, or "
                             f"{missing.alternative}")


@preflight_check("persistent-checkpoint-worker-without-cuda", machine=True)
def check_persistent_checkpoint_worker_without_cuda(args) -> None:
    # megatron-core 0.19.2's persistent async-save worker (--async-save with
    # --use-persistent-ckpt-worker; megatron turns --async-save off without it) picks its CUDA
    # device as `rank % torch.cuda.device_count()`: on a machine without CUDA the worker dies of a
    # ZeroDivisionError at the first save, and every rank waits for it forever.
    if not _persistent_checkpoint_worker(args):
        return
    import torch

    # (not device_count: the CPU backend counts one virtual device in this process)
    if not torch.cuda.is_available():
        raise PreflightError("--use-persistent-ckpt-worker",
                             "--async-save with --use-persistent-ckpt-worker on a machine without "
                             "CUDA: megatron's save worker picks a CUDA device, dies at the first "
                             "save and every rank then waits for it forever; fix: drop "
                             "--use-persistent-ckpt-worker and --async-save (saves are then "
                             "synchronous), or run on GPUs")
