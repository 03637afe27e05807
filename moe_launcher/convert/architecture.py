"""A Hugging Face MoE config as Megatron-LM flags, and the saved megatron args as a Hugging Face
config: what every family shares (GQA attention, RMSNorm, rope, SwiGLU experts, a softmax
router, the vocabulary). Keys megatron cannot express are refused by name, never dropped.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import ConvertError
from .families import Family, refuse_if

DTYPE_FLAGS = {"float32": [], "bfloat16": ["--bf16"], "float16": ["--fp16"]}
# megatron's default --make-vocab-size-divisible-by: the TP1 padding every layout loads from
# (a larger TP pads more, and megatron reads the saved rows and zero-fills the rest).
VOCAB_DIVISOR = 128


def _dtype_name(config) -> str:
    dtype = getattr(config, "dtype", None) or "float32"
    return str(dtype).removeprefix("torch.")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# The yarn rope of megatron's multi-latent attention (MLATransformerConfig): the keys its flags
# set (megatron's defaults, and the flag of each: patch mla-yarn-flags makes MLA take them), and
# the one it fixes (the correction range rounded to integers, transformers' `truncate`).
class YarnFlag(NamedTuple):
    default: float | int  # megatron's MLA value without the flag
    flag: str
    arg: str  # the flag's name in megatron's args


MLA_YARN_FLAGS = {
    "original_max_position_embeddings": YarnFlag(4096, "--yarn-original-max-position-embeddings",
                                                 "yarn_original_max_position_embeddings"),
    "beta_fast": YarnFlag(32.0, "--yarn-beta-fast", "yarn_beta_fast"),
    "beta_slow": YarnFlag(1.0, "--yarn-beta-slow", "yarn_beta_slow")}
MLA_YARN_TRUNCATE = True


def _mla_rope_flags(rope: dict, kind: str, max_positions: int) -> list[str]:
    """megatron's MLA rope: plain (its fused MLA rope computes yarn only), or yarn with its
    scaling factor, DeepSeek's two mscales (the rope's cos/sin scaled by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim), the softmax by mscale(factor, mscale_all_dim)^2), and the
    original context and betas where they are not megatron's defaults."""
    if kind == "default":
        return ["--rope-type", "rope", "--no-rope-fusion"]
    refuse_if(kind != "yarn", "rope_parameters.rope_type (rope_scaling)", kind,
              "megatron's multi-latent attention computes plain rope or yarn")
    truncate = rope.get("truncate")
    refuse_if(truncate is not None and truncate != MLA_YARN_TRUNCATE, "rope_parameters.truncate",
              truncate, "megatron's multi-latent attention rounds yarn's correction range to "
                        "integers (no flag)")
    yarn = {key: known.default if rope.get(key) is None else rope[key]
            for key, known in MLA_YARN_FLAGS.items()}
    set_apart = []  # (megatron's defaults need no flag)
    for key, known in MLA_YARN_FLAGS.items():
        if yarn[key] != known.default:
            value = yarn[key]
            set_apart += [known.flag, str(int(value)) if isinstance(known.default, int)
                          else repr(float(value))]
    refuse_if(rope.get("attention_factor") is not None, "rope_parameters.attention_factor",
              rope.get("attention_factor"), "megatron derives yarn's attention factor from the "
              "mscales (no flag)")
    factor = rope.get("factor") or max_positions / yarn["original_max_position_embeddings"]
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # transformers uses both mscales only where both are set, else mscale(factor) alone
    refuse_if(bool(mscale_all_dim) and not mscale, "rope_parameters.mscale", mscale,
              "transformers then ignores mscale_all_dim in the rope's scale, megatron does not")
    refuse_if(not mscale_all_dim and mscale not in (None, 1.0), "rope_parameters.mscale", mscale,
              "transformers then scales the rope by mscale(factor) alone, megatron by this mscale")
    return ["--rope-type", "yarn", "--rotary-scaling-factor", repr(float(factor)),
            "--mscale", repr(float(mscale or 1.0)),
            "--mscale-all-dim", repr(float(mscale_all_dim or 0.0)), *set_apart]


