"""Activation memory of a megatron-core GPT MoE run on one GPU, from its parsed flags: what each
decoder layer keeps for its backward per micro-batch, how many micro-batches each pipeline rank
holds at once under megatron's schedule, and what recompute leaves of them. The dry-run
planner's figure (examples/moe/plan.py).

A layer's figure is the sum of the tensors autograd keeps (judged against the tensors megatron's
own layer keeps under torch's saved-tensor hooks, on the local spec, in
tests/moe_launcher/test_activation_memory_cpu.py). Two kernel families keep different tensors
for the same layer, and the figure is stated for either:
* "te" (Transformer Engine, the GPU path): a norm keeps its input and an fp32 1/rms a token;
  flash attention keeps q, k, v, its output and an fp32 log-sum-exp a head and token (no
  s x s scores; k and v with their own number of heads);
* "local" (megatron's local spec on CPU, the tests' reference): its torch norms keep an fp32 copy
  of their input and an fp32 normalised output; its attention keeps k and v repeated to every
  query head and the softmax of the s x s scores of every head (with attention dropout, also
  the dropped-out scores and their mask); torch's CPU dropout keeps its masks in the
  activation dtype, CUDA's as bools.
Not modelled: routing imbalance (experts get their average share of tokens), FP8 activations,
CUDA graphs, communication buffers and the allocator's fragmentation.
Targets megatron-core 0.19.x.
"""

from __future__ import annotations

import dataclasses
import math
import types

FP32 = 4
INDEX = 8  # int64

