"""megatron's native fused cross-entropy (--cross-entropy-loss-fusion) judged by torch's own:
the gradient it gives the logits, in process, against torch.nn.functional.cross_entropy's
autograd gradient of the same mean token loss (patch fused-cross-entropy-gradient-dtype).
Launched and judged by transformers: tests/moe_launcher/test_convert_hf.py."""

import pytest
import torch

import _megatron_cpu as cpu
import _unpatched

PATCH = "fused-cross-entropy-gradient-dtype"
SEQ, BATCH, VOCAB = 8, 2, 50


def _gradients(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits' gradient of the mean token loss through megatron's fused cross-entropy (TP1),
    and torch's reference gradient in fp32 of the same logits."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    cpu.init_world()
    draw = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(SEQ, BATCH, VOCAB, generator=draw)).to(dtype).requires_grad_()
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=draw)
    # (before megatron's forward, which works in place on fp32 logits)
    reference = logits.detach().float().clone().requires_grad_()
    torch.nn.functional.cross_entropy(reference.flatten(0, 1), target.flatten()).backward()
    losses = fused_vocab_parallel_cross_entropy(
        logits, target, parallel_state.get_tensor_model_parallel_group())
    losses.mean().backward()
    return logits.grad, reference.grad


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_fp32_logits_get_an_fp32_gradient(patched, monkeypatch):
    """fp32 logits: torch's gradient to fp32 rounding. With the patch left out (megatron-core
    0.19.2's own backward), torch's gradient rounded to bf16: up to 2^-8 of each element off."""
    from megatron.core.fusions.fused_cross_entropy import _VocabParallelCrossEntropy

    _unpatched.apply_all()
    if not patched:
        _unpatched.leave_out(monkeypatch, PATCH, _VocabParallelCrossEntropy, "backward")
    gradient, reference = _gradients(torch.float32)
    assert gradient.dtype == torch.float32
    off = ((gradient - reference).abs() / reference.abs().clamp(min=1e-12)).max().item()
    if patched:
        assert off < 1e-5, off
    else:
        assert 1e-4 < off <= 2 ** -8, off
        assert torch.equal(gradient, gradient.bfloat16().float())  # every element a bf16 value


def test_bf16_logits_keep_megatrons_own_gradient(monkeypatch):
    """bf16 logits: the patch leaves megatron's backward in charge, bit for bit."""
    from megatron.core.fusions.fused_cross_entropy import _VocabParallelCrossEntropy

    _unpatched.apply_all()
    patched, reference = _gradients(torch.bfloat16)
    _unpatched.leave_out(monkeypatch, PATCH, _VocabParallelCrossEntropy, "backward")
    unpatched, _ = _gradients(torch.bfloat16)
    assert patched.dtype == torch.bfloat16 and torch.equal(patched, unpatched)
    assert torch.allclose(patched.float(), reference, rtol=2 ** -7, atol=1e-6)
