"""Model FLOPs of one global batch, from the layers megatron actually built.

megatron's `num_floating_point_operations` (megatron/training/training.py) counts layers from the
flags (wrong whenever #1778 bites), leaves out the router (2·h·E per token) and the shared-expert
gate, ignores capacity-factor dropping/padding, and in its hybrid branch counts MLA/DSA as zero.
This module counts every matmul of a GPT model, or of a HybridModel's attention, dense-MLP and
MoE layers (`*`, `+`, `-`, `E`; its hybrid branch also leaves out the router), from the layer
census and the model's TransformerConfig; `flops-from-layer-census` puts it in place of
megatron's function, which feeds the TFLOP/s/GPU log and the cumulative FLOPs saved in
checkpoints. A pattern with layers it does not model (Mamba `M`, GDN `G`, DSA `D`) keeps
megatron's formula, which models them, and says so. It reads both from the record
of the model built (moe_launcher/model/built_model.py), so it requires the `layer-census` patch; without it
megatron's formula stays.

Conventions (printed at startup): a matmul of m×n by n×k is 2·m·n·k; forward + backward is
3 × forward; causal self-attention counts half of the S×S score and value matmuls, as megatron
does (`causal_fraction=0.5`); norms, softmax and activations are not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from moe_launcher.runtime import collectives
from moe_launcher.model.layer_layout import LayerCensus
from megatron_patches import registry
from megatron_patches.accounting import layer_census  # registered first: this patch requires it
from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "flops-from-layer-census"

FORWARD_AND_BACKWARD = 3  # forward, backward w.r.t. inputs, backward w.r.t. weights
MEGATRON_CAUSAL_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class MLAShape:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


@dataclasses.dataclass(frozen=True)
class MoEShape:
    num_experts: int
    topk: int
    ffn: int
    shared_ffn: int
    shared_gate: bool
    latent: int | None
    capacity_factor: float | None
    pad_to_capacity: bool
    tokens_per_router_call: int  # tokens one router sees per micro-batch (capacity is per call)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden: int
    vocab: int  # padded vocabulary: the logits matmul runs over it
    heads: int
    query_groups: int
    kv_channels: int
    attention_output_gate: bool
    ffn: int
    gated: bool  # SwiGLU/GeGLU: fc1 produces two ffn-wide halves
    mla: MLAShape | None
    moe: MoEShape | None

    @classmethod
    def from_config(cls, config, vocab_size: int, micro_batch_size: int = 1,
                    seq_length: int = 1) -> ModelShape:
        mla = None
        if getattr(config, "multi_latent_attention", False):
            mla = MLAShape(config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim,
                           config.qk_pos_emb_head_dim, config.v_head_dim)
        moe = None
        if config.num_moe_experts:
            # With sequence parallelism each TP rank routes its own slice of the sequence.
            split = config.context_parallel_size * (
                config.tensor_model_parallel_size if config.sequence_parallel else 1)
            moe = MoEShape(
                num_experts=config.num_moe_experts,
                topk=config.moe_router_topk,
                ffn=config.moe_ffn_hidden_size or config.ffn_hidden_size,
                shared_ffn=config.moe_shared_expert_intermediate_size or 0,
                shared_gate=bool(config.moe_shared_expert_gate),
                latent=getattr(config, "moe_latent_size", None),
                capacity_factor=config.moe_expert_capacity_factor,
                pad_to_capacity=bool(config.moe_pad_expert_input_to_capacity),
                tokens_per_router_call=max(1, micro_batch_size * seq_length // split),
            )
        return cls(
            hidden=config.hidden_size, vocab=vocab_size, heads=config.num_attention_heads,
            query_groups=config.num_query_groups or config.num_attention_heads,
            kv_channels=config.kv_channels,
            attention_output_gate=bool(getattr(config, "attention_output_gate", False)),
            ffn=config.ffn_hidden_size, gated=bool(config.gated_linear_unit), mla=mla, moe=moe,
        )


def _mlp(h: int, ffn: int, gated: bool) -> int:
    """Per-token forward FLOPs of fc1 (two halves when gated) and fc2."""
    return 2 * h * ffn * (2 if gated else 1) + 2 * ffn * h


def attention_linear(s: ModelShape) -> int:
    """Per-token forward FLOPs of the attention projections."""
    h, n = s.hidden, s.heads
    if s.mla is None:
        q = n * s.kv_channels
        kv = 2 * s.query_groups * s.kv_channels
        gate = q if s.attention_output_gate else 0
        return 2 * h * (q + kv + gate) + 2 * q * h
    m = s.mla
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.q_lora_rank is None:
        q = 2 * h * n * q_head
    else:
        q = 2 * h * m.q_lora_rank + 2 * m.q_lora_rank * n * q_head
    kv_down = 2 * h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
    kv_up = 2 * m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim)
    out = 2 * n * m.v_head_dim * h
    return q + kv_down + kv_up + out


def attention_core(s: ModelShape) -> int:
    """Forward FLOPs of Q·K^T and P·V per unit of sequence length squared, full S×S."""
    if s.mla is None:
        return 2 * s.heads * s.kv_channels * 2
    m = s.mla
    return 2 * s.heads * (m.qk_head_dim + m.qk_pos_emb_head_dim) + 2 * s.heads * m.v_head_dim


def routed_rows(moe: MoEShape, tokens: float) -> float:
    """Token-expert rows the routed experts compute for `tokens` tokens.

    Without a capacity factor every token goes to top-k experts, so tokens·k rows however
    unbalanced the routing. With one, each router call caps every expert at
    ceil(T·k/E·cf) rows: padded to exactly that, or, when dropping without padding, at most that
    (an upper bound: how many are dropped depends on the routing).
    """
    if moe.capacity_factor is None:
        return tokens * moe.topk
    t = moe.tokens_per_router_call
    capacity = math.ceil(t * moe.topk / moe.num_experts * moe.capacity_factor)
    if moe.pad_to_capacity:
        per_call = moe.num_experts * capacity
    else:
        per_call = min(t * moe.topk, moe.num_experts * min(capacity, t))
    return tokens / t * per_call


def moe_mlp(s: ModelShape, tokens: float) -> float:
    """Forward FLOPs of one MoE layer's MLP for `tokens` tokens."""
    moe = s.moe
    h = s.hidden
    per_token = 2 * h * moe.num_experts  # router
    expert_width = h
    if moe.latent:
        per_token += 2 * h * moe.latent * 2  # fc1_latent_proj down, fc2_latent_proj up
        expert_width = moe.latent
    if moe.shared_ffn:
        per_token += _mlp(h, moe.shared_ffn, s.gated)
        per_token += 2 * h if moe.shared_gate else 0
    return tokens * per_token + routed_rows(moe, tokens) * _mlp(expert_width, moe.ffn, s.gated)


