#!/usr/bin/env python
"""Dry-run planner for MoE pretraining commands: checks a parallel layout without a GPU.

    python examples/moe/plan.py --world-size 32 -- <megatron-LM flags...>

Adds the flags and environment pretrain_moe.py adds on a GPU node, parses them with megatron's
own parser (megatron.training.arguments.parse_args, so flag parsing is identical to the real
run), checks the layout arithmetic against the world size (the per-stage layer split with
moe_launcher.model.layer_layout) and runs the launcher's other checks of the flags (not those of
files and packages: the dry run may run on another machine), runs megatron's validate_args and
TransformerConfig checks on a simulated H100, and prints the layout, the per-GPU parameter +
optimizer memory estimate, Megatron-FSDP's communication buffers (moe_launcher.fsdp_buffers), the
activations (moe_launcher.activation_memory; a warning where the busiest GPU would not hold
them) and the model FLOPs
(megatron_patches.accounting.flops_from_layer_census, the same numbers the training log
prints). Nothing is trained, no process group is created. Exits 1 (and names the flag and the
fix) when the layout cannot run, 2 when the flags do not parse.

Used by `DRY_RUN=1 bash examples/moe/train.sh` / `bash examples/moe/train.sh --dry-run`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import logging
import os
import sys
import warnings
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 1024**3

from moe_launcher import preflight  # noqa: E402
from moe_launcher.preflight import Layout, moe_pattern  # noqa: E402,F401
from moe_launcher.runtime.refusals import PreflightError  # noqa: E402


class PlanError(PreflightError):
    """A layout the world size cannot run; the message names the flag and the fix."""

    def __init__(self, message: str, flag: str = ""):
        super().__init__(flag, message)


from megatron_patches.accounting.flops_from_layer_census import ModelShape, flops_per_batch  # noqa: E402
from moe_launcher.model.layer_layout import LayerCensus, expected_moe_layers  # noqa: E402
from moe_launcher import fsdp_buffers, megatron_validation, optimizer_state  # noqa: E402
from moe_launcher.platform_defaults import (  # noqa: E402
    set_environment_defaults, with_logging_defaults, with_platform_defaults)


# --------------------------------------------------------------------------------------------
# Parsing with megatron's parser
# --------------------------------------------------------------------------------------------
def launcher_view(flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """The flags and environment pretrain_moe.py hands megatron on an H100 with Transformer
    Engine: its platform and logging defaults, and its environment defaults."""
    flags, _ = with_platform_defaults(list(flags), on_cpu=False, have_te=True)
    flags, _ = with_logging_defaults(flags)
    env = {k: v for k, v in os.environ.items() if k == "CUDA_DEVICE_MAX_CONNECTIONS"}
    set_environment_defaults(flags, env)
    return flags, env


def parse_megatron_flags(flags: list[str], world_size: int):
    """megatron's parser on `flags` as pretrain_moe.py runs it, as rank 0 of `world_size` ranks;
    a parser error raises PreflightError."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size)}
    with mock.patch.dict(os.environ, env), mock.patch.object(sys, "argv", ["pretrain_moe.py"]), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # argparse 'type' deprecation
        return megatron_validation.parse_command_line(flags)


@contextlib.contextmanager
def simulated_hopper():
    """Lets megatron's GPU/TE-dependent checks run on a CPU-only machine, as if on an H100 in
    the NGC image: compute capability 9.0, Transformer Engine new enough, fused RoPE present."""
    import torch
    import megatron.training.arguments as margs
    import megatron.core.transformer.transformer_config as tcfg
    import megatron.core.models.common.embeddings.rope_utils as rope

    def te_stub(*args, **kwargs):
        raise RuntimeError("dry run: Transformer Engine kernel stub called")

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_capability",
                                              return_value=(9, 0)))
        stack.enter_context(mock.patch.object(margs, "get_device_arch_version", return_value=9))
        # (megatron's argument checks import their own name of it: --qk-clip and
        # --log-max-attention-logit ask for TE >= 2.9 there)
        for module in (tcfg, margs):
            stack.enter_context(mock.patch.object(module, "is_te_min_version",
                                                  return_value=True))
        if getattr(rope, "fused_apply_rotary_pos_emb", None) is None:
            stack.enter_context(mock.patch.object(rope, "fused_apply_rotary_pos_emb", te_stub,
                                                  create=True))
        yield


