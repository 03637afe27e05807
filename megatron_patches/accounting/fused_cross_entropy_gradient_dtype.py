"""The fused cross-entropy's gradient in the logits' own precision, not rounded to bf16.

megatron-core 0.19.2's native fused cross-entropy (`--cross-entropy-loss-fusion`, whose default
`--cross-entropy-fusion-impl` is `native`; megatron/core/fusions/fused_cross_entropy.py)
computes the gradient of the logits in fp32 (its softmax is fp32) and then casts it to
torch.bfloat16, whatever the logits' dtype; the autograd engine casts it on to the logits'
dtype. In a bf16 run that is the cast the engine would make anyway. In an fp32 run every element
of the logits' gradient, and so the output layer's and everything below it, is rounded to
bf16's 8 significant bits (in an fp16 run, to 8 of fp16's 11): a tiny Mixtral's first gradient
norm is 7e-5 off transformers' own, where the unfused cross-entropy agrees to 1e-6
(tests/moe_launcher/test_convert_hf.py). No upstream issue found; targets 0.15-0.19.

The fix, on megatron's autograd function `_VocabParallelCrossEntropy`: its forward also notes
the logits' dtype; its backward stays megatron's own (compiled, bit for bit) for bf16 logits,
and for any other dtype computes the same gradient with megatron's own
`VocabParallelCrossEntropy` steps, left in fp32 for the engine to cast to the logits' dtype.
"""

from __future__ import annotations

import functools

import torch

from megatron_patches import registry
from megatron_patches.registry import Patch, PatchContext, register

NAME = "fused-cross-entropy-gradient-dtype"


def _fused_module():
    from megatron.core.fusions import fused_cross_entropy

    return fused_cross_entropy


def _eager(function):
    """The Python function under megatron's jit_fuser (torch.compile keeps it as
    `_torchdynamo_orig_callable`): probing it compiles nothing."""
    return getattr(function, "_torchdynamo_orig_callable", function)


def _logits_gradient(softmax, grad_output, target_mask, masked_target_1d) -> torch.Tensor:
    """d loss / d logits in the softmax's dtype (fp32): softmax minus the one-hot target on
    this partition, times the loss's gradient, through megatron's own steps."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    rows, arange, target_weight, gradient = (
        VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask))
    return VocabParallelCrossEntropy.calculate_gradients(rows, arange, masked_target_1d,
                                                         target_weight, gradient, grad_output)


def _not_needed_because(context: PatchContext) -> str | None:
    """Runs megatron's gradient step (eagerly) on fp32 operands and reads its dtype."""
    fused = _fused_module()
    softmax = torch.full((2, 1, 4), 0.25)
    try:
        gradient = _eager(fused.calculate_gradients)(
            softmax, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.bool),
            torch.zeros(2, dtype=torch.long))
    except (AttributeError, TypeError, RuntimeError) as error:
        return f"cannot probe megatron's fused cross-entropy gradient ({error})"
    if gradient.dtype == torch.float32:
        return "megatron's fused cross-entropy returns the gradient of fp32 logits in fp32"
    return None


def _apply() -> None:
    function = _fused_module()._VocabParallelCrossEntropy
    if registry.wrapped_by(function.backward, NAME):
        return
    forward, backward = function.forward, function.backward

    @functools.wraps(forward)
    def forward_noting_the_logits_dtype(ctx, vocab_parallel_logits, *inputs):
        ctx.logits_dtype = vocab_parallel_logits.dtype
        ctx.other_inputs = len(inputs)
        return forward(ctx, vocab_parallel_logits, *inputs)

    @functools.wraps(backward)
    def backward_in_the_logits_dtype(ctx, grad_output, *output_grads):
        if ctx.logits_dtype == torch.bfloat16:
            return backward(ctx, grad_output, *output_grads)
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        gradient = _logits_gradient(softmax, grad_output, target_mask, masked_target_1d)
        return (gradient, *([None] * ctx.other_inputs))

    forward_noting_the_logits_dtype.__wrapped_by__ = NAME
    backward_in_the_logits_dtype.__wrapped_by__ = NAME
    function.forward = staticmethod(forward_noting_the_logits_dtype)
    function.backward = staticmethod(backward_in_the_logits_dtype)


register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 fusions/fused_cross_entropy.py (calculate_gradients casts "
             "to bfloat16; no issue filed)",
    versions=">=0.15,<0.20",
    summary="--cross-entropy-loss-fusion (native) returns the logits' gradient in their own "
            "dtype: fp32 and fp16 runs no longer get it rounded to bf16",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