def forward_flops(s: ModelShape, census: LayerCensus, tokens: float, seqlen_squared_sum: float,
                  causal_fraction: float = MEGATRON_CAUSAL_FRACTION) -> float:
    """Forward FLOPs for `tokens` tokens in sequences whose squared lengths sum to the given."""
    attention_layers = census.attention + census.mtp_attention
    dense_layers = census.dense + census.mtp_dense
    moe_layers = census.moe_layers_with_mtp
    flops = attention_layers * (tokens * attention_linear(s)
                                + causal_fraction * seqlen_squared_sum * attention_core(s))
    flops += dense_layers * tokens * _mlp(s.hidden, s.ffn, s.gated)
    if moe_layers:
        flops += moe_layers * moe_mlp(s, tokens)
    flops += census.mtp * tokens * 2 * (2 * s.hidden) * s.hidden  # MTP eh_proj: [h; h] -> h
    flops += (1 + census.mtp) * tokens * 2 * s.hidden * s.vocab  # logits per output head
    return flops


def flops_per_batch(s: ModelShape, census: LayerCensus, tokens: float, seqlen_squared_sum: float,
                    causal_fraction: float = MEGATRON_CAUSAL_FRACTION) -> float:
    """Forward + backward FLOPs of one global batch."""
    return FORWARD_AND_BACKWARD * forward_flops(s, census, tokens, seqlen_squared_sum,
                                                causal_fraction)


def conventions(s: ModelShape) -> str:
    text = ("forward+backward = 3x forward; causal self-attention counts half of the SxS "
            "matmuls (megatron's convention); norms/softmax/activations not counted")
    if s.moe is not None and s.moe.capacity_factor is not None:
        text += ("; routed experts padded to capacity" if s.moe.pad_to_capacity else
                 "; routed experts at most at capacity (an upper bound, drops vary)")
    return text


# ---------------------------------------------------------------------------------------------
# Patch: replace megatron's num_floating_point_operations.
# ---------------------------------------------------------------------------------------------

def _report(shape: ModelShape, total: float) -> None:
    if collectives.rank() == 0:
        print(f"[megatron_patches] FLOPs: {conventions(shape)}", flush=True)
        print(f"FLOPs per iteration: {int(total)}", flush=True)