# --------------------------------------------------------------------------------------------
# Layout arithmetic: moe_launcher.preflight, the same checks pretrain_moe.py runs at startup
# --------------------------------------------------------------------------------------------
def check_layout(args) -> Layout:
    """Raises PreflightError (a PlanError here) naming the flag and the fix for the first
    arithmetic that fails."""
    return preflight.check_layout(args)


def run_megatron_validation(args, env: dict[str, str]):
    """megatron's validation and model config on a copy of the args (simulated H100), as
    pretrain_moe.py runs them (moe_launcher.megatron_validation); a failure raises
    PreflightError quoting megatron's message."""
    view = copy.deepcopy(args)
    # (megatron's validation reads the run's result-rejected tracker for iterations to skip, and
    # logs an ERROR where it does not exist yet; the dry run reads no files of the run)
    view.result_rejected_tracker_filename = None
    out = io.StringIO()
    environ = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    environ.update(env)
    with simulated_hopper(), warnings.catch_warnings(), contextlib.redirect_stdout(out), \
            mock.patch.dict(os.environ, environ, clear=True):
        warnings.simplefilter("ignore")
        view = megatron_validation.validated_args(view)
        return view, megatron_validation.model_config(view)


# --------------------------------------------------------------------------------------------
# Parameters, memory, FLOPs
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Counts:
    attention: int  # per layer: its weight matrices
    dense_mlp: int  # per dense layer
    expert: int  # one routed expert
    shared: int  # shared experts of one MoE layer
    router: int
    norms: int  # per layer: its parameters that are not matrices (norms, attention biases)
    embedding: int
    output: int  # 0 when tied
    final_norm: int
    padded_vocab: int


def padded_vocab(args) -> int:
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    return vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)


def count_parameters(args) -> Counts:
    h = args.hidden_size
    n = args.num_attention_heads
    head = args.kv_channels or h // n
    gated = 3 if args.swiglu else 2
    norm = h if args.normalization == "RMSNorm" else 2 * h
    vectors = 2 * norm
    if args.multi_latent_attention:
        qk = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank:
            q = h * args.q_lora_rank + args.q_lora_rank * n * qk
            vectors += args.q_lora_rank
        else:
            q = h * n * qk
        kv = (h * (args.kv_lora_rank + args.qk_pos_emb_head_dim)
              + args.kv_lora_rank * n * (args.qk_head_dim + args.v_head_dim))
        vectors += args.kv_lora_rank
        attention = q + kv + n * args.v_head_dim * h
    else:
        groups = args.num_query_groups if args.group_query_attention else n
        attention = h * (n + 2 * groups) * head + n * head * h
        if args.qk_layernorm:
            vectors += 2 * head
    if args.add_bias_linear:  # projection biases (MLP biases are left out: small)
        vectors += 4 * h
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    vocab = padded_vocab(args)
    return Counts(
        attention=attention,
        dense_mlp=gated * h * args.ffn_hidden_size,
        expert=gated * h * moe_ffn if args.num_experts else 0,
        shared=gated * h * (args.moe_shared_expert_intermediate_size or 0),
        router=h * (args.num_experts or 0),
        norms=vectors,
        embedding=vocab * h,
        output=0 if not args.untie_embeddings_and_output_weights else vocab * h,
        final_norm=norm,
        padded_vocab=vocab,
    )


def totals(args, c: Counts, pattern: list[int]) -> tuple[int, int]:
    """(total parameters, parameters active per token)."""
    moe_layers = sum(pattern)
    dense_layers = len(pattern) - moe_layers
    E, k = args.num_experts or 0, args.moe_router_topk
    base = (len(pattern) * (c.attention + c.norms) + dense_layers * c.dense_mlp
            + moe_layers * (c.shared + c.router) + c.embedding + c.output + c.final_norm)
    return base + moe_layers * E * c.expert, base + moe_layers * k * c.expert