# --recompute-modules this model prices (others are counted as kept, and said so): what each
# frees as megatron's TransformerConfig.recompute_modules describes it; core_attn and moe are
# judged against a run (moe_act needs grouped GEMM and mla_up_proj Transformer Engine: not run
# on CPU).
MODELLED_RECOMPUTE = ("core_attn", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One micro-batch as one rank sees it."""

    tokens: float  # tokens of the micro-batch on this rank's context-parallel slice
    sequence_tokens: float  # tokens where sequence parallelism splits them over TP
    act: int  # bytes of an activation element
    kernels: str  # "te" or "local"
    positions: float  # sequence positions on this rank's context-parallel slice

    @property
    def mask(self) -> int:
        """Bytes of a dropout mask element (a bool on CUDA)."""
        return self.act if self.kernels == "local" else 1

    @classmethod
    def of(cls, args, kernels: str = "te") -> Shape:
        tokens = args.seq_length * args.micro_batch_size / args.context_parallel_size
        split = args.tensor_model_parallel_size if args.sequence_parallel else 1
        return cls(tokens, tokens / split, 2 if (args.bf16 or args.fp16) else 4, kernels,
                   args.seq_length / args.context_parallel_size)


def norm_bytes(args, shape: Shape, width: int, tokens: float, heads: int = 1) -> float:
    """A norm over `width` on `tokens` x `heads` rows: its input and per-row statistics."""
    rows = tokens * heads
    if shape.kernels == "local":
        return rows * (2 * FP32 * width + FP32)
    statistics = FP32 * (2 if args.normalization == "LayerNorm" else 1)  # mean, 1/rms
    return rows * (shape.act * width + statistics)


def core_attention_bytes(args, shape: Shape, heads: int, kv_heads: int, qk_dim: int,
                         v_dim: int) -> float:
    """q, k and v as the attention kernel keeps them, and its softmax statistics."""
    t, a = shape.tokens, shape.act
    if shape.kernels == "local":  # k and v repeated to every query head
        return a * t * heads * (2 * qk_dim + v_dim) + softmax_bytes(args, shape, heads)
    return a * t * (heads * qk_dim + kv_heads * (qk_dim + v_dim)) + softmax_bytes(
        args, shape, heads)


def softmax_bytes(args, shape: Shape, heads: int) -> float:
    """What the attention's softmax keeps: Transformer Engine's flash attention an fp32
    log-sum-exp a head and token; the local spec the softmax of the s x s scores of every head,
    with dropout also the dropped-out scores and the mask."""
    if shape.kernels != "local":
        return FP32 * shape.tokens * heads
    scores = args.micro_batch_size * heads * args.seq_length ** 2
    dropout = (shape.act + shape.mask) * scores if args.attention_dropout > 0 else 0
    return shape.act * scores + dropout


def attention_parts(args, shape: Shape) -> dict[str, float]:
    tp, t, ts, a = args.tensor_model_parallel_size, shape.tokens, shape.sequence_tokens, shape.act
    h = args.hidden_size
    heads = args.num_attention_heads // tp
    parts = {"input norm": norm_bytes(args, shape, h, ts)}
    if args.multi_latent_attention:
        qk, rope, v = args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim
        # the input norm's output, which the q and kv down-projections share
        projections = a * h * ts + a * args.kv_lora_rank * ts
        norms = norm_bytes(args, shape, args.kv_lora_rank, ts)
        if args.q_lora_rank:
            projections += a * args.q_lora_rank * ts
            norms += norm_bytes(args, shape, args.q_lora_rank, ts)
        if not args.apply_rope_fusion:  # megatron's unfused RoPE keeps a cos and a sin for q, k
            projections += 4 * a * rope * shape.positions
        parts["attention norms"] = norms
        parts["core attention"] = core_attention_bytes(args, shape, heads, heads, qk + rope, v)
        parts["attention projections"] = projections + a * heads * v * t  # + linear_proj's input
        return parts
    d = args.kv_channels or h // args.num_attention_heads
    groups = (args.num_query_groups if args.group_query_attention
              else args.num_attention_heads)
    kv_heads = max(1, groups // tp)
    if args.qk_layernorm:  # q and k before their norms
        parts["attention norms"] = (norm_bytes(args, shape, d, t, heads)
                                    + norm_bytes(args, shape, d, t, kv_heads))
    parts["core attention"] = core_attention_bytes(args, shape, heads, kv_heads, d, d)
    parts["attention projections"] = a * h * ts + a * heads * d * t
    if args.position_embedding_type == "rope" and not args.apply_rope_fusion:
        # megatron's unfused RoPE keeps a cos and a sin for q and k (a position each)
        rotated = int(d * args.rotary_percent)
        parts["attention projections"] += 4 * a * rotated * shape.positions
        if shape.kernels == "local" and kv_heads == heads:
            # (the local spec's v, not repeated, stays a view of the whole QKV output)
            parts["core attention"] += a * 2 * kv_heads * d * t
    return parts


def _mlp_bytes(args, shape: Shape, ffn: float, tokens: float) -> tuple[float, float]:
    """(fc1's output, fc2's input) of an MLP of width `ffn` on `tokens`."""
    gated = 2 if args.swiglu else 1
    return shape.act * gated * ffn * tokens, shape.act * ffn * tokens


def mlp_parts(args, shape: Shape, moe: bool) -> dict[str, float]:
    tp, t, ts, a = args.tensor_model_parallel_size, shape.tokens, shape.sequence_tokens, shape.act
    h = args.hidden_size
    # the pre-MLP norm's output: fc1's input, or the router's, shared experts' and permutation's
    parts = {"pre-MLP norm": norm_bytes(args, shape, h, ts) + a * h * ts}
    if not moe:
        parts["MLP"] = sum(_mlp_bytes(args, shape, args.ffn_hidden_size / tp, t))
        return parts
    parts["router"] = router_bytes(args) * ts
    etp = args.expert_tensor_parallel_size or tp
    # token copies this rank's experts compute, on average (padded to the experts' capacity
    # with --moe-pad-expert-input-to-capacity)
    routed = ts * args.moe_router_topk * etp
    if args.moe_expert_capacity_factor and args.moe_pad_expert_input_to_capacity:
        experts = args.num_experts
        routed = math.ceil(ts * args.moe_router_topk * args.moe_expert_capacity_factor
                           / experts) * experts * etp
    fc1, fc2 = _mlp_bytes(args, shape, args.moe_ffn_hidden_size / etp, routed)
    parts["experts"] = a * h * routed + fc1 + FP32 * routed  # + the routing probabilities
    parts["expert activation"] = fc2
    shared = args.moe_shared_expert_intermediate_size
    if shared:
        parts["shared experts"] = sum(_mlp_bytes(args, shape, shared / tp, t))
        if args.moe_shared_expert_gate:  # its output and gate, for the gated sum
            parts["shared experts"] += a * (h + 1) * t
    return parts


def router_bytes(args) -> int:
    """What the router and the permutation keep a token (megatron's router, the same on both
    kernel families; measured per option in the tests)."""
    experts, k = args.num_experts, args.moe_router_topk
    kept = INDEX * k + FP32 * k  # the top-k indices and probabilities
    if args.moe_router_pre_softmax:
        kept += FP32 * experts - FP32 * k  # the softmax over every expert, gathered from
    if args.moe_router_score_function == "sigmoid":
        kept += FP32 * experts + FP32  # the scores, their sum over the top k
    if args.moe_router_num_groups:
        kept += INDEX * args.moe_router_num_groups + experts  # the groups' top, a bool mask
    balancing = args.moe_router_load_balancing_type
    balancing = balancing if isinstance(balancing, list) else [balancing]
    if args.moe_aux_loss_coeff and any(kind != "none" for kind in balancing):
        kept += FP32 * experts + INDEX * k  # the scores and choices the loss is taken of
        if "seq_aux_loss" in balancing:
            kept += INDEX * k + FP32
    return kept + INDEX * (experts + k)  # + the permutation's sort order


def layer_parts(args, moe: bool, kernels: str = "te") -> dict[str, float]:
    """Bytes one decoder layer keeps for its backward, a micro-batch, on one rank, by part."""
    shape = Shape.of(args, kernels)
    parts = {**attention_parts(args, shape), **mlp_parts(args, shape, moe)}
    if args.hidden_dropout > 0:  # the masks of the two dropout-adds
        parts["dropout"] = 2 * shape.mask * args.hidden_size * shape.sequence_tokens
    return parts


def layer_input_bytes(args) -> float:
    """What a recomputed layer keeps: its input."""
    shape = Shape.of(args)
    return shape.act * args.hidden_size * shape.sequence_tokens


def selective_recompute_saves(args, parts: dict[str, float], kernels: str) -> float:
    """Bytes --recompute-granularity selective frees of a layer with these parts."""
    modules = set(args.recompute_modules or ())
    freed = 0.0
    shape = Shape.of(args, kernels)
    heads = args.num_attention_heads // args.tensor_model_parallel_size
    if "core_attn" in modules:  # (q, k and v stay, as the checkpoint's inputs)
        freed += softmax_bytes(args, shape, heads)
    if "mla_up_proj" in modules and args.multi_latent_attention:
        freed += _mla_qkv_bytes(args, shape, heads)
    if "moe" in modules:
        freed += sum(parts.get(p, 0) for p in ("router", "experts", "expert activation",
                                               "shared experts"))
    else:
        if "moe_act" in modules:
            freed += parts.get("expert activation", 0)
        if "shared_experts" in modules:
            freed += parts.get("shared experts", 0)
    if "mlp" in modules:
        freed += parts.get("MLP", 0)
    return freed


def _mla_qkv_bytes(args, shape: Shape, heads: int) -> float:
    """MLA's q, k and v (every head)."""
    qk = args.qk_head_dim + args.qk_pos_emb_head_dim
    return shape.act * shape.tokens * heads * (2 * qk + args.v_head_dim)


# --------------------------------------------------------------------------------------------
# A pipeline rank's layers and megatron's schedule
# --------------------------------------------------------------------------------------------
def chunk_layers(config, pattern: list[int], pp_rank: int) -> list[list[int]]:
    """The MoE pattern (1 MoE, 0 dense) of each model chunk of pipeline rank `pp_rank`, placed
    by megatron's own layer-offset and layer-count functions."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in (range(vpp) if vpp else [None]):
        count = get_num_layers_to_build(config, vp_stage=stage, pp_rank=pp_rank)
        offset = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=pp_rank)
        chunks.append(pattern[offset:offset + count])
    return chunks


class _PipelineGroup:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def peak_in_flight(chunk_bytes: list[float], pp: int, pp_rank: int, microbatches: int,
                   group_size: int) -> tuple[float, int]:
    """(the most bytes of chunk activations pipeline rank `pp_rank` holds at once, the
    micro-batches in flight then) under megatron's 1F1B schedule (interleaved with more than
    one chunk): its warm-up forwards, then one forward and one backward at a time, in the order
    of megatron's schedule table."""
    from megatron.core.pipeline_parallel import schedules

    chunks = len(chunk_bytes)
    communicator = types.SimpleNamespace(
        pp_group=_PipelineGroup(pp, pp_rank),
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
    total, _, warmup, _ = schedules.get_pp_rank_microbatches(
        microbatches, chunks, group_size, p2p_communicator=communicator)
    order = (schedules.get_schedule_table(microbatches, chunks, group_size) if chunks > 1
             else [(m, 0) for m in range(microbatches)])
    live, peak, held, most_held = 0.0, 0.0, 0, 0
    forwards = iter(order)
    backwards = iter([(m, chunks - 1 - c) for m, c in order])

    def forward():
        nonlocal live, peak, held, most_held
        live += chunk_bytes[next(forwards)[1]]
        held += 1
        if live > peak:
            peak, most_held = live, held

    for _ in range(warmup):
        forward()
    for _ in range(total - warmup):
        forward()
        live -= chunk_bytes[next(backwards)[1]]
        held -= 1
    return peak, most_held


# --------------------------------------------------------------------------------------------
# A rank's peak
# --------------------------------------------------------------------------------------------
def layer_bytes(args, moe: bool, kernels: str = "te") -> float:
    return sum(layer_parts(args, moe, kernels).values())


def chunk_bytes(args, chunk: list[int], kernels: str = "te") -> tuple[float, float]:
    """(bytes a model chunk with these layers keeps a micro-batch under the run's recompute,
    the most its backward rebuilds at once: one recomputed block)."""
    parts = [layer_parts(args, bool(moe), kernels) for moe in chunk]
    full = [sum(layer.values()) for layer in parts]
    if args.recompute_granularity == "full":
        n, kept_input = args.recompute_num_layers, layer_input_bytes(args)
        if args.recompute_method == "uniform":
            blocks = [sum(full[i:i + n]) for i in range(0, len(full), n)]
            return kept_input * len(blocks), max(blocks, default=0.0)
        return kept_input * len(full[:n]) + sum(full[n:]), max(full[:n], default=0.0)
    if args.recompute_granularity == "selective":
        return sum(total - selective_recompute_saves(args, layer, kernels)
                   for total, layer in zip(full, parts)), 0.0
    return sum(full), 0.0


def mtp_bytes(args, moe: bool, kernels: str = "te") -> tuple[float, float]:
    """(what one MTP layer keeps a micro-batch under the run's recompute, what its backward
    rebuilds). The layer: a decoder layer of the last layer's kind, the norms of the embedding
    and of the hidden state, and the projection's concatenated input. Under full, uniform
    recompute megatron checkpoints it whole, keeping its two inputs (it skips block recompute),
    and rebuilds it with its final norm while the decoder's final norm, whose backward waits
    for it, still holds its input; selective recompute acts on its decoder layer."""
    shape = Shape.of(args, kernels)
    h, ts = args.hidden_size, shape.sequence_tokens
    parts = layer_parts(args, moe, kernels)
    whole = (sum(parts.values()) + 2 * norm_bytes(args, shape, h, ts)
             + shape.act * 2 * h * ts)
    if args.recompute_granularity == "full" and args.recompute_method == "uniform":
        return 2 * layer_input_bytes(args), whole + 2 * norm_bytes(args, shape, h, ts)
    if args.recompute_granularity == "selective":
        return whole - selective_recompute_saves(args, parts, kernels), 0.0
    return whole, 0.0


def loss_bytes(args, vocab: int, kernels: str = "te") -> tuple[float, float]:
    """The loss of one micro-batch (each MTP layer computes its own): (what it keeps: the final
    norm, the output layer's input and the cross entropy's fp32 softmax; the logits in the
    activation dtype, which live beside it while the loss is computed and again as its
    gradient)."""
    shape = Shape.of(args, kernels)
    h, ts = args.hidden_size, shape.sequence_tokens
    logits = vocab / args.tensor_model_parallel_size * shape.tokens
    losses = 1 + (args.mtp_num_layers or 0)
    kept = norm_bytes(args, shape, h, ts) + shape.act * h * ts + FP32 * logits
    return kept * losses, shape.act * logits * losses


@dataclasses.dataclass(frozen=True)
class RankActivations:
    pp_rank: int
    in_flight: float  # bytes of the chunk activations held at the schedule's peak
    micro_batches: int  # (chunk) micro-batches in flight then
    rebuilt: float  # the largest recompute block, rebuilt in the backward
    loss: float  # what one micro-batch's loss keeps (the last rank)
    logits: float  # its logits in the activation dtype, beside it for a while

    @property
    def total(self) -> float:
        # (a micro-batch's loss is freed by its backward before a block is recomputed)
        return self.in_flight + max(self.rebuilt, self.loss + self.logits)

    @property
    def saved(self) -> float:
        """What autograd holds for the backward at the peak (the logits are not among it)."""
        return self.in_flight + max(self.rebuilt, self.loss)


def rank_activations(args, config, pattern: list[int], vocab: int, microbatches: int,
                     kernels: str = "te") -> list[RankActivations]:
    """Every pipeline rank's activation peak for a run of `microbatches` a step."""
    pp = args.pipeline_model_parallel_size
    group = getattr(args, "microbatch_group_size_per_vp_stage", None) or pp
    mtp = args.mtp_num_layers or 0
    ranks = []
    for rank in range(pp):
        chunks = chunk_layers(config, pattern, rank) if pp > 1 else [pattern]
        kept, rebuilt = zip(*(chunk_bytes(args, chunk, kernels) for chunk in chunks))
        kept, loss, logits = list(kept), 0.0, 0.0
        if rank == pp - 1 and mtp:
            mtp_kept, mtp_rebuilt = mtp_bytes(args, bool(pattern[-1]), kernels)
            kept[-1] += mtp * mtp_kept
            rebuilt += (mtp_rebuilt,)
        if rank == pp - 1:
            loss, logits = loss_bytes(args, vocab, kernels)
        peak, held = peak_in_flight(kept, pp, rank, microbatches, group)
        ranks.append(RankActivations(rank, peak, held, max(rebuilt), loss, logits))
    return ranks


# --------------------------------------------------------------------------------------------
# In words: the dry run's lines and the training log's say the same things the same way
# --------------------------------------------------------------------------------------------
def estimate_said(args, pattern: list[int], kernels: str, size) -> str:
    """What the figure prices: the kernels, the recompute, and a layer of each kind the pattern
    builds a micro-batch (sizes in words by `size`)."""
    kernel_name = ("Transformer Engine's kernels" if kernels == "te"
                   else "the local spec's kernels")
    built = set(map(bool, pattern))
    layers = ", ".join(f"{size(layer_bytes(args, moe, kernels))} ({kind})"
                       for kind, moe in (("MoE", True), ("dense", False)) if moe in built)
    return (f"activations (moe_launcher.activation_memory: {kernel_name}, "
            f"{recompute_said(args)}, experts' average share of tokens): a layer's activations "
            f"{layers} a micro-batch of {args.micro_batch_size} x {args.seq_length} tokens "
            f"before recompute")


def peak_said(args, peak: RankActivations, size) -> str:
    """A rank's peak in words: its (chunk) micro-batches in flight, plus the larger of a
    recomputed block and a micro-batch's logits and loss (sizes by `size`)."""
    chunked = " chunk" if (args.virtual_pipeline_model_parallel_size or 1) > 1 else ""
    then = [f"a recomputed block {size(peak.rebuilt)}"] if peak.rebuilt else []
    if peak.loss:
        then.append(f"a micro-batch's logits and loss {size(peak.loss + peak.logits)}")
    return (f"{peak.micro_batches}{chunked} micro-batch{'es' if peak.micro_batches > 1 else ''} "
            f"in flight {size(peak.in_flight)}"
            + (f" + the larger of {' and '.join(then)}" if len(then) > 1
               else "".join(f" + {t}" for t in then)))


def not_modelled_said(args) -> list[str]:
    """What the figure counts otherwise than the run keeps it."""
    notes = []
    if args.fp8 or args.fp4:
        notes.append("FP8/FP4 activations not modelled (counted in the activation dtype: an "
                     "over-estimate)")
    if not_modelled := recompute_not_modelled(args):
        notes.append(f"--recompute-modules {' '.join(not_modelled)} not modelled (counted as "
                     f"kept)")
    return notes


def recompute_said(args) -> str:
    """The run's recompute, in words."""
    if args.recompute_granularity == "full":
        return (f"full recompute, {args.recompute_method} {args.recompute_num_layers} "
                f"layer{'s' if args.recompute_num_layers > 1 else ''}")
    if args.recompute_granularity == "selective":
        return f"selective recompute of {','.join(args.recompute_modules or ['core_attn'])}"
    return "no recompute"


def recompute_not_modelled(args) -> list[str]:
    """The --recompute-modules this model counts as kept."""
    if args.recompute_granularity != "selective":
        return []
    return [m for m in args.recompute_modules or () if m not in MODELLED_RECOMPUTE]