def unmodelled_families(pattern: str | None) -> str:
    """The layer symbols of a --hybrid-layer-pattern whose FLOPs this module does not count
    (Mamba, GDN, DSA: they build only with TE and their packages); '' for a GPT model."""
    if not pattern:
        return ""
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

    return "".join(symbol for symbol in (Symbols.MAMBA, Symbols.GDN, Symbols.DS_ATTENTION)
                   if symbol in pattern)


def _report_megatron_formula(pattern: str, families: str, total: float) -> None:
    if collectives.rank() == 0:
        print(f"[megatron_patches] FLOPs: megatron's formula for --hybrid-layer-pattern "
              f"{pattern!r} (the layer census does not model its {families!r} layers; "
              f"megatron's leaves out the router): {int(total)} per iteration", flush=True)


def _apply() -> None:
    from megatron.training import training
    if wrapped_by(training.num_floating_point_operations, NAME):
        return
    megatron_flops = training.num_floating_point_operations
    reported = []  # the record whose FLOPs per iteration were printed

    @functools.wraps(megatron_flops)
    def num_floating_point_operations(args, batch_size, seqlen_squared_sum_in_batch=None,
                                      total_real_tokens_in_batch=None):
        built = registry.record_of(layer_census.PATCH.name).built
        pattern = getattr(args, "hybrid_layer_pattern", None)
        families = unmodelled_families(pattern)
        if built is None or families:
            flops = megatron_flops(args, batch_size, seqlen_squared_sum_in_batch,
                                   total_real_tokens_in_batch)
            if built is not None and (not reported or reported[0] is not built):
                reported[:] = [built]
                _report_megatron_formula(pattern, families, megatron_flops(
                    args, args.global_batch_size))
            return flops
        shape = ModelShape.from_config(built.config, args.padded_vocab_size,
                                       args.micro_batch_size, args.seq_length)
        if not reported or reported[0] is not built:
            reported[:] = [built]
            _report(shape, flops_per_batch(shape, built.layers,
                                           args.global_batch_size * args.seq_length,
                                           args.global_batch_size * args.seq_length ** 2))
        tokens = total_real_tokens_in_batch
        if tokens is None:
            tokens = batch_size * args.seq_length
        squares = seqlen_squared_sum_in_batch
        if squares is None:
            squares = batch_size * args.seq_length ** 2
        return flops_per_batch(shape, built.layers, tokens, squares)

    num_floating_point_operations.__wrapped_by__ = NAME
    training.num_floating_point_operations = num_floating_point_operations


def _megatron_counts_router(hybrid_layer_pattern: str | None) -> bool:
    """Asks megatron's formula (its GPT branch, or its hybrid branch for a pattern): does a
    model with 64 experts cost more than one with 8?

    Same top-k, same expert width: the only difference is the router's 2·h·E per token.
    """
    from types import SimpleNamespace

    from megatron.training.training import num_floating_point_operations

    def args(num_experts: int) -> SimpleNamespace:
        return SimpleNamespace(
            hybrid_layer_pattern=hybrid_layer_pattern, group_query_attention=False,
            num_attention_heads=2, num_query_groups=2, kv_channels=8, hidden_size=16,
            ffn_hidden_size=32, num_layers=2, num_experts=num_experts, moe_layer_freq=1,
            moe_router_topk=2, mtp_num_layers=None, moe_ffn_hidden_size=32,
            moe_latent_size=None, moe_shared_expert_intermediate_size=None, swiglu=False,
            multi_latent_attention=False, attention_output_gate=False,
            experimental_attention_variant=None, padded_vocab_size=64, seq_length=16,
            mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=1, mamba_num_heads=2,
            linear_key_head_dim=None, linear_value_head_dim=None, linear_num_key_heads=None,
            linear_num_value_heads=None, linear_conv_kernel_dim=None)

    megatron_flops = registry.unwrapped(num_floating_point_operations)
    return megatron_flops(args(64), 1) != megatron_flops(args(8), 1)


def _not_needed(context: PatchContext) -> str | None:
    if _megatron_counts_router(None) and _megatron_counts_router("*E*E"):
        return "megatron-core's FLOPs formula already counts the router (GPT and hybrid)"
    return None


register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#1778",
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="replaces megatron.training.training.num_floating_point_operations with FLOPs of the "
            "layers built (router, shared-expert gate, capacity factor, MLA, MTP), GPT and "
            "HybridModel",
    not_needed_because=_not_needed,
    apply=_apply,
    requires=(layer_census.PATCH.name,),
))