@dataclasses.dataclass
class Memory:
    dense_params: int  # non-expert parameters on the busiest GPU
    expert_params: int
    weights: float  # bytes
    grads: float
    optimizer: float
    optimizer_not_modelled: str  # what of the optimizer's state is priced as Adam's

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def mtp_layer_is_moe(layout: Layout) -> bool:
    """megatron builds each MTP layer with the decoder's last layer's spec (MoE or dense)."""
    return bool(layout.moe_pattern) and bool(layout.moe_pattern[-1])


def mtp_layer_parameters(args, c: Counts, layout: Layout) -> tuple[int, int, int]:
    """One MTP layer's parameters: (not matrices, matrices, routed experts). megatron's decoder
    layer of the last decoder layer's kind, two input norms, the projection of the concatenated
    embedding and hidden state (2h x h) and a final norm."""
    moe = mtp_layer_is_moe(layout)
    matrices = c.attention + 2 * args.hidden_size ** 2 + (
        c.shared + c.router if moe else c.dense_mlp)
    return (c.norms + 3 * c.final_norm, matrices,
            (args.num_experts or 0) * c.expert if moe else 0)


def memory_per_gpu(args, c: Counts, layout: Layout) -> Memory:
    """Parameter + gradient + optimizer bytes on the busiest GPU (activations excluded): each
    pipeline stage priced, the most expensive kept (by bytes: the distributed optimizer shards
    dense and expert state over different numbers of ranks)."""
    return busiest(stage_memories(args, c, layout))


def busiest(stages: list[Memory]) -> Memory:
    """The stage that needs the most bytes."""
    return max(stages, key=lambda memory: memory.total)


def weight_bytes(args) -> int:
    return 2 if (args.bf16 or args.fp16) else 4


def fsdp_grad_bytes(args) -> int:
    """Megatron-FSDP keeps gradients in --megatron-fsdp-main-grads-dtype, whose default ('auto')
    is the parameters' dtype."""
    return {"fp32": 4, "bf16": 2, "fp16": 2}.get(args.megatron_fsdp_main_grads_dtype,
                                                weight_bytes(args))