def _rope_flags(family: Family, config) -> list[str]:
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if family.attention == "mla":
        kind_flags = _mla_rope_flags(rope, kind, config.max_position_embeddings)
    else:
        refuse_if(kind != "default", "rope_parameters.rope_type (rope_scaling)", kind,
                  "megatron's rope here is plain rope (--use-rope-scaling is llama3's only)")
        kind_flags = []
    fraction = rope.get("partial_rotary_factor", 1.0)
    # (GLM-4.5 rotates the first half of each head, as megatron's --rotary-percent does)
    refuse_if(fraction != 1.0 and "rotary_percent" not in family.mapped_args,
              "partial_rotary_factor", fraction,
              f"{family.architecture} rotates every dimension of a head")
    theta = rope.get("rope_theta", 10000.0)
    # megatron's --rotary-base is an integer.
    refuse_if(theta != int(theta), "rope_theta", theta, "megatron's --rotary-base is an integer")
    partial = ["--rotary-percent", repr(float(fraction))] if fraction != 1.0 else []
    return ["--position-embedding-type", "rope", "--rotary-base", str(int(theta)), *partial,
            *kind_flags]


def _grouped_query_attention_flags(config) -> list[str]:
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    flags = ["--kv-channels", str(head_dim(config))]
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    return flags


def _multi_latent_attention_flags(config) -> list[str]:
    """DeepSeek's attention: q through a compressed rank (q_lora_rank; None: one projection),
    keys and values through one compressed kv with a shared rope key, each compressed q and kv
    normalised (--qk-layernorm), heads of qk_nope + qk_rope dims for q/k and v_head_dim for v."""
    q_rank = [] if config.q_lora_rank is None else ["--q-lora-rank", str(config.q_lora_rank)]
    return ["--multi-latent-attention", *q_rank, "--kv-lora-rank", str(config.kv_lora_rank),
            "--qk-head-dim", str(config.qk_nope_head_dim),
            "--qk-pos-emb-head-dim", str(config.qk_rope_head_dim),
            "--v-head-dim", str(config.v_head_dim), "--qk-layernorm"]


_ATTENTION_FLAGS = {"gqa": _grouped_query_attention_flags, "mla": _multi_latent_attention_flags}


def _load_balancing_flags(family: Family, config) -> list[str]:
    coefficient = getattr(config, family.aux_loss_key, None) if family.aux_loss_key else None
    # (no coefficient, or 0, as export writes for a run without the loss: none)
    if not coefficient:
        return ["--moe-router-load-balancing-type", "none"]
    sequence_level = family.seq_aux_key and getattr(config, family.seq_aux_key, False)
    return ["--moe-router-load-balancing-type", "seq_aux_loss" if sequence_level else "aux_loss",
            "--moe-aux-loss-coeff", repr(coefficient)]


def aux_loss_weight_said(family: Family, config) -> str | None:
    """What the load-balancing coefficient, imported and exported as the same number, weighs in
    megatron against the family's transformers model, where they differ. With F_e the tokens whose top k
    chose expert e over all tokens (k in all) and P_e the mean router probability of e, megatron
    adds each of the L MoE layers' E/k * sum_e F_e P_e (1 at balance), transformers'
    `load_balancing_loss_func` takes E * sum_e F_e P_e once, F and P pooled over the L layers
    (k at balance): with the same load in every layer megatron's loss and its gradient are L/k
    times transformers'."""
    coefficient = getattr(config, family.aux_loss_key, None) if family.aux_loss_key else None
    if not coefficient or not family.aux_loss_pooled_over_layers:
        return None
    layers, top_k = sum(family.moe_layers(config)), config.num_experts_per_tok
    if layers == top_k:
        return None
    return (f"{family.aux_loss_key} {coefficient!r} = --moe-aux-loss-coeff {coefficient!r}, the "
            f"same number, weighs otherwise: megatron adds each of the {layers} MoE layers' "
            f"load-balancing loss (normalised by top-k: 1 at balance), transformers' "
            f"load_balancing_loss_func takes one over the layers pooled ({top_k} at balance), "
            f"so with equal loads in every layer megatron's balancing gradient is "
            f"{layers / top_k:.4g}x transformers' (--moe-aux-loss-coeff "
            f"{coefficient * top_k / layers:.4g} gives transformers' size)")


