"""Patch local-norm-sequence-parallel: under sequence parallelism megatron's own WrappedTorchNorm
builds the norm, with every check it makes without sequence parallelism, and its weights are
marked for the TP gradient all-reduce. (Training with TP2 + SP: test_train_resume_cpu, tp2-ep2.)
"""

import pytest
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_patches import registry

# TransformerConfig fields megatron's WrappedTorchNorm checks (--apply-layernorm-1p sets
# layernorm_zero_centered_gamma); the first two it accepts, the others it refuses.
NORM_CONFIGS = {
    "layernorm": dict(normalization="LayerNorm"),
    "rmsnorm": dict(normalization="RMSNorm"),
    "apply-layernorm-1p": dict(normalization="LayerNorm", layernorm_zero_centered_gamma=True),
    "rmsnorm-1p": dict(normalization="RMSNorm", layernorm_zero_centered_gamma=True),
    "persist-layer-norm": dict(persist_layer_norm=True),
    "memory-efficient-layer-norm": dict(memory_efficient_layer_norm=True),
}


@pytest.fixture(scope="module", autouse=True)
def patches_applied():
    registry.load_patches()
    statuses = registry.apply_patches(registry.current_context(cpu_backend=True))
    assert next(s for s in statuses if s.name == "local-norm-sequence-parallel").applied


def tensor_parallel_config(sequence_parallel: bool, **fields) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                             tensor_model_parallel_size=2, sequence_parallel=sequence_parallel,
                             **fields)


def build(config: TransformerConfig):
    """(what megatron built or refused, the norm or None)."""
    try:
        norm = WrappedTorchNorm(config, hidden_size=64, eps=1e-6)
    except Exception as error:  # megatron refuses with assertions
        return (type(error).__name__, str(error)), None
    shapes = [(name, tuple(p.shape)) for name, p in norm.named_parameters()]
    return (type(norm).__name__, norm.normalized_shape, norm.eps, shapes), norm


@pytest.mark.parametrize("fields", NORM_CONFIGS.values(), ids=NORM_CONFIGS)
def test_sequence_parallel_norm_is_megatrons_norm_or_megatrons_refusal(fields):
    without_sp, plain = build(tensor_parallel_config(False, **fields))
    config = tensor_parallel_config(True, **fields)
    with_sp, norm = build(config)
    assert with_sp == without_sp
    assert config.sequence_parallel, "the model's config must stay sequence parallel"
    if norm is not None:
        assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
        assert not any(getattr(p, "sequence_parallel", False) for p in plain.parameters())


def test_apply_layernorm_1p_stays_refused_under_sequence_parallelism():
    outcome, _ = build(tensor_parallel_config(True, layernorm_zero_centered_gamma=True))
    assert outcome == ("AssertionError", "zero_centered_gamma not supported by torch LayerNorm")


def test_megatron_alone_refuses_every_sequence_parallel_norm(monkeypatch):
    """The patch left out (megatron-core's own WrappedTorchNorm.__new__): every norm of the local
    spec refuses sequence parallelism, which MoE with TP > 1 requires, so no such model builds."""
    from _unpatched import leave_out

    leave_out(monkeypatch, "local-norm-sequence-parallel", WrappedTorchNorm, "__new__")
    for fields in (NORM_CONFIGS["layernorm"], NORM_CONFIGS["rmsnorm"]):
        assert build(tensor_parallel_config(False, **fields))[1] is not None
        outcome, norm = build(tensor_parallel_config(True, **fields))
        assert norm is None and outcome[0] == "AssertionError", outcome
