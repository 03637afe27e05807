"""The patch registry: every fix to megatron-core is a `Patch` registered here.

A patch names the upstream issue it addresses and the megatron-core versions it targets,
decides from behaviour (not only the version) whether it is needed, applies idempotently, and
reports one status line at startup. A patch that works through another names it in `requires`:
when that one is not applied (disabled, out of its versions, not needed) this one is skipped
too, saying why, so that no patch reports "applied" while it cannot work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import logging
import os
import warnings
from importlib.metadata import version as installed_version
from typing import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version


@dataclasses.dataclass(frozen=True)
class PatchContext:
    """What a patch may look at to decide whether it is needed."""

    megatron_version: Version
    cpu_backend: bool
    disabled: frozenset[str] = frozenset()  # names the user switched off (DISABLE_ENV)


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    upstream: str  # upstream issue/PR, or "local" for behaviour this project adds
    versions: str  # PEP 440 specifier of the megatron-core versions the patch targets
    summary: str
    # Returns None when the patch is needed, otherwise the reason it is not.
    not_needed_because: Callable[[PatchContext], str | None]
    apply: Callable[[], None]
    requires: tuple[str, ...] = ()  # patches registered before this one that it works through
    # megatron packages beyond megatron.core that the patch hooks or reads (megatron.training):
    # where one is not installed (megatron-core 0.15.x wheels ship without megatron.training)
    # the patch is skipped, saying so, before its probe runs.
    packages: tuple[str, ...] = ()
    # State the patch keeps for the patches that require it (e.g. layer-census's model record),
    # read through `record_of`: one object, registered, instead of a module global.
    record: object = None


@dataclasses.dataclass(frozen=True)
class PatchStatus:
    name: str
    applied: bool
    reason: str

    def line(self) -> str:
        verdict = "applied" if self.applied else "skipped"
        return f"[megatron_patches] {self.name}: {verdict} ({self.reason})"


_REGISTRY: dict[str, Patch] = {}
_APPLIED: dict[str, PatchStatus] = {}


def register(patch: Patch) -> Patch:
    if patch.name in _REGISTRY and _REGISTRY[patch.name] is not patch:
        raise ValueError(f"two patches are named {patch.name!r}")
    missing = [name for name in patch.requires if name not in _REGISTRY]
    if missing:
        raise ValueError(f"patch {patch.name!r} requires {missing}, which must be registered "
                         "(imported) before it")
    _REGISTRY[patch.name] = patch
    return patch


def record_of(name: str):
    """The record patch `name` keeps (see Patch.record); a patch reads only the records of the
    patches it requires."""
    return _REGISTRY[name].record


def registered() -> list[Patch]:
    return list(_REGISTRY.values())


# Comma-separated patch names to leave unapplied, e.g. to reproduce an upstream bug.
DISABLE_ENV = "MEGATRON_PATCHES_DISABLE"


def current_context(cpu_backend: bool) -> PatchContext:
    disabled = frozenset(filter(None, os.environ.get(DISABLE_ENV, "").split(",")))
    unknown = disabled - set(_REGISTRY)
    if unknown:
        raise ValueError(f"{DISABLE_ENV} names unknown patches {sorted(unknown)}; "
                         f"known: {sorted(_REGISTRY)}")
    return PatchContext(Version(installed_version("megatron-core")), cpu_backend, disabled)


def apply_patches(context: PatchContext) -> list[PatchStatus]:
    """Applies every registered patch that is needed; calling it again changes nothing."""
    statuses = []
    for patch in _REGISTRY.values():
        if patch.name in _APPLIED:
            statuses.append(_APPLIED[patch.name])
            continue
        unmet = [_APPLIED[name] for name in patch.requires if not _APPLIED[name].applied]
        if patch.name in context.disabled:
            status = PatchStatus(patch.name, False, f"disabled by {DISABLE_ENV}")
        elif unmet:
            status = PatchStatus(patch.name, False, f"needs {unmet[0].name}, {unmet[0].reason}")
        elif context.megatron_version not in SpecifierSet(patch.versions):
            status = PatchStatus(patch.name, False, f"targets megatron-core {patch.versions}, "
                                 f"running {context.megatron_version}")
        elif missing := [name for name in patch.packages if not _installed(name)]:
            status = PatchStatus(patch.name, False, f"{missing[0]} is not installed (megatron-core "
                                 f"{context.megatron_version} ships without it)")
        elif (reason := _probed(patch, context)) is not None:
            status = PatchStatus(patch.name, False, reason)
        else:
            patch.apply()
            status = PatchStatus(patch.name, True, f"{patch.summary}; {patch.upstream}")
        _APPLIED[patch.name] = status
        statuses.append(status)
    return statuses


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _probed(patch: Patch, context: PatchContext) -> str | None:
    """patch.not_needed_because, what its megatron code says dropped (probe_output_dropped)."""
    with probe_output_dropped():
        return patch.not_needed_because(context)


@contextlib.contextmanager
def probe_output_dropped():
    """Around a probe, megatron's log records, prints and warnings dropped: a probe runs megatron
    on objects of its own (a scheduler restored from a made-up state, a multi-latent attention
    config), and what megatron says of them read as if about the user's run (every run began
    with "using checkpoint value 1.0 for learning rate" and warnings about multi-latent attention
    rope fusion a model without it never uses). What the probe decides, and any error it raises,
    stand. Preflight's calls of a patch's probe use it too."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def wrapped_by(function, name: str) -> bool:
    """Whether `function` or one it wraps (functools.wraps' __wrapped__ chain) is patch `name`'s
    wrapper: two patches may wrap the same megatron function, in either order."""
    while function is not None:
        if getattr(function, "__wrapped_by__", None) == name:
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def unwrapped(function):
    """megatron's own function under every patch's wrapper."""
    while getattr(function, "__wrapped__", None) is not None:
        function = function.__wrapped__
    return function


