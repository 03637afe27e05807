"""The language-model loss over the model's real vocabulary, not megatron's padding rows.

megatron pads the vocabulary to a multiple of `--make-vocab-size-divisible-by` x TP (a
499-token tokenizer gets 512 rows at TP1, Qwen3's 151,936 rows 152,064 at TP8) and
`LanguageModule.compute_language_model_loss` takes the softmax over every padded row. Rows no
token id reaches still add to the softmax's denominator: after an import they are zero, their
logits 0, so the first loss of a model imported from Hugging Face is higher than transformers'
own for the same weights and batch (6.470 against 6.449 on a tiny Qwen3-MoE of 499 tokens), and
it grows with TP, which pads more; in any run the logged loss is not the one the model's real
vocabulary gives. Upstream: megatron-core 0.19.2 language_module.py (no issue filed); targets
0.15-0.19.

The fix: before megatron's cross-entropy, the logits of ids at or past the real vocabulary
(megatron's `--vocab-size`, or the tokenizer's size where that is larger, e.g. a
NullTokenizer's end-of-document id) are set to the dtype's lowest value, in place, on the
slice of this rank's vocabulary partition that holds them (no copy of the logits): their
softmax weight and gradient become 0. Megatron's fused and unfused cross-entropy, MTP losses
(which call the same method) and evaluation all see the masked logits.

Needed where megatron's compute_language_model_loss does not itself leave out padded rows.
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_patches import registry
from megatron_patches.registry import Patch, PatchContext, register

NAME = "loss-over-real-vocabulary"


def _language_module():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return LanguageModule


def _not_needed_because(context: PatchContext) -> str | None:
    source = inspect.getsource(_language_module().compute_language_model_loss)
    if "padded" in source or "vocab_size" in source:
        return "megatron's compute_language_model_loss already handles the padded vocabulary"
    return None


def real_vocabulary() -> int | None:
    """The ids the model can meet: megatron's --vocab-size or its tokenizer's size, whichever is
    larger; None outside a run that set megatron's arguments."""
    from megatron.training import global_vars

    args, tokenizer = global_vars._GLOBAL_ARGS, global_vars._GLOBAL_TOKENIZER
    if args is None:
        return None
    sizes = [getattr(args, "vocab_size", None) or 0,
             getattr(tokenizer, "vocab_size", 0) if tokenizer is not None else 0]
    return max(sizes) or None


def mask_padding(logits: torch.Tensor, real: int, padded: int, tp_rank: int) -> None:
    """Sets the logits of ids >= `real` to the dtype's lowest value, in place. `logits` hold
    this rank's partition of `padded` ids (all of them when gathered)."""
    local = logits.shape[-1]
    first = 0 if local == padded else tp_rank * local  # the partition's first id
    if first + local > real:
        keep = max(real - first, 0)
        # Autograd sees a copy into a slice: the masked logits get no gradient.
        logits[..., keep:] = torch.finfo(logits.dtype).min


def _wrap(compute_language_model_loss):
    @functools.wraps(compute_language_model_loss)
    def compute_language_model_loss_over_real_vocabulary(self, labels, logits):
        real = real_vocabulary()
        padded = getattr(self, "vocab_size", None)  # megatron's padded rows
        if real is not None and padded and real < padded:
            group = getattr(getattr(self, "output_layer", None), "tp_group", None)
            if group is not None and torch.distributed.is_initialized():
                tp_rank = torch.distributed.get_rank(group)
            else:
                from megatron.core import parallel_state

                tp_rank = parallel_state.get_tensor_model_parallel_rank()
            mask_padding(logits, real, padded, tp_rank)
        return compute_language_model_loss(self, labels, logits)

    compute_language_model_loss_over_real_vocabulary.__wrapped_by__ = NAME
    return compute_language_model_loss_over_real_vocabulary


def _apply() -> None:
    cls = _language_module()
    if not registry.wrapped_by(cls.compute_language_model_loss, NAME):
        cls.compute_language_model_loss = _wrap(cls.compute_language_model_loss)


register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 LanguageModule.compute_language_model_loss (softmax over "
             "the padded vocabulary)",
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="the logits of padded vocabulary rows (ids past --vocab-size / the tokenizer) are "
            "masked before megatron's cross-entropy: the loss is over the real vocabulary",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
