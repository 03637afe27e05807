"""Sequence parallelism for megatron's local (non-Transformer-Engine) norm.

MoE with TP > 1 requires sequence parallelism (megatron asserts it), but the local spec's
`WrappedTorchNorm` refuses `config.sequence_parallel`. Under sequence parallelism a norm sees
only its rank's slice of the sequence, so its weight gradients must be summed over the TP group;
megatron does that for every parameter marked `sequence_parallel = True`. This patch builds the
same torch norm and marks its parameters, which is what Transformer Engine's norms do.
Affects every install without Transformer Engine (CPU, bare GPU). Targets 0.15.x - 0.19.x.
"""

import types

import torch

from megatron.core.transformer import torch_norm

from megatron_patches.registry import Patch, register

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


def _not_needed_because(context):
    probe = types.SimpleNamespace(
        layernorm_zero_centered_gamma=False, persist_layer_norm=False, sequence_parallel=True,
        memory_efficient_layer_norm=False, normalization="LayerNorm")
    try:
        torch_norm.WrappedTorchNorm(probe, hidden_size=8)
    except AssertionError:
        return None
    return "WrappedTorchNorm accepts sequence parallelism"


def _apply():
    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, eps, **kwargs)
        if config.normalization not in _NORMS:
            raise ValueError(f"--normalization {config.normalization} has no sequence-parallel "
                             f"local implementation; use LayerNorm or RMSNorm")
        norm = _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


PATCH = register(Patch(
    name="local-norm-sequence-parallel",
    upstream="local spec: torch_norm.WrappedTorchNorm asserts not sequence_parallel",
    versions=">=0.15,<0.20",
    summary="torch norms under sequence parallelism, weights marked for TP grad all-reduce",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
