"""Which Hugging Face tensors make each parameter of megatron's world-size-1 GPTModel (local
spec), and the two layouts megatron fuses:

* `linear_qkv`: per query group g, the group's query heads, then its key head, then its value
  head ([g0: q.. k v][g1: q.. k v]...), rows of head_dim each; HF keeps q, k, v apart.
  The q, k and v biases (Qwen2-MoE, GLM-4.5) are fused the same way.
* an expert's (the shared expert's, a dense layer's) `linear_fc1`: the SwiGLU gate rows, then
  the up rows (megatron's swiglu takes silu of the first half times the second); HF keeps
  gate_proj and up_proj apart.

Embedding and output layer carry megatron's padded vocabulary; the rows past the HF vocabulary
are zeros on import and are dropped on export.

A multi-token-prediction layer (GLM-4.5, DeepSeek-V3: HF layer num_hidden_layers + k) is
megatron's `mtp.layers.{k}`: enorm normalises the next token's embedding, hnorm the main
model's last hidden state, eh_proj projects [enorm(embedding); hnorm(hidden)] in this order
(megatron's MultiTokenPredictionLayer and vLLM's DeepSeek and GLM MTP layers concatenate so;
the DeepSeek-V3 report's equation 21 writes the hidden state first), then a decoder layer and
shared_head.norm (megatron's final_layernorm of the layer).
"""

from __future__ import annotations

import dataclasses

import torch

from .architecture import head_dim
from .families import Family

COPY, QKV, GATE_UP, VOCAB = "copy", "qkv", "gate_up", "vocab"


@dataclasses.dataclass(frozen=True)
class Rule:
    megatron: str  # parameter name in the world-size-1 model's state_dict
    hf: tuple[str, ...]  # the HF tensors it is made of, in fused order
    layout: str  # COPY, QKV, GATE_UP or VOCAB


def rules(family: Family, config) -> list[Rule]:
    """Every parameter of the model, in the order of the HF checkpoint's layers."""
    found = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB)]
    moe_layers = family.moe_layers(config)
    for i in range(config.num_hidden_layers):
        found += _layer_rules(family, config, f"model.layers.{i}.", f"decoder.layers.{i}.",
                              moe_layers[i])
    found.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), COPY))
    if not config.tie_word_embeddings:
        found.append(Rule("output_layer.weight", ("lm_head.weight",), VOCAB))
    for k in range(family.mtp_layers(config)):
        hf, mc = f"model.layers.{config.num_hidden_layers + k}.", f"mtp.layers.{k}."
        found += [Rule(mc + f"{p}.weight", (hf + f"{p}.weight",), COPY)
                  for p in ("enorm", "hnorm", "eh_proj")]
        # megatron builds an MTP layer with its last decoder layer's spec
        found += _layer_rules(family, config, hf, mc + "mtp_model_layer.", moe_layers[-1])
        found.append(Rule(mc + "final_layernorm.weight", (hf + "shared_head.norm.weight",), COPY))
    return found


def mtp_copies(family: Family, config) -> list[Rule]:
    """The HF tensors of each multi-token-prediction layer that repeat a parameter of the main
    model: its embed_tokens and its shared_head.head. DeepSeek-V3's MTP module shares the main
    model's embedding and output head (its README_WEIGHTS.md), as megatron's MTP layers do; its
    checkpoint holds them in the MTP layer too, where vLLM's MTP loader reads them."""
    head = "embedding.word_embeddings.weight" if config.tie_word_embeddings \
        else "output_layer.weight"
    found = []
    for k in range(family.mtp_layers(config)):
        hf = f"model.layers.{config.num_hidden_layers + k}."
        found += [Rule("embedding.word_embeddings.weight", (hf + "embed_tokens.weight",), VOCAB),
                  Rule(head, (hf + "shared_head.head.weight",), VOCAB)]
    return found


def _layer_rules(family: Family, config, hf: str, mc: str, moe: bool) -> list[Rule]:
    """One decoder layer: its norms, attention and MoE or dense MLP."""
    found = [Rule(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), COPY)]
    found += _ATTENTION_RULES[family.attention](family, config, hf + "self_attn.",
                                                mc + "self_attention.")
    found.append(Rule(mc + "pre_mlp_layernorm.weight",
                      (hf + "post_attention_layernorm.weight",), COPY))
    return found + (_moe_rules(family, config, hf, mc) if moe else _dense_rules(family, hf, mc))


def _grouped_query_attention_rules(family: Family, config, hf: str, mc: str) -> list[Rule]:
    """q, k, v fused per query group (and their biases), the output projection, the per-head
    q and k norms where the family has them."""
    found = [Rule(mc + "linear_qkv.weight", tuple(f"{hf}{p}_proj.weight" for p in "qkv"), QKV),
             Rule(mc + "linear_proj.weight", (hf + "o_proj.weight",), COPY)]
    if family.qkv_bias_key and getattr(config, family.qkv_bias_key):
        found.append(Rule(mc + "linear_qkv.bias", tuple(f"{hf}{p}_proj.bias" for p in "qkv"),
                          QKV))
    if family.qk_norm(config):
        found += [Rule(mc + f"{p}_layernorm.weight", (f"{hf}{p}_norm.weight",), COPY)
                  for p in "qk"]
    return found