# Every patch module, imported (and so registered) by load_patches(), in the order applied.
PATCH_MODULES = (
    "megatron_patches.accounting.megatron_logging_setup",
    "megatron_patches.build.dataset_helpers_prebuilt",
    "megatron_patches.build.local_norm_sequence_parallel",
    "megatron_patches.build.attention_sink_tensor_parallel",
    "megatron_patches.build.local_mla_core_attention",
    "megatron_patches.build.mla_q_projection_without_norm",
    "megatron_patches.build.mla_yarn_flags",
    "megatron_patches.build.cpu_initialization_to_device",
    "megatron_patches.checkpointing.moe_norm_checkpoint_key",
    "megatron_patches.checkpointing.mla_norm_checkpoint_keys",
    "megatron_patches.checkpointing.distopt_torch_adam_resume",
    "megatron_patches.checkpointing.sgd_resume_state",
    "megatron_patches.checkpointing.distopt_reshardable_bucket_offsets",
    "megatron_patches.checkpointing.distopt_save_before_first_step",
    "megatron_patches.checkpointing.plain_optimizer_save_before_first_step",
    "megatron_patches.checkpointing.torch_dcp_optimizer_load",
    "megatron_patches.moe.router_token_counts_fp32",
    "megatron_patches.moe.token_drop_by_position",
    "megatron_patches.moe.expert_bias_counts_routed_tokens",
    "megatron_patches.moe.mla_shared_rope_key_gradient",
    "megatron_patches.moe.qk_clip_distributed_optimizer",
    "megatron_patches.moe.qk_clip_every_attention_layer",
    "megatron_patches.moe.qk_clip_negative_logits",
    "megatron_patches.checkpointing.scheduler_resume_weight_decay",
    "megatron_patches.checkpointing.exit_signal_one_sync",
    "megatron_patches.checkpointing.sync_save_thread_results_queue",
    "megatron_patches.checkpointing.sync_save_no_async_deprecation",
    "megatron_patches.moe.global_aux_loss_dp_scale",
    "megatron_patches.checkpointing.expert_rng_per_ep_rank",
    "megatron_patches.fsdp.fsdp_dtensor_rng_per_tp_rank",
    "megatron_patches.fsdp.fsdp_tp_rng_streams",
    "megatron_patches.fsdp.fsdp_dtensor_fp32_swiglu_keys",
    "megatron_patches.moe.expert_load_metrics",
    "megatron_patches.moe.rerun_restores_moe_step_state",
    "megatron_patches.checkpointing.rerun_iteration_number",
    "megatron_patches.checkpointing.rerun_without_save",
    "megatron_patches.checkpointing.skipped_iteration_reads_every_rank",
    "megatron_patches.checkpointing.skipped_iteration_ends_rerun",
    "megatron_patches.checkpointing.resumed_run_checks_first_iteration",
    "megatron_patches.accounting.layer_layout_validation",
    "megatron_patches.accounting.layer_census",
    "megatron_patches.moe.moe_aux_loss_per_built_layer",
    "megatron_patches.moe.moe_mtp_repeated_z_loss",
    "megatron_patches.accounting.flops_from_layer_census",
    "megatron_patches.accounting.mfu_log",
    "megatron_patches.accounting.first_log_interval_reset",
    "megatron_patches.accounting.skipped_interval_loss_line",
    "megatron_patches.accounting.full_validation_single_set",
    "megatron_patches.accounting.moe_loss_names_by_type",
    "megatron_patches.accounting.loss_over_real_vocabulary",
    "megatron_patches.accounting.fused_cross_entropy_gradient_dtype",
    "megatron_patches.accounting.parameter_census",
    "megatron_patches.accounting.activation_memory_report",
    "megatron_patches.fsdp.fsdp_expert_etp_sharding",
    "megatron_patches.fsdp.fsdp_dtensor_optimizer_keys",
    "megatron_patches.fsdp.fsdp_one_rank_grad_scaling",
    "megatron_patches.fsdp.fsdp_fused_wgrad_accumulation",
    "megatron_patches.fsdp.fsdp_model_to_main_weights",
    "megatron_patches.fsdp.fsdp_fp16_empty_shard_grads",
    "megatron_patches.fsdp.fsdp_dtensor_loss_scale",
    "megatron_patches.fsdp.fsdp_dtensor_release_load",
    "megatron_patches.fsdp.fsdp_dtensor_batched_chunk_metadata",
    "megatron_patches.checkpointing.torch_format_shard_guard",
    "megatron_patches.checkpointing.torch_format_ckpt_step",
    "megatron_patches.checkpointing.checkpoint_completeness_guard",
    "megatron_patches.checkpointing.checkpoint_load_guard",
    "megatron_patches.checkpointing.atomic_checkpoint_commit",
    "megatron_patches.checkpointing.checkpoint_load_integrity",
)


def load_patches() -> list[Patch]:
    import importlib

    for module in PATCH_MODULES:
        importlib.import_module(module)
    return registered()