def megatron_flags(family: Family, config) -> list[str]:
    """The flags that make pretrain_moe.py build this config's architecture."""
    refuse_if(config.hidden_act != "silu", "hidden_act", config.hidden_act,
              "the launcher's experts are SwiGLU (--swiglu)")
    # (GLM-4.5's attention_bias is q, k and v's alone)
    refuse_if(bool(getattr(config, "attention_bias", False))
              and family.qkv_bias_key != "attention_bias", "attention_bias", True,
              "megatron's --add-qkv-bias has no bias on the output projection")
    dtype = _dtype_name(config)
    if dtype not in DTYPE_FLAGS:
        raise ConvertError(f"config.json sets dtype={dtype!r}: only {sorted(DTYPE_FLAGS)} map "
                           "to megatron's precision flags")
    flags = ["--num-layers", str(config.num_hidden_layers),
             "--hidden-size", str(config.hidden_size),
             "--num-attention-heads", str(config.num_attention_heads),
             *_ATTENTION_FLAGS[family.attention](config),
             "--max-position-embeddings", str(config.max_position_embeddings),
              *_rope_flags(family, config),
              "--normalization", "RMSNorm", "--norm-epsilon", repr(config.rms_norm_eps),
              "--swiglu", "--disable-bias-linear",
              "--attention-dropout", repr(float(config.attention_dropout)), "--hidden-dropout", "0.0",
              "--init-method-std", repr(config.initializer_range),
              "--vocab-size", str(config.vocab_size),
              "--make-vocab-size-divisible-by", str(VOCAB_DIVISOR),
              "--num-experts", str(getattr(config, family.experts_key)),
              "--moe-router-topk", str(config.num_experts_per_tok),
              "--moe-ffn-hidden-size", str(getattr(config, family.expert_width_key)),
              *_load_balancing_flags(family, config), *DTYPE_FLAGS[dtype]]
    if not config.tie_word_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if family.qk_norm(config):
        flags.append("--qk-layernorm")
    moe_layers = family.moe_layers(config)
    if not any(moe_layers):
        raise ConvertError(f"config.json makes none of its {len(moe_layers)} layers a MoE layer "
                           "(a dense model; this converter maps MoE families)")
    if not all(moe_layers):
        # megatron's list form (its integer form counts from layer 0, HF's sparse step from 1)
        flags += ["--moe-layer-freq", f"[{','.join(str(int(moe)) for moe in moe_layers)}]"]
    if mtp_layers := family.mtp_layers(config):
        flags += ["--mtp-num-layers", str(mtp_layers)]
    return flags + family.flags(config)


# Saved args that every family needs as they are (but those a family maps itself, its
# `mapped_args`); anything else is a model no family maps.
_REQUIRED_ARGS = {
    "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False, "add_qkv_bias": False,
    "position_embedding_type": "rope", "rotary_percent": 1.0, "rotary_interleaved": False,
    "use_rope_scaling": False, "layernorm_zero_centered_gamma": False, "multi_latent_attention": False,
    "mtp_num_layers": None, "moe_shared_expert_intermediate_size": None,
    "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False, "moe_router_num_groups": None,
    "window_size": None, "qk_l2_norm": False, "hybrid_layer_pattern": None,
    "experimental_attention_variant": None,
    # Each changes the forward where it differs from megatron-core 0.19.2's default.
    "apply_residual_connection_post_layernorm": False, "softmax_type": "vanilla",
    "attention_output_gate": False, "quick_geglu": False, "moe_latent_size": None,
    "moe_apply_probs_on_input": False, "moe_shared_expert_gate": False,
    "glu_linear_offset": 0.0, "activation_func_clamp_value": None,
    "moe_expert_capacity_factor": None,
}