def _multi_latent_attention_rules(family: Family, config, hf: str, mc: str) -> list[Rule]:
    """DeepSeek's projections, one megatron linear each in the same row order: q (through its
    compressed rank and norm where q_lora_rank is set), per head [nope | rope] dims; the
    compressed kv [kv_lora_rank | the shared rope key]; its up-projection, per head [k nope | v]."""
    if config.q_lora_rank is None:
        found = [Rule(mc + "linear_q_proj.weight", (hf + "q_proj.weight",), COPY)]
    else:
        found = [Rule(mc + "linear_q_down_proj.weight", (hf + "q_a_proj.weight",), COPY),
                 Rule(mc + "q_layernorm.weight", (hf + "q_a_layernorm.weight",), COPY),
                 Rule(mc + "linear_q_up_proj.weight", (hf + "q_b_proj.weight",), COPY)]
    return found + [
        Rule(mc + "linear_kv_down_proj.weight", (hf + "kv_a_proj_with_mqa.weight",), COPY),
        Rule(mc + "kv_layernorm.weight", (hf + "kv_a_layernorm.weight",), COPY),
        Rule(mc + "linear_kv_up_proj.weight", (hf + "kv_b_proj.weight",), COPY),
        Rule(mc + "linear_proj.weight", (hf + "o_proj.weight",), COPY)]


_ATTENTION_RULES = {"gqa": _grouped_query_attention_rules, "mla": _multi_latent_attention_rules}


def _moe_rules(family: Family, config, hf: str, mc: str) -> list[Rule]:
    """A MoE layer's router (and its expert bias), experts and shared expert, where the family
    has them."""
    found = [Rule(mc + "mlp.router.weight", (hf + family.router,), COPY)]
    if family.expert_bias:
        found.append(Rule(mc + "mlp.router.expert_bias", (hf + family.expert_bias,), COPY))
    gate, up, down = family.expert_projections
    for e in range(getattr(config, family.experts_key)):
        expert = f"{mc}mlp.experts.local_experts.{e}."
        found += [Rule(expert + "linear_fc1.weight",
                       (hf + gate.format(e=e), hf + up.format(e=e)), GATE_UP),
                  Rule(expert + "linear_fc2.weight", (hf + down.format(e=e),), COPY)]
    if family.shared_expert:
        gate, up, down = family.shared_expert
        shared = mc + "mlp.shared_experts."
        found += [Rule(shared + "linear_fc1.weight", (hf + gate, hf + up), GATE_UP),
                  Rule(shared + "linear_fc2.weight", (hf + down,), COPY)]
        if family.shared_expert_gate:
            found.append(Rule(shared + "gate_weight", (hf + family.shared_expert_gate,), COPY))
    return found


def _dense_rules(family: Family, hf: str, mc: str) -> list[Rule]:
    """A dense layer's SwiGLU MLP."""
    gate, up, down = family.dense_mlp
    return [Rule(mc + "mlp.linear_fc1.weight", (hf + gate, hf + up), GATE_UP),
            Rule(mc + "mlp.linear_fc2.weight", (hf + down,), COPY)]


def _groups(config) -> tuple[int, int, int]:
    """(query groups, query heads per group, head_dim)."""
    groups = config.num_key_value_heads
    return groups, config.num_attention_heads // groups, head_dim(config)


def fuse(rule: Rule, tensors: list[torch.Tensor], config, padded_vocab: int) -> torch.Tensor:
    """The megatron parameter of `rule` from its HF tensors."""
    if rule.layout == COPY:
        return tensors[0]
    if rule.layout == GATE_UP:
        return torch.cat(tensors, dim=0)
    if rule.layout == VOCAB:
        (table,) = tensors
        return torch.cat([table, table.new_zeros(padded_vocab - table.shape[0], table.shape[1])])
    groups, per_group, dim = _groups(config)
    q, k, v = tensors
    rest = q.shape[1:]  # (hidden,) for the weights, () for the biases
    return torch.cat([q.reshape(groups, per_group * dim, *rest), k.reshape(groups, dim, *rest),
                      v.reshape(groups, dim, *rest)], dim=1).reshape(-1, *rest)


def hf_shapes(rule: Rule, target: tuple[int, ...], config) -> list[tuple[int, ...]]:
    """The shape config.json implies for each HF tensor of `rule`, whose megatron parameter has
    shape `target`."""
    if rule.layout == COPY:
        return [tuple(target)]
    if rule.layout == GATE_UP:
        return [(target[0] // 2, *target[1:])] * 2
    if rule.layout == VOCAB:
        return [(config.vocab_size, *target[1:])]
    groups, per_group, dim = _groups(config)
    rest = tuple(target[1:])
    return [(groups * per_group * dim, *rest), (groups * dim, *rest), (groups * dim, *rest)]


def split(rule: Rule, param: torch.Tensor, config) -> list[torch.Tensor]:
    """The HF tensors of `rule` from its megatron parameter, contiguous (views of it where its
    rows already are: the export writes each one's bytes as it comes)."""
    if rule.layout == COPY:
        parts = [param]
    elif rule.layout == GATE_UP:
        parts = list(param.chunk(2, dim=0))
    elif rule.layout == VOCAB:
        parts = [param[:config.vocab_size]]
    else:
        groups, per_group, dim = _groups(config)
        rest = param.shape[1:]
        q, k, v = param.reshape(groups, (per_group + 2) * dim, *rest).split(
            [per_group * dim, dim, dim], dim=1)
        parts = [t.reshape(-1, *rest) for t in (q, k, v)]
    return [part.detach().contiguous() for part in parts]


def unmapped(names, family: Family, config) -> list[str]:
    """The megatron state-dict entries among `names` that no rule maps to a Hugging Face
    tensor (Transformer Engine's `_extra_state` entries hold no weights)."""
    mapped = {rule.megatron for rule in rules(family, config)}
    return [name for name in names if name not in mapped and not name.endswith("_extra_state")]

