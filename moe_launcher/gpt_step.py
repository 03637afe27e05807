"""The forward step megatron's pretrain() calls for every micro-batch of a GPT model."""

from functools import partial

import torch

from megatron.core import parallel_state
from megatron.training import get_args


def _next_batch(data_iterator):
    # Every rank reads its own copy of the batch (the dataset provider is distributed-aware),
    # so no TP/PP broadcast is needed; stages simply ignore the fields they do not use.
    batch = next(data_iterator)
    return {key: value.cuda(non_blocking=True) if torch.is_tensor(value) else value
            for key, value in batch.items()}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses, the token count, and the (sum, count) pair megatron averages."""
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    args = get_args()
    batch = _next_batch(data_iterator)
    vp_stage = getattr(model, "vp_stage", None)
    is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"] if (is_last or args.mtp_num_layers) else None,
        loss_mask=batch["loss_mask"],
    )
    return output, partial(loss_func, batch["loss_mask"])
