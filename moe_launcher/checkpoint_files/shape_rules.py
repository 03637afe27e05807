"""The global shapes a saved model config implies, for the offline audit (it has no model).

Rules from flag names can only be as complete as the flags they know: a flag that changes a
tensor's shape in a way these rules do not model makes that tensor "unchecked" (no rule), never
"damaged". The save and load guards do not use these rules for the model being trained: they
read the true shapes from the parameters megatron built (moe_launcher.model.param_shapes).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Any, Mapping, Sequence

# Training-args flags whose effect on tensor shapes these rules do not model, and the tensor
# families each one leaves unchecked.
_UNMODELLED_FLAGS = {
    "quick_geglu": ("mlp_fc1",),  # a gated fc1 (twice the rows) the rules would not expect
    "attention_output_gate": ("attention",),  # qkv also projects the output gate
    "multi_latent_attention": ("attention",),  # projections through other widths
    "moe_latent_size": ("experts",),  # experts work in a latent width
    "heterogeneous_layers_config_path": ("layers",),  # per-layer widths
    "heterogeneous_layers_config_encoded_json": ("layers",),
}


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The model sizes that fix every weight's global shape (parallelism never changes them)."""

    hidden: int
    num_experts: int | None
    moe_ffn: int | None
    ffn: int | None
    glu: bool
    heads: int | None
    query_groups: int | None
    kv_channels: int | None
    padded_vocab: int | None = None  # only training args know the padded vocabulary
    expert_tensor_parallel: int = 1
    unmodelled: frozenset[str] = frozenset()  # tensor families no rule may judge

    @classmethod
    def from_args(cls, args: Any) -> "ModelDims":
        """From megatron training args (the Namespace saved in every checkpoint, or the dict
        megatron.training turns it into for its common-state consistency check)."""
        if isinstance(args, Mapping):
            args = types.SimpleNamespace(**args)
        heads = getattr(args, "num_attention_heads", None)
        groups = getattr(args, "num_query_groups", None) if getattr(
            args, "group_query_attention", False) else None
        kv = getattr(args, "kv_channels", None) or (heads and args.hidden_size // heads)
        unmodelled = frozenset(family for flag, families in _UNMODELLED_FLAGS.items()
                               if getattr(args, flag, None) for family in families)
        return cls(
            hidden=args.hidden_size,
            num_experts=getattr(args, "num_experts", None),
            moe_ffn=getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None),
            ffn=getattr(args, "ffn_hidden_size", None),
            glu=bool(getattr(args, "swiglu", False)),
            heads=heads,
            query_groups=groups or heads,
            kv_channels=kv,
            padded_vocab=getattr(args, "padded_vocab_size", None),
            expert_tensor_parallel=getattr(args, "expert_tensor_parallel_size", None) or 1,
            unmodelled=unmodelled,
        )


# `linear_fc1.weight`, grouped `weight3`, fsdp_dtensor's SwiGLU halves `weight_w` / `weight3_v`.
_EXPERT = re.compile(
    r"mlp\.experts\.(?P<form>experts\.|local_experts\.\d+\.|)linear_fc(?P<fc>[12])\."
    r"(?P<kind>weight|bias)(?P<idx>\d*)(?P<half>_[wv])?$"
)
_ATTENTION = re.compile(r"self_attention\.linear_(?P<which>qkv|proj)\.weight$")
_ROUTER = re.compile(r"mlp\.router\.weight$")
_DENSE_MLP = re.compile(r"mlp\.linear_fc(?P<fc>[12])\.weight$")  # not (shared_)experts.linear_fc
_VOCAB = re.compile(r"(embedding\.word_embeddings|output_layer)\.weight$")
# Norms over the hidden size only (q/k/kv norms of other widths are left unchecked).
_NORM = re.compile(r"((input|pre_mlp|pre_cross_attn|final)_layernorm\.(weight|bias)"
                   r"|linear_(qkv|fc1)\.layer_norm_(weight|bias))$")
_LAYER = re.compile(r"(^|\.)layers\.")


def is_expert_key(key: str) -> bool:
    return _EXPERT.search(key) is not None


def expected_shape(key: str, shape: Sequence[int], dims: ModelDims) -> tuple[int | None, ...] | None:
    """The global shape `dims` implies for tensor `key`, None where no rule may judge it.

    Entries are None for axes the config does not fix (the stacked layer axis megatron prepends
    to `decoder.layers.*` keys). `shape` is only used for its rank: leading stacking axes.
    """
    if "layers" in dims.unmodelled and _LAYER.search(key):
        return None
    if m := _EXPERT.search(key):
        if dims.num_experts is None or dims.moe_ffn is None or "experts" in dims.unmodelled:
            return None
        fc1 = m["fc"] == "1"
        if fc1 and "mlp_fc1" in dims.unmodelled:
            return None
        rows = dims.moe_ffn * (2 if fc1 and dims.glu and not m["half"] else 1)
        if m["kind"] == "bias":
            core: tuple[int, ...] = (rows,) if fc1 else (dims.hidden,)
        else:
            core = (rows, dims.hidden) if fc1 else (dims.hidden, dims.moe_ffn)
        # SequentialMLP/TEGroupedMLP under torch_dist stack experts on an axis before the matrix.
        if m["form"] == "experts." or (not m["form"] and not m["idx"]
                                         and len(shape) == _stacked_layers(key) + 1 + len(core)):
            core = (dims.num_experts,) + core
        return _with_leading(shape, core)
    if (m := _ATTENTION.search(key)) and dims.heads and dims.kv_channels:
        if "attention" in dims.unmodelled:
            return None
        if m["which"] == "qkv":
            core = ((dims.heads + 2 * dims.query_groups) * dims.kv_channels, dims.hidden)
        else:
            core = (dims.hidden, dims.heads * dims.kv_channels)
        return _with_leading(shape, core)
    if _ROUTER.search(key) and dims.num_experts:
        return _with_leading(shape, (dims.num_experts, dims.hidden))
    if (m := _DENSE_MLP.search(key)) and dims.ffn:
        fc1 = m["fc"] == "1"
        if fc1 and "mlp_fc1" in dims.unmodelled:
            return None
        core = (dims.ffn * (2 if dims.glu else 1), dims.hidden) if fc1 else (dims.hidden, dims.ffn)
        return _with_leading(shape, core)
    if _VOCAB.search(key) and dims.padded_vocab:
        return _with_leading(shape, (dims.padded_vocab, dims.hidden))
    if _NORM.search(key):
        return _with_leading(shape, (dims.hidden,))
    return None


def _stacked_layers(key: str) -> int:
    # torch_dist keys `decoder.layers.X` (no layer number) carry a prepended layer axis.
    return 1 if re.search(r"layers\.(?!\d)", key) else 0


def _with_leading(shape: Sequence[int], core: tuple[int, ...]) -> tuple[int | None, ...] | None:
    lead = len(shape) - len(core)
    if lead < 0:
        return core  # fewer axes than the config implies: shape_matches reports it
    return (None,) * lead + core


def shape_matches(shape: Sequence[int], expected: Sequence[int | None]) -> bool:
    return len(shape) == len(expected) and all(e is None or e == s for s, e in zip(shape, expected))


def expected_numel(shape: Sequence[int], expected: Sequence[int | None]) -> int:
    """Elements of the true tensor; unchecked axes take the saved size."""
    if len(shape) != len(expected):
        return math.prod(e for e in expected if e is not None)
    return math.prod(s if e is None else e for s, e in zip(shape, expected))