def _single(value, name: str):
    """megatron keeps some per-loss settings as lists (one entry per load-balancing type)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ConvertError(f"the checkpoint's {name}={value!r}: one value maps to Hugging Face")
        return value[0]
    return value


def check_exportable(family: Family, args, moe_layers: list[bool]) -> None:
    """Refuses saved args (and the MoE layers of the model megatron built from them, one entry
    a decoder layer) that the family's Hugging Face model does not compute."""
    for name, wanted in _REQUIRED_ARGS.items():
        if name in family.mapped_args:
            continue
        value = getattr(args, name, wanted)
        if value != wanted:
            raise ConvertError(f"the checkpoint's {name}={value!r} has no Hugging Face mapping "
                               f"here (needs {wanted!r})")
    if not args.num_experts or not any(moe_layers):
        raise ConvertError(f"the checkpoint's num_experts={args.num_experts!r}: a model without "
                           "MoE layers maps to no MoE family")
    if not all(moe_layers) and family.dense_mlp is None:
        raise ConvertError(f"the checkpoint's moe_layer_freq={args.moe_layer_freq!r} builds dense "
                           f"layers, which {family.architecture} does not have")
    if (args.mtp_num_layers or 0) > 1 and getattr(args, "mtp_use_repeated_layer", False):
        raise ConvertError(f"the checkpoint's mtp_use_repeated_layer=True: its "
                           f"{args.mtp_num_layers} MTP depths run one layer, which Hugging Face "
                           f"checkpoints hold once a depth")
    balancing = ("aux_loss", "none", *(("seq_aux_loss",) if family.seq_aux_key else ()))
    if _single(args.moe_router_load_balancing_type,
               "moe_router_load_balancing_type") not in balancing:
        raise ConvertError(f"the checkpoint's moe_router_load_balancing_type="
                           f"{args.moe_router_load_balancing_type!r} has no Hugging Face mapping")


def vocab_size(args) -> int:
    """The vocabulary the HF model gets: the unpadded --vocab-size when the run had one, else
    (a tokenizer-sized run) megatron's padded size, padding rows included."""
    return args.vocab_size or args.padded_vocab_size


def hf_config_kwargs(family: Family, args, dtype: str, moe_layers: list[bool]) -> dict:
    """The HF config (keyword arguments of the family's config class) of saved megatron args
    and the MoE layers of the model megatron built from them."""
    check_exportable(family, args, moe_layers)
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    rope = {"rope_type": "default", "rope_theta": float(args.rotary_base)}
    if "rotary_percent" in family.mapped_args:
        rope["partial_rotary_factor"] = args.rotary_percent
    aux_loss = {}
    if family.aux_loss_key:
        aux_loss[family.aux_loss_key] = _single(args.moe_aux_loss_coeff, "moe_aux_loss_coeff")
    if family.seq_aux_key:
        aux_loss[family.seq_aux_key] = _single(
            args.moe_router_load_balancing_type, "moe_router_load_balancing_type") == "seq_aux_loss"
    return {
        "architectures": [family.architecture], "dtype": dtype,
        "vocab_size": vocab_size(args), "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": groups, "head_dim": args.kv_channels,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_parameters": rope,
        "rms_norm_eps": args.layernorm_epsilon, "hidden_act": "silu",
        "attention_dropout": args.attention_dropout,
        "initializer_range": args.init_method_std,
        "tie_word_embeddings": not args.untie_embeddings_and_output_weights,
        "num_experts_per_tok": args.moe_router_topk,
        **aux_loss,
        **family.config_keys(args, [i for i, moe in enumerate(moe_layers) if not moe]),
    }