def stage_memories(args, c: Counts, layout: Layout) -> list[Memory]:
    """Parameter + gradient + optimizer bytes of a GPU of each pipeline stage."""
    stage_sizes = layout.stages if layout.stages[0] >= 0 else [
        args.num_layers // layout.pp] * layout.pp
    low = weight_bytes(args)
    grad = 4  # megatron's fp32 main grads
    optimizer = optimizer_state.state_bytes(args)  # fp32 main copy + the optimizer's state
    dense_shard = layout.dp * layout.cp
    if args.use_megatron_fsdp:
        grad = fsdp_grad_bytes(args)
        strategy = args.data_parallel_sharding_strategy
        shard_w = strategy == "optim_grads_params"
        shard_g = strategy in ("optim_grads_params", "optim_grads")
        shard_o = strategy != "no_shard"
    else:
        shard_w = shard_g = False
        # (--optimizer dist_muon: megatron's layer-wise distributed optimizer without the flag)
        shard_o = args.use_distributed_optimizer or args.optimizer == "dist_muon"
    experts = args.num_experts or 0
    mtp = args.mtp_num_layers or 0
    mtp_scalar, mtp_matrices, mtp_experts = mtp_layer_parameters(args, c, layout)

    def stage_memory(dense: int, expert: int, scalar: int) -> Memory:
        def part(nbytes: int, sharded: bool) -> float:
            return nbytes * (dense / (dense_shard if sharded else 1)
                             + expert / (layout.edp if sharded else 1))

        dense_divisor = dense_shard if shard_o else 1
        optimizer_bytes = optimizer.of(
            (dense - scalar) / dense_divisor + expert / (layout.edp if shard_o else 1),
            scalar / dense_divisor)
        return Memory(dense, expert, part(low, shard_w), part(grad, shard_g), optimizer_bytes,
                      optimizer.not_modelled)

    stages = []
    start = 0
    for s, n_layers in enumerate(stage_sizes):
        pat = layout.moe_pattern[start:start + n_layers]
        start += n_layers
        moe_layers, dense_layers = sum(pat), len(pat) - sum(pat)
        # (the parameters that are not weight matrices: Muon-family optimizers give them to
        # another optimizer)
        scalar = n_layers * c.norms
        if s == 0:
            scalar += c.embedding
        matrices = n_layers * c.attention + dense_layers * c.dense_mlp + moe_layers * (
            c.shared + c.router)
        routed = moe_layers * experts * c.expert
        if s == layout.pp - 1:
            scalar += c.final_norm + (c.output if c.output else (
                c.embedding if layout.pp > 1 else 0))
            # the MTP layers, which embed their input with a copy of the embedding (the output
            # layer's, where tied)
            scalar += mtp * mtp_scalar
            if mtp and layout.pp > 1 and c.output:
                scalar += c.embedding
            matrices += mtp * mtp_matrices
            routed += mtp * mtp_experts
        expert = routed // (layout.ep * layout.etp)
        stages.append(stage_memory((scalar + matrices) // layout.tp, expert, scalar // layout.tp))
    return stages


def fsdp_units(args, c: Counts, layout: Layout) -> tuple[list[fsdp_buffers.FsdpUnit], int]:
    """Megatron-FSDP's units (each decoder layer, then each MTP layer's transformer layer) on one
    GPU before sharding, and the elements outside them that it gathers (embedding, output layer, final
    norm, each MTP layer's input norms, projection and final norm). Megatron-FSDP runs without a
    pipeline."""
    tp, experts = layout.tp, args.num_experts or 0
    dense_sharded, expert_sharded = layout.dp * layout.cp > 1, layout.edp > 1

    def unit(moe: bool) -> fsdp_buffers.FsdpUnit:
        if not moe:
            return fsdp_buffers.FsdpUnit((fsdp_buffers.BucketGroup(
                (c.attention + c.dense_mlp) // tp + c.norms, dense_sharded),))
        non_expert = (c.attention + c.shared) // tp + c.norms + c.router  # the router whole
        return fsdp_buffers.FsdpUnit((
            fsdp_buffers.BucketGroup(non_expert, dense_sharded),
            fsdp_buffers.BucketGroup(experts * c.expert // (layout.ep * layout.etp),
                                     expert_sharded)))

    mtp = args.mtp_num_layers or 0
    units = [unit(bool(moe)) for moe in layout.moe_pattern] + [unit(mtp_layer_is_moe(layout))] * mtp
    kept = (c.embedding + c.output) // tp + c.final_norm + mtp * (
        3 * c.final_norm + 2 * args.hidden_size ** 2 // tp)
    return units, kept if dense_sharded else 0


def fsdp_buffers_per_gpu(args, c: Counts, layout: Layout) -> fsdp_buffers.FsdpBuffers | None:
    """Megatron-FSDP's gathered weights and unsharded gradients at their peak
    (moe_launcher.fsdp_buffers) with the run's --suggested-communication-unit-size (megatron's
    default without it), for optim_grads_params without --fsdp-double-buffer (whose fixed pools
    megatron sizes otherwise); None otherwise."""
    if (not args.use_megatron_fsdp or args.data_parallel_sharding_strategy != "optim_grads_params"
            or args.fsdp_double_buffer):
        return None
    units, kept = fsdp_units(args, c, layout)
    return fsdp_buffers.peak_buffers(units, kept, weight_bytes(args), fsdp_grad_bytes(args),
                                     args.suggested_communication_unit_size)


def flops_per_iteration(args, config, layout: Layout) -> int:
    """Model FLOPs of one global batch, computed by megatron_patches.accounting.flops_from_layer_census exactly as the
    training log's `FLOPs per iteration:` line, on the layer census the flags ask for."""
    moe = expected_moe_layers(args.num_layers, args.num_experts, args.moe_layer_freq)
    stages = layout.stages if layout.stages[0] >= 0 else []
    mtp = args.mtp_num_layers or 0
    mtp_moe = mtp if mtp_layer_is_moe(layout) else 0
    census = LayerCensus(dense=args.num_layers - moe, moe=moe, attention=args.num_layers,
                         mtp=mtp, per_stage=stages, mtp_attention=mtp, mtp_moe=mtp_moe,
                         mtp_dense=mtp - mtp_moe)
    shape = ModelShape.from_config(config, padded_vocab(args), args.micro_batch_size,
                                   args.seq_length)
    batch = args.global_batch_size
    tokens = batch * args.seq_length
    return int(flops_per_batch(shape, census, tokens, batch * args.seq_length ** 2))


def activations_per_gpu(args, config, layout: Layout, states: list[Memory],
                        buffers: float = 0.0) -> float:
    """Prints the activation estimate (moe_launcher.activation_memory) and the busiest GPU's
    total (its stage's parameters and optimizer, its activations and `buffers`, Megatron-FSDP's
    communication buffers); returns that total."""
    from moe_launcher import activation_memory

    microbatches = args.global_batch_size // (args.micro_batch_size * layout.dp)
    ranks = activation_memory.rank_activations(args, config, layout.moe_pattern,
                                               padded_vocab(args), microbatches)
    fullest = max(range(len(ranks)), key=lambda r: states[r].total + ranks[r].total)
    peak, state = ranks[fullest], states[fullest]
    print(f"[plan] {activation_memory.estimate_said(args, layout.moe_pattern, 'te', size)}")
    print(f"[plan] busiest GPU (pipeline stage {fullest}): "
          f"{activation_memory.peak_said(args, peak, size)}"
          + f" + parameters and optimizer {size(state.total)}"
          + (f" + Megatron-FSDP buffers {size(buffers)}" if buffers else "")
          + f" = {size(state.total + peak.total + buffers)}")
    for note in activation_memory.not_modelled_said(args):
        print(f"[plan] activations: {note}")
    return state.total + peak.total + buffers


def human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


# --------------------------------------------------------------------------------------------
def quiet_imports() -> None:
    """Import torch/megatron without their CPU-only warnings (no CUDA, no TE, no apex)."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.training.arguments  # noqa: F401


def size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= 0.1 * GIB else f"{nbytes / 1024**2:.1f} MiB"


def plan(flags: list[str], world_size: int, gpu_memory_gib: float = 80.0,
         vocab_size_hint: int | None = None) -> int:
    quiet_imports()
    flags, env = launcher_view(flags)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_megatron_flags(flags, world_size)
    except PreflightError as exc:
        print(f"dry run FAILED: {exc}", file=sys.stderr)
        return 2
    if args.vocab_size is None:
        args.vocab_size = vocab_size_hint  # a tokenizer's vocabulary; only for the estimates
    try:
        if args.num_layers is None or args.hidden_size is None or args.vocab_size is None:
            raise PlanError("--num-layers, --hidden-size and --vocab-size (or a vocab size hint "
                            "for a tokenizer) are needed for the estimates")
        layout = check_layout(args)
        preflight.check_flags(args)  # what the launcher refuses for these flags on any machine
        validated, config = run_megatron_validation(args, env)
    except PreflightError as exc:
        print(f"dry run FAILED: {exc}", file=sys.stderr)
        return 1

    if validated.hybrid_layer_pattern:
        print(layout.line())
        # The estimates below count GPT layers (attention + MLP each); printing them for a
        # HybridModel would be the #1778 class of error in the planner itself.
        print(f"[plan] megatron validate_args and TransformerConfig accept the flags; "
              f"--hybrid-layer-pattern {validated.hybrid_layer_pattern!r}: parameter, memory and "
              f"FLOPs estimates are not modelled for HybridModel (the training log's census and "
              f"FLOPs lines count the model built)")
        print("[plan] dry run OK: nothing was started")
        return 0
    counts = count_parameters(args)
    total, active = totals(args, counts, layout.moe_pattern)
    stages = stage_memories(args, counts, layout)
    mem = busiest(stages)
    flops = flops_per_iteration(validated, config, layout)
    tokens = args.global_batch_size * args.seq_length
    print(layout.line())
    print(f"[plan] layer split checked by moe_launcher.model.layer_layout; megatron validate_args "
          f"and TransformerConfig accept the flags (simulated H100 with Transformer Engine"
          f"{', ' + ' '.join(f'{k}={v}' for k, v in env.items()) if env else ''})")
    mtp = args.mtp_num_layers or 0
    in_mtp = (f" (+ {human(mtp * sum(mtp_layer_parameters(args, counts, layout)))} in "
              f"{mtp} MTP layer{'s' if mtp > 1 else ''})" if mtp else "")
    print(f"[plan] parameters: total {human(total)}{in_mtp}, active per token {human(active)}; "
          f"{sum(layout.moe_pattern)} MoE + {args.num_layers - sum(layout.moe_pattern)} dense "
          f"layers, {args.num_experts or 0} experts top-{args.moe_router_topk}")
    print(f"[plan] per-GPU shard of the busiest stage, before DP/FSDP sharding: "
          f"{human(mem.dense_params)} non-expert + {human(mem.expert_params)} expert parameters")
    kind = ("Megatron-FSDP " + args.data_parallel_sharding_strategy if args.use_megatron_fsdp
            else "distributed optimizer" if args.use_distributed_optimizer
            else "replicated optimizer")
    print(f"[plan] per-GPU memory ({kind}): weights {size(mem.weights)} + grads "
          f"{size(mem.grads)} + optimizer {size(mem.optimizer)} = {size(mem.total)} of "
          f"{gpu_memory_gib:g} GiB (activations and communication buffers not included)")
    buffers = fsdp_buffers_per_gpu(args, counts, layout)
    if buffers is not None:
        unit = ("--suggested-communication-unit-size" if args.suggested_communication_unit_size
                is not None else "megatron's default communication unit")
        print(f"[plan] Megatron-FSDP buffers (moe_launcher.fsdp_buffers, {unit} of "
              f"{human(buffers.communication_unit)} elements): gathered weights "
              f"{size(buffers.weights)} + unsharded gradients {size(buffers.grads)} = "
              f"{size(buffers.total)} at their peak")
    elif args.use_megatron_fsdp:
        setting = ("--fsdp-double-buffer" if args.fsdp_double_buffer else
                   f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}")
        print(f"[plan] Megatron-FSDP buffers: not modelled for {setting} (not counted)")
    with_activations = activations_per_gpu(validated, config, layout, stages,
                                           buffers.total if buffers else 0.0)
    if mem.optimizer_not_modelled:
        print(f"[plan] optimizer memory: {mem.optimizer_not_modelled} is not modelled; priced "
              f"as fp32 Adam moments")
    print(f"[plan] model FLOPs per token: {flops // tokens} ({human(flops / tokens)}; "
          f"megatron_patches.accounting.flops_from_layer_census, forward+backward, causal attention halved)")
    print(f"FLOPs per iteration: {flops}")
    if mem.total > gpu_memory_gib * GIB:
        print(f"dry run FAILED: parameters + optimizer need {mem.total / GIB:.1f} GiB per GPU, "
              f"more than {gpu_memory_gib:g} GiB; fix: raise --expert-model-parallel-size / "
              f"--pipeline-model-parallel-size or run on more nodes", file=sys.stderr)
        return 1
    if with_activations > gpu_memory_gib * GIB:
        print(f"[plan] WARNING: with activations the busiest GPU needs "
              f"{with_activations / GIB:.1f} GiB, "
              f"more than {gpu_memory_gib:g} GiB (an estimate: not refused); fix: "
              f"--recompute-granularity full --recompute-method uniform --recompute-num-layers "
              f"1 (or selective, --recompute-modules moe), or a smaller --micro-batch-size"
              + (f", or a smaller --suggested-communication-unit-size (Megatron-FSDP's "
                 f"buffers {size(buffers.total)} at a unit of "
                 f"{human(buffers.communication_unit)} elements)" if buffers else ""))
    print("[plan] dry run OK: nothing was started")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, flags = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--world-size", type=int,
                        default=int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1))),
                        help="ranks the command will run on (default: $WORLD_SIZE, $SLURM_NTASKS)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory of one GPU, for the fit check (default 80: H100 80GB)")
    parser.add_argument("--vocab-size-hint", type=int, default=None,
                        help="vocabulary size for the estimates when a tokenizer supplies it")
    opts, rest = parser.parse_known_args(argv)
    return plan(rest + flags, opts.world_size, opts.gpu_memory_gib, opts.vocab_size_hint)


if __name__ == "__main__":
    sys.exit(main())
