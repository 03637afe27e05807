"""Multi-latent attention without a query rank (`--q-lora-rank` unset, DeepSeek-V2-Lite) and with
`--qk-layernorm`: q projected from the layer's input as DeepSeek projects it, with no norm of its
own.

DeepSeek's MLA normalises the compressed q (`q_a_layernorm`, only where q goes through a rank) and
the compressed kv (`kv_a_layernorm`, always); megatron's `--qk-layernorm` switches both. Where
q_lora_rank is None there is no compressed q: DeepSeek-V2-Lite computes q_proj(input_layernorm(x)).
megatron-core 0.19.2's resolver of MLA's norms (`QKNormConfigResolver._resolve_mla_qk_layernorm`)
instead makes `linear_q_proj` the backend's fused norm+linear whenever qk_layernorm is set: with
Transformer Engine (every GPU recipe) q becomes q_proj(RMSNorm(input_layernorm(x))), a trainable
norm the architecture does not have, silently (NVIDIA-NeMo/Megatron-Bridge#5261: the MCore
behaviour behind its DeepSeek-V2-Lite bridge's extra parameter); on the local spec, whose
`q_layernorm` slot holds a norm, the same layer refuses to build (ValueError "q_layernorm ... is
non-trivial, but q_lora_rank is None").

The patch resolves such a layer with no q norm at all: `linear_q_proj` the spec's plain linear,
`q_layernorm` IdentityOp; the kv side (and every layer with a query rank) is megatron's own.
Needed where megatron resolves a norm into a rank-less q projection. Targets 0.19.x (the
resolver's first release).
"""

from __future__ import annotations

import copy
import functools

from megatron_patches.registry import Patch, register

NAME = "mla-q-projection-without-norm"


def _resolver():
    try:
        from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
    except ImportError:
        return None
    return QKNormConfigResolver


def _rank_less_q_with_qk_norm(resolver) -> bool:
    config = resolver.config
    return (config.qk_layernorm and not resolver.has_q_lora and not resolver.is_dsa
            and not config.qk_l2_norm)


def _not_needed_because(context):
    resolver = _resolver()
    if resolver is None:
        return "this megatron-core has no MLA norm resolver"
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, multi_latent_attention=True,
        q_lora_rank=None, kv_lora_rank=4, qk_head_dim=2, qk_pos_emb_head_dim=2, v_head_dim=2,
        qk_layernorm=True, normalization="RMSNorm", transformer_impl="local",
        use_cpu_initialization=True, perform_initialization=False)
    submodules = get_gpt_layer_local_submodules(
        multi_latent_attention=True, qk_layernorm=True,
        normalization="RMSNorm").self_attention.submodules
    try:
        resolved = resolver(config, submodules).resolve()
    except ValueError:  # megatron refuses the rank-less q with a norm slot of the local spec
        return None
    if resolved["q_layernorm"] in (None, IdentityOp) and \
            resolved["linear_q_proj"] is submodules.linear_q_proj:
        return "megatron's MLA norm resolver gives a rank-less q projection no norm"
    return None


def _without_q_norm(resolve):
    @functools.wraps(resolve)
    def resolve_without_q_norm(self):
        if not _rank_less_q_with_qk_norm(self):
            return resolve(self)
        from megatron.core.transformer.identity_op import IdentityOp

        plain_linear = self.submodules.linear_q_proj or self.linear_impl
        if self._is_fused_norm_linear(plain_linear):  # a spec that asks for the norm keeps it
            return resolve(self)
        rank_less = copy.copy(self)
        rank_less.submodules = copy.copy(self.submodules)
        rank_less.submodules.q_layernorm = IdentityOp  # no compressed q to normalise
        fused_or_default = self._mla_fused_linear_or_default

        def q_projection_unfused(module_spec, module_name):
            # megatron's one choice this patch changes: the rank-less q projection's
            if module_name == "linear_q_proj":
                return plain_linear
            return fused_or_default(module_spec, module_name)

        rank_less._mla_fused_linear_or_default = q_projection_unfused
        return resolve(rank_less)

    resolve_without_q_norm.__wrapped_by__ = NAME
    return resolve_without_q_norm


def _apply():
    resolver = _resolver()
    resolver.resolve = _without_q_norm(resolver.resolve)


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA-NeMo/Megatron-Bridge#5261 (megatron-core's MLA norm resolver)",
    versions=">=0.19,<0.20",
    summary="MLA without --q-lora-rank and with --qk-layernorm projects q from the layer's input "
            "with no norm of its own, as DeepSeek-V2-Lite does (megatron fused an RMSNorm into "
            "linear_q_proj under Transformer Engine and refused the layer on the local spec)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
