"""A HybridModel stack spec built from megatron's local (non-Transformer-Engine) modules.

megatron-core 0.19.2 ships HybridModel stack specs for Transformer Engine and for inference
only: without TE (CPU, a bare GPU) `--hybrid-layer-pattern` cannot build. This spec fills the
same `HybridStackSubmodules` slots with the modules megatron's local GPT spec uses
(`LocalSpecProvider`: ColumnParallelLinear / RowParallelLinear, DotProductAttention, the local
norm, SequentialMLP experts), for the layer families the local path supports: `*` attention,
`-` dense MLP, `E` MoE, and MTP blocks after `/`. The other families (Mamba, GDN, DSA, MLA)
keep megatron's IdentityOp default and are refused by preflight before anything is built.

Where TE fuses the norm into the following linear (TELayerNormColumnParallelLinear), the local
spec has a separate norm in the layer's norm slot, as megatron's local GPT spec does, and saves
it under TE's fused key (`self_attention.linear_qkv.layer_norm_*`, a dense MLP's
`mlp.linear_fc1.layer_norm_*`); a MoE layer's pre-MLP norm is a module of its own in TE's hybrid
spec too and keeps its own key (`pre_mlp_layernorm.*`, as the local GPT spec saves it with
moe-norm-checkpoint-key). So megatron's GPT-to-Hybrid checkpoint loading
(`gpt_checkpoint_interop`) reads a local-spec or TE GPT checkpoint into this HybridModel.
"""

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock, MultiTokenPredictionBlockSubmodules, MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer, TransformerLayer, TransformerLayerSubmodules)

class LocalNormHybridStack(HybridStack):
    """megatron's HybridStack with the local final norm: megatron builds TENorm there
    unconditionally ("Hybrid always uses TransformerEngine"), which cannot build without TE."""

    def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and self.post_layer_norm:
            self.final_norm = LocalSpecProvider().layer_norm(
                rms_norm=config.normalization == "RMSNorm")(
                config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)


# The layer families this spec builds (pattern symbols, megatron's Symbols).
LOCAL_FAMILIES = {"*": "attention", "-": "dense MLP", "E": "MoE"}
# The others, built by megatron's Transformer Engine stack spec; some need more packages.
TE_FAMILIES = {"M": "Mamba", "G": "gated delta net", "D": "DeepSeek sparse attention",
               "+": "multi-latent attention"}
FAMILY_PACKAGES = {"M": ("mamba_ssm", "causal_conv1d"), "G": ("fla",)}


def pattern_problem(pattern: str, transformer_impl: str) -> str | None:
    """Why --hybrid-layer-pattern cannot build here (a layer family the spec or the machine
    lacks), or None. The pattern's syntax and its pipeline segments are megatron's to judge."""
    import importlib.util

    symbols = set(pattern) - {"|", "/"}
    if transformer_impl == "local":
        missing = sorted(symbols - set(LOCAL_FAMILIES))
        if missing:
            names = ", ".join(f"'{m}' ({TE_FAMILIES.get(m, 'unknown')})" for m in missing)
            return (f"layer families {names} need megatron's Transformer Engine HybridModel "
                    f"spec, and this run builds the local spec (--transformer-impl local); "
                    f"fix: install Transformer Engine, or use only "
                    + ", ".join(f"'{k}' ({v})" for k, v in LOCAL_FAMILIES.items()))
        return None
    for symbol in sorted(symbols):
        absent = [p for p in FAMILY_PACKAGES.get(symbol, ()) if importlib.util.find_spec(p) is None]
        if absent:
            return (f"layer family '{symbol}' ({TE_FAMILIES[symbol]}) needs the package(s) "
                    f"{', '.join(absent)}, not installed; fix: pip install them or drop "
                    f"'{symbol}' from the pattern")
    return None


def local_hybrid_stack_spec(normalization: str, num_experts: int | None) -> ModuleSpec:
    backend = LocalSpecProvider()
    norm = backend.layer_norm(rms_norm=normalization == "RMSNorm")
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
        ),
    )
    dense_mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm,
            mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(
                linear_fc1=backend.column_parallel_linear(),
                linear_fc2=backend.row_parallel_linear())),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
        ),
    )
    moe = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm,
            mlp=get_moe_module_spec_for_backend(backend=backend, num_experts=num_experts or 1),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    # The MTP block carries its norms and projection; its inner layers are built from the
    # pattern after "/" with the slots above.
    mtp_block = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[ModuleSpec(
            module=MultiTokenPredictionLayer,
            submodules=MultiTokenPredictionLayerSubmodules(
                enorm=norm, hnorm=norm, eh_proj=backend.column_parallel_linear(),
                mtp_model_layer=None, layer_norm=norm),
        )]),
    )
    return ModuleSpec(module=LocalNormHybridStack, submodules=HybridStackSubmodules(
        attention_layer=attention, mlp_layer=dense_mlp, moe_layer=moe, mtp_block_spec=mtp_block))


def hybrid_model_config(args):
    """megatron's own HybridModelConfig for these args, with the local stack spec where the
    model is built without Transformer Engine and no --spec was given."""
    from megatron.training.argument_utils import hybrid_config_from_args

    config = hybrid_config_from_args(args)
    if args.transformer_impl == "local" and config.hybrid_stack_spec is None:
        config.hybrid_stack_spec = local_hybrid_stack_spec(args.normalization, args.num_experts)
    return config
