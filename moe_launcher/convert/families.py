"""The model families the converter maps, one `Family` each, looked up by the `architectures`
name of a Hugging Face config.json (`FAMILIES`) or by the args saved in a megatron checkpoint
(`family_of_args`). Architectures known but not mapped yet are in `REFUSED`, with the reason.

A family holds the HF tensor names of one decoder layer and its config keys; everything every
family shares (attention, norms, rope, vocabulary, the router) is in `architecture.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .errors import ConvertError


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str  # config.json "architectures" entry and transformers model class
    config_class: str  # the transformers configuration class
    # HF names under `model.layers.{i}.`: the router, and expert {e}'s gate, up, down projections.
    router: str
    expert_projections: tuple[str, str, str]
    # whether a config has a per-head RMSNorm of q and k before rope (megatron --qk-layernorm)
    qk_norm: Callable[[object], bool]
    expert_width_key: str  # the config key of one expert's FFN width
    experts_key: str  # the config key of the number of experts
    # The family's own config keys to megatron flags (refusing what megatron cannot build).
    flags: Callable[[object], list[str]]
    # The family's own config keys from the args saved in a checkpoint and the indices of the
    # dense (not MoE) layers of the model megatron built from them.
    config_keys: Callable[[object, list[int]], dict]
    # Saved megatron args that tell this family apart on export (all must hold).
    marks: dict = dataclasses.field(default_factory=dict)
    # The config key that gives q, k and v projections a bias (megatron --add-qkv-bias), if any.
    qkv_bias_key: str | None = None
    # HF names under `model.layers.{i}.` of the shared expert's gate, up and down projections
    # (megatron --moe-shared-expert-intermediate-size), of its sigmoid gate if it has one
    # (--moe-shared-expert-gate), and of the router's score-correction bias, added to the scores
    # only to choose the experts (megatron's expert bias, --moe-router-enable-expert-bias).
    shared_expert: tuple[str, str, str] | None = None
    shared_expert_gate: str | None = None
    expert_bias: str | None = None
    # The config key of the load-balancing loss's coefficient (None, or a config without it or
    # with 0: the run balances without one), and the config key that makes it sequence-level
    # (DeepSeek's seq_aux: megatron's seq_aux_loss), if the family has one.
    aux_loss_key: str | None = "router_aux_loss_coef"
    seq_aux_key: str | None = None
    # Whether the family's transformers model takes that coefficient times one Switch loss over
    # all MoE layers' router logits pooled (`load_balancing_loss_func`: top-k at balance), where
    # megatron adds each layer's own (normalised by top-k: 1 at balance); DeepSeek's own code
    # adds each layer's, as megatron does.
    aux_loss_pooled_over_layers: bool = True
    # Saved megatron args the family maps beyond those its tensors above imply (`mapped_args`).
    maps_args: frozenset = frozenset()
    # The attention: "gqa" (q, k, v projections, grouped query heads) or "mla" (DeepSeek's
    # multi-latent attention: compressed q and kv, each with its norm, megatron's
    # --multi-latent-attention).
    attention: str = "gqa"
    # Which layers of a config are MoE layers (the others dense MLPs), as the family's
    # transformers model decides; and the HF names under `model.layers.{i}.` of a dense layer's
    # gate, up and down projections (None: every layer of the family is a MoE layer).
    moe_layers: Callable[[object], list[bool]] = lambda config: [True] * config.num_hidden_layers
    dense_mlp: tuple[str, str, str] | None = None
    # The config key counting the multi-token-prediction layers that follow the decoder's in the
    # family's checkpoints (megatron's --mtp-num-layers), if it has them. transformers' model
    # builds none; vLLM's MTP layer of the family computes what megatron's does (tensor_map).
    mtp_layers_key: str | None = None

    @property
    def mapped_args(self) -> frozenset:
        """Saved megatron args the family maps itself: export does not require their defaults."""
        implied = {"add_qkv_bias": self.qkv_bias_key,
                   "moe_shared_expert_intermediate_size": self.shared_expert,
                   "moe_shared_expert_gate": self.shared_expert_gate,
                   "moe_router_enable_expert_bias": self.expert_bias,
                   "mtp_num_layers": self.mtp_layers_key}
        return self.maps_args | {arg for arg, tensors in implied.items() if tensors}

    def mtp_layers(self, config) -> int:
        """How many multi-token-prediction layers a config of the family has."""
        return (getattr(config, self.mtp_layers_key, 0) or 0) if self.mtp_layers_key else 0


def refuse_if(condition: bool, key: str, value, why: str) -> None:
    if condition:
        raise ConvertError(f"config.json sets {key}={value!r}: {why}")


def _qwen_moe_layers(config) -> list[bool]:
    """Qwen2-MoE's and Qwen3-MoE's rule (their decoder layers'): layer i is a MoE layer unless
    it is in mlp_only_layers or i + 1 is not a multiple of decoder_sparse_step."""
    return [i not in config.mlp_only_layers and config.num_experts > 0
            and (i + 1) % config.decoder_sparse_step == 0
            for i in range(config.num_hidden_layers)]


def _qwen_moe_flags(config) -> list[str]:
    """Qwen2-MoE's and Qwen3-MoE's shared keys: the sliding window, the router."""
    refuse_if(bool(getattr(config, "use_sliding_window", False)), "use_sliding_window", True,
              "the launcher's attention is full causal attention (megatron's --window-size is "
              "not mapped)")
    # Qwen-MoE takes the top-k of the softmax over all experts and renormalises them only with
    # norm_topk_prob; megatron's --moe-router-pre-softmax is the same softmax without the
    # renormalisation, its default (top-k logits, then softmax) is the renormalised one.
    flags = ["--ffn-hidden-size", str(config.intermediate_size)]
    return flags if config.norm_topk_prob else flags + ["--moe-router-pre-softmax"]


def _qwen_moe_config(args, dense_layers: list[int]) -> dict:
    return {"moe_intermediate_size": args.moe_ffn_hidden_size,
            "intermediate_size": args.ffn_hidden_size, "num_experts": args.num_experts,
            "norm_topk_prob": not args.moe_router_pre_softmax,
            "mlp_only_layers": dense_layers, "decoder_sparse_step": 1}


def _qwen2_moe_flags(config) -> list[str]:
    # Every Qwen2-MoE layer adds a shared expert, scaled by a sigmoid of a linear gate on the
    # same input: megatron's shared expert with --moe-shared-expert-gate.
    flags = ["--moe-shared-expert-intermediate-size", str(config.shared_expert_intermediate_size),
             "--moe-shared-expert-gate"]
    return _qwen_moe_flags(config) + flags + (["--add-qkv-bias"] if config.qkv_bias else [])


def _qwen2_moe_config(args, dense_layers: list[int]) -> dict:
    return {**_qwen_moe_config(args, dense_layers), "qkv_bias": bool(args.add_qkv_bias),
            "shared_expert_intermediate_size": args.moe_shared_expert_intermediate_size}


def _leading_dense_layers(config) -> list[bool]:
    """GLM-4.5's rule (its decoder layers'): the first first_k_dense_replace layers are dense."""
    return [i >= config.first_k_dense_replace for i in range(config.num_hidden_layers)]


def _sigmoid_router_flags(config) -> list[str]:
    """GLM-4.5's and DeepSeek-V3's MoE layers: a sigmoid router choosing by score + correction
    bias among the experts of its best groups, renormalised and scaled, and gateless shared
    experts of n_shared_experts expert widths."""
    top_k = config.num_experts_per_tok
    # megatron's sigmoid router renormalises the chosen scores exactly when it chooses several
    refuse_if(config.norm_topk_prob != (top_k > 1), "norm_topk_prob", config.norm_topk_prob,
              f"megatron's sigmoid router renormalises the top-{top_k} scores "
              f"{'only with several experts a token' if top_k == 1 else 'always'}")
    refuse_if(config.n_shared_experts < 1, "n_shared_experts", config.n_shared_experts,
              "the family's MoE layers have a shared expert")
    flags = ["--ffn-hidden-size", str(config.intermediate_size),
             "--moe-shared-expert-intermediate-size",
             str(config.moe_intermediate_size * config.n_shared_experts),
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             # transformers' router computes its logits in fp32 whatever the model's dtype
             "--moe-router-dtype", "fp32"]
    if config.routed_scaling_factor != 1.0:
        flags += ["--moe-router-topk-scaling-factor", repr(float(config.routed_scaling_factor))]
    if config.n_group > 1:
        # megatron ranks a group by the sum of its top (top-k / groups chosen) scores, GLM's and
        # DeepSeek-V3's by the sum of its top two
        refuse_if(top_k // config.topk_group != 2, "topk_group", config.topk_group,
                  f"megatron ranks groups by their top {top_k // config.topk_group} scores "
                  "(num_experts_per_tok // topk_group), transformers' model by their top 2")
        flags += ["--moe-router-num-groups", str(config.n_group),
                  "--moe-router-group-topk", str(config.topk_group)]
    return flags


def _glm4_moe_flags(config) -> list[str]:
    return _sigmoid_router_flags(config) + (["--add-qkv-bias"] if config.attention_bias else [])


def _leading_dense_shared_expert_config(args, dense_layers: list[int]) -> dict:
    """GLM-4.5's and DeepSeek's layers: leading dense layers, routed experts and shared experts
    of n_shared_experts expert widths."""
    if dense_layers != list(range(len(dense_layers))):
        raise ConvertError(f"the checkpoint's dense layers {dense_layers} are not its first "
                           "layers: the family's dense layers are (first_k_dense_replace)")
    shared, width = args.moe_shared_expert_intermediate_size, args.moe_ffn_hidden_size
    if shared % width:
        raise ConvertError(f"the checkpoint's moe_shared_expert_intermediate_size={shared} is no "
                           f"multiple of moe_ffn_hidden_size={width} (the n_shared_experts)")
    return {"n_routed_experts": args.num_experts, "moe_intermediate_size": width,
            "intermediate_size": args.ffn_hidden_size, "n_shared_experts": shared // width,
            "routed_scaling_factor": args.moe_router_topk_scaling_factor or 1.0,
            "first_k_dense_replace": len(dense_layers)}


def _sigmoid_router_config(args, dense_layers: list[int]) -> dict:
    return {**_leading_dense_shared_expert_config(args, dense_layers),
            "norm_topk_prob": args.moe_router_topk > 1,
            "n_group": args.moe_router_num_groups or 1,
            "topk_group": args.moe_router_group_topk or 1,
            "num_nextn_predict_layers": args.mtp_num_layers or 0}


def _glm4_moe_config(args, dense_layers: list[int]) -> dict:
    return {**_sigmoid_router_config(args, dense_layers),
            "use_qk_norm": bool(args.qk_layernorm), "attention_bias": bool(args.add_qkv_bias)}


def _deepseek_v3_flags(config) -> list[str]:
    # (q_a_proj, kv_a_proj_with_mqa and o_proj biases: refused with every attention_bias)
    refuse_if(not config.rope_interleave, "rope_interleave", False,
              "megatron's multi-latent attention rotates interleaved pairs of each rope head")
    return _sigmoid_router_flags(config)


def _deepseek_rope(args) -> dict:
    """rope_parameters of megatron's MLA rope: plain, or yarn with its --yarn-* flags' values
    (megatron's defaults where a flag was not given)."""
    from .architecture import MLA_YARN_FLAGS

    rope = {"rope_type": "default", "rope_theta": float(args.rotary_base)}
    if args.rope_type == "yarn":
        return {**rope, "rope_type": "yarn", "factor": args.rotary_scaling_factor,
                "mscale": args.mscale, "mscale_all_dim": args.mscale_all_dim,
                **{key: known.default if getattr(args, known.arg, None) is None
                   else getattr(args, known.arg) for key, known in MLA_YARN_FLAGS.items()}}
    # (megatron's MLA scales its softmax by mscale(rotary_scaling_factor, mscale_all_dim)^2
    # whatever the rope)
    if args.rope_type != "rope" or (args.rotary_scaling_factor > 1 and args.mscale_all_dim):
        raise ConvertError(f"the checkpoint's rope_type={args.rope_type!r}, rotary_scaling_factor="
                           f"{args.rotary_scaling_factor!r}, mscale_all_dim="
                           f"{args.mscale_all_dim!r} has no DeepSeek rope mapping")
    return rope


def _multi_latent_attention_config(args) -> dict:
    if not args.qk_layernorm:
        raise ConvertError("the checkpoint's qk_layernorm=False: DeepSeek's attention normalises "
                           "the compressed q and kv (--qk-layernorm)")
    return {"q_lora_rank": args.q_lora_rank, "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_head_dim, "qk_rope_head_dim": args.qk_pos_emb_head_dim,
            "v_head_dim": args.v_head_dim, "head_dim": args.qk_pos_emb_head_dim,
            "rope_parameters": _deepseek_rope(args),
            # every head has its own keys and values (expanded from the one compressed kv)
            "num_key_value_heads": args.num_attention_heads}


def _deepseek_v3_config(args, dense_layers: list[int]) -> dict:
    return {**_sigmoid_router_config(args, dense_layers), **_multi_latent_attention_config(args),
            "rope_interleave": True}


def _deepseek_v2_flags(config) -> list[str]:
    """DeepSeek-V2's MoE layers: the softmax over every expert, its top-k unrenormalised
    (transformers' router ignores norm_topk_prob) and scaled, gateless shared experts."""
    top_k = config.num_experts_per_tok
    refuse_if(config.n_shared_experts < 1, "n_shared_experts", config.n_shared_experts,
              "the family's MoE layers have a shared expert")
    flags = ["--ffn-hidden-size", str(config.intermediate_size),
             "--moe-shared-expert-intermediate-size",
             str(config.moe_intermediate_size * config.n_shared_experts),
             "--moe-router-pre-softmax", "--moe-router-dtype", "fp32"]
    if config.routed_scaling_factor != 1.0:
        flags += ["--moe-router-topk-scaling-factor", repr(float(config.routed_scaling_factor))]
    if config.topk_method == "group_limited_greedy":
        # transformers ranks a group by its best score; megatron by the sum of its top
        # (top-k / groups chosen)
        refuse_if(top_k // config.topk_group != 1, "topk_group", config.topk_group,
                  f"megatron ranks groups by their top {top_k // config.topk_group} scores "
                  "(num_experts_per_tok // topk_group), transformers' model by its best one")
        return flags + ["--moe-router-num-groups", str(config.n_group),
                        "--moe-router-group-topk", str(config.topk_group)]
    refuse_if(config.topk_method != "greedy", "topk_method", config.topk_method,
              "the family's routers are greedy or group_limited_greedy")
    return flags


def _deepseek_v2_config(args, dense_layers: list[int]) -> dict:
    if not args.moe_router_pre_softmax:
        raise ConvertError("the checkpoint's moe_router_pre_softmax=False: megatron then "
                           "renormalises the top-k, DeepseekV2ForCausalLM does not")
    groups = args.moe_router_num_groups
    return {**_leading_dense_shared_expert_config(args, dense_layers),
            **_multi_latent_attention_config(args), "norm_topk_prob": False,
            "topk_method": "group_limited_greedy" if groups else "greedy",
            # (one group, all of it chosen: what DeepSeek-V2-Lite's config says for greedy)
            "n_group": groups or 1, "topk_group": args.moe_router_group_topk or 1}


def _mixtral_flags(config) -> list[str]:
    refuse_if(config.sliding_window is not None, "sliding_window", config.sliding_window,
              "the launcher's attention is full causal attention (megatron's --window-size is "
              "not mapped)")
    refuse_if(bool(config.router_jitter_noise), "router_jitter_noise", config.router_jitter_noise,
              "megatron's router has no multiplicative jitter on its logits")
    # Mixtral's experts are its only MLP; megatron still asks for a dense width.
    return ["--ffn-hidden-size", str(config.intermediate_size)]


def _mixtral_config(args, dense_layers: list[int]) -> dict:
    return {"intermediate_size": args.moe_ffn_hidden_size, "num_local_experts": args.num_experts}


# The Qwen-MoE and GLM-4.5 names of expert {e}'s projections and of a dense layer's.
_GATE_UP_DOWN_EXPERTS = tuple(f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down"))
_GATE_UP_DOWN_MLP = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
_GATE_UP_DOWN_SHARED_EXPERTS = tuple(f"mlp.shared_experts.{p}_proj.weight"
                                     for p in ("gate", "up", "down"))


# GLM-4.5's and DeepSeek's layers: leading dense layers, then MoE layers of routed experts and
# gateless shared experts.
_LEADING_DENSE_SHARED_EXPERT_LAYERS = dict(
    router="mlp.gate.weight", expert_projections=_GATE_UP_DOWN_EXPERTS,
    expert_width_key="moe_intermediate_size", experts_key="n_routed_experts",
    shared_expert=_GATE_UP_DOWN_SHARED_EXPERTS, moe_layers=_leading_dense_layers,
    dense_mlp=_GATE_UP_DOWN_MLP)
# GLM-4.5's and DeepSeek-V3's router (score-correction bias) and their multi-token-prediction
# layers.
_SIGMOID_ROUTER_MTP = dict(expert_bias="mlp.gate.e_score_correction_bias",
                           mtp_layers_key="num_nextn_predict_layers")
# DeepSeek's own config.json keys of its load-balancing loss (transformers' configs keep them as
# they are): aux_loss_alpha, sequence-level with seq_aux.
_DEEPSEEK_AUX_LOSS = dict(aux_loss_key="aux_loss_alpha", seq_aux_key="seq_aux",
                          aux_loss_pooled_over_layers=False)

FAMILIES: dict[str, Family] = {family.architecture: family for family in (
    Family(architecture="Qwen3MoeForCausalLM", config_class="Qwen3MoeConfig",
           router="mlp.gate.weight", expert_projections=_GATE_UP_DOWN_EXPERTS,
           qk_norm=lambda config: True, expert_width_key="moe_intermediate_size",
           experts_key="num_experts", flags=_qwen_moe_flags, config_keys=_qwen_moe_config,
           marks={"qk_layernorm": True, "moe_router_score_function": "softmax",
                  "multi_latent_attention": False},
           moe_layers=_qwen_moe_layers,
           dense_mlp=_GATE_UP_DOWN_MLP),
    Family(architecture="Qwen2MoeForCausalLM", config_class="Qwen2MoeConfig",
           router="mlp.gate.weight", expert_projections=_GATE_UP_DOWN_EXPERTS,
           qk_norm=lambda config: False, expert_width_key="moe_intermediate_size",
           experts_key="num_experts", flags=_qwen2_moe_flags, config_keys=_qwen2_moe_config,
           marks={"qk_layernorm": False, "moe_shared_expert_gate": True,
                  "multi_latent_attention": False},
           qkv_bias_key="qkv_bias",
           shared_expert=("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                          "mlp.shared_expert.down_proj.weight"),
           shared_expert_gate="mlp.shared_expert_gate.weight",
           moe_layers=_qwen_moe_layers,
           dense_mlp=_GATE_UP_DOWN_MLP),
    Family(architecture="Glm4MoeForCausalLM", config_class="Glm4MoeConfig",
           **_LEADING_DENSE_SHARED_EXPERT_LAYERS, **_SIGMOID_ROUTER_MTP,
           # (GLM-4.5 balances by its expert bias alone: its config has no loss coefficient)
           aux_loss_key=None,
           qk_norm=lambda config: config.use_qk_norm,
           flags=_glm4_moe_flags, config_keys=_glm4_moe_config,
           marks={"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                  "moe_shared_expert_gate": False, "multi_latent_attention": False},
           qkv_bias_key="attention_bias",
           maps_args=frozenset({"moe_router_score_function", "moe_router_topk_scaling_factor",
                                "moe_router_num_groups", "rotary_percent"})),
    Family(architecture="DeepseekV3ForCausalLM", config_class="DeepseekV3Config",
           **_LEADING_DENSE_SHARED_EXPERT_LAYERS, **_SIGMOID_ROUTER_MTP,
           # the expert bias and, where the config states one, DeepSeek's complementary
           # sequence-wise loss (Megatron-Bridge's DeepSeek-V3 bridge maps it so too)
           **_DEEPSEEK_AUX_LOSS,
           qk_norm=lambda config: False, attention="mla",
           flags=_deepseek_v3_flags, config_keys=_deepseek_v3_config,
           marks={"multi_latent_attention": True, "moe_router_score_function": "sigmoid",
                  "moe_router_enable_expert_bias": True, "moe_shared_expert_gate": False},
           maps_args=frozenset({"moe_router_score_function", "moe_router_topk_scaling_factor",
                                "moe_router_num_groups", "multi_latent_attention"})),
    Family(architecture="DeepseekV2ForCausalLM", config_class="DeepseekV2Config",
           **_LEADING_DENSE_SHARED_EXPERT_LAYERS,
           qk_norm=lambda config: False, attention="mla",
           flags=_deepseek_v2_flags, config_keys=_deepseek_v2_config,
           marks={"multi_latent_attention": True, "moe_router_score_function": "softmax",
                  "moe_shared_expert_gate": False},
           **_DEEPSEEK_AUX_LOSS,
           maps_args=frozenset({"moe_router_topk_scaling_factor", "moe_router_num_groups",
                                "multi_latent_attention"})),
    Family(architecture="MixtralForCausalLM", config_class="MixtralConfig",
           router="block_sparse_moe.gate.weight",
           expert_projections=("block_sparse_moe.experts.{e}.w1.weight",
                               "block_sparse_moe.experts.{e}.w3.weight",
                               "block_sparse_moe.experts.{e}.w2.weight"),
           qk_norm=lambda config: False, expert_width_key="intermediate_size",
           experts_key="num_local_experts",
           flags=_mixtral_flags, config_keys=_mixtral_config,
           marks={"qk_layernorm": False, "moe_router_pre_softmax": False,
                  "moe_shared_expert_gate": False, "moe_router_score_function": "softmax",
                  "multi_latent_attention": False}),
)}

REFUSED: dict[str, str] = {
    "OlmoeForCausalLM": "OLMoE normalises q and k over the whole projection (one RMSNorm of "
                        "num_heads*head_dim), megatron's --qk-layernorm normalises each head "
                        "(head_dim): the forward would differ",
}


def family_of_architecture(architectures) -> Family:
    names = list(architectures or [])
    if len(names) != 1:
        raise ConvertError(f"config.json names architectures {names!r}; one is needed")
    name = names[0]
    if name in REFUSED:
        raise ConvertError(f"{name} is not supported: {REFUSED[name]}")
    if name not in FAMILIES:
        raise ConvertError(f"{name} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def family_of_args(args) -> Family:
    """The family whose marks the saved args carry (the first, in registry order)."""
    for family in FAMILIES.values():
        if all(getattr(args, key, None) == value for key, value in family.marks.items()):
            return family
    seen = {key: getattr(args, key, None) for family in FAMILIES.values() for key in family.marks}
    raise ConvertError(f"no Hugging Face family has the checkpoint's {seen}")
