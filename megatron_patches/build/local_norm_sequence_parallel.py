"""Sequence parallelism for megatron's local (non-Transformer-Engine) norm.

MoE with TP > 1 requires sequence parallelism (megatron asserts it), but the local spec's
`WrappedTorchNorm` refuses `config.sequence_parallel`. Under sequence parallelism a norm sees
only its rank's slice of the sequence, so its weight gradients must be summed over the TP group;
megatron does that for every parameter marked `sequence_parallel = True`, which is what
Transformer Engine's norms carry. Affects every install without Transformer Engine (CPU, bare
GPU). Targets 0.15.x - 0.19.x.

The norm is still built by megatron's own `WrappedTorchNorm`, with every check it makes
(zero-centred gamma from --apply-layernorm-1p, persistent or memory-efficient norms, the
normalization kind): only its sequence-parallel refusal is answered, by showing it a copy of the
config with sequence_parallel off. The built norm's parameters are then marked.
"""

import copy
import types

from megatron.core.transformer import torch_norm

from megatron_patches.registry import Patch, register

NAME = "local-norm-sequence-parallel"


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
        # A shallow copy: the norm does not keep the config, and the model's config (shared by
        # every layer) is left as it is.
        without_sequence_parallel = copy.copy(config)
        without_sequence_parallel.sequence_parallel = False
        norm = build(cls, without_sequence_parallel, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new.__wrapped__, new.__wrapped_by__ = build, NAME  # megatron's own, for the unpatched test
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


PATCH = register(Patch(
    name=NAME,
    upstream="local spec: torch_norm.WrappedTorchNorm asserts not sequence_parallel",
    versions=">=0.15,<0.20",
    summary="megatron's torch norms under sequence parallelism, weights marked for TP grad "
            "all-reduce",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
