"""The forward step megatron's pretrain() calls for every micro-batch of a GPT model.

It does what megatron's own GPT step (Megatron-LM's pretrain_gpt.py) does, through megatron's
helpers: it finds the virtual pipeline stage of the model chunk it is given, gives each
context-parallel rank its slice of the sequence, and runs megatron's NaN / Inf / spiky-loss
checks on the loss through the rerun state machine.
"""

import contextlib
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank
from megatron.training import get_args

from moe_launcher.data import SOURCE_DATASET, SOURCE_SAMPLE
from moe_launcher.runtime.refusals import DataRefusal

# megatron's threshold: a loss over 10x the largest recently seen is "spiky".
SPIKY_LOSS_FACTOR = 10


def _refuse_ids_past_vocabulary(batch: dict, sources: tuple[list, object] = (None, None)
                                ) -> None:
    """Raises DataRefusal where the host batch holds a token id the model's embedding has no
    row for (data tokenized with a larger tokenizer than the model's): on the CPU tensors, before
    they move to the device, where the same id is an IndexError (a device-side assert on a GPU,
    which names nothing). One max over the batch's ids. `sources`: each row's dataset and sample
    index (moe_launcher.data.SamplesNamed), named in the refusal."""
    args = get_args()
    rows = args.padded_vocab_size
    for key in ("tokens", "labels"):
        ids = batch.get(key)
        if torch.is_tensor(ids) and ids.numel() and (largest := int(ids.max())) >= rows:
            flags = [f"--{name.replace('_', '-')}" for name in
                     ("data_path", "data_args_path", "per_split_data_args_path",
                      "train_data_path", "valid_data_path", "test_data_path")
                     if getattr(args, name, None)]
            datasets, samples = sources
            where = ""
            if datasets is not None and samples is not None:
                row = int((ids >= rows).reshape(len(datasets), -1).any(dim=1).nonzero()[0])
                where = f" (sample {int(samples[row])} of {datasets[row]})"
            raise DataRefusal(
                f"{' / '.join(flags) or 'the data'}: token id {largest}{where} in the "
                f"micro-batch read at iteration {getattr(args, 'curr_iteration', 0) + 1} "
                f"(consumed samples "
                f"{getattr(args, 'consumed_train_samples', 0)}) is past the model's vocabulary "
                f"({rows} embedding rows, from --vocab-size or the tokenizer); the data was "
                f"tokenized with another, larger tokenizer. Fix: train with the tokenizer the "
                f"data was made with (prepare_data's --tokenizer), or tokenize the data again "
                f"with this one")


def _next_batch(data_iterator):
    # Every rank reads its own copy of the batch (the dataset provider is distributed-aware),
    # so no TP/PP broadcast is needed; stages simply ignore the fields they do not use.
    batch = next(data_iterator)
    # Where each row comes from (real datasets only): host values, never moved to the device.
    sources = (batch.pop(SOURCE_DATASET, None), batch.pop(SOURCE_SAMPLE, None))
    _refuse_ids_past_vocabulary(batch, sources)
    batch = {key: value.cuda(non_blocking=True) if torch.is_tensor(value) else value
             for key, value in batch.items()}
    # The ranks of a context-parallel group read the same sequences; each keeps the two of its
    # 2 x CP chunks megatron's load-balanced split assigns it (a no-op at CP 1). The datasets
    # here never carry packed-sequence boundaries (cu_seqlens), so it is the per-sequence split.
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                     cp_group=parallel_state.get_context_parallel_group())


@contextlib.contextmanager
def _tracker_lines_kept(rerun_state_machine, training: bool):
    """Which checks of the loss write their failures to --result-rejected-tracker-filename,
    where megatron finds the training iterations to skip at the next start (an iteration one
    rank failed twice). Megatron's own GPT step has every rank write every failure; here:
    - TP rank 0's only. Every tensor-parallel rank computes the same loss (vocab-parallel
      cross-entropy); megatron reads an iteration that several ranks of one job failed as a
      fault of the job, not of its data, and never skips it ("Will not skip these iterations
      due to multiple rank errors"): at TP > 1 a batch that failed everywhere failed at every
      restart.
    - Training's only. A failed evaluation batch (megatron evaluates with reruns disabled, so
      it stops the run) was written under the last training iteration's number, so a job
      that failed twice at evaluation then skipped that training iteration's good batch.
    The other checks run as before (each rank reruns, stops, says so); they write no line."""
    if training and parallel_state.get_tensor_model_parallel_rank() == 0:
        yield
        return
    tracker = rerun_state_machine.result_rejected_tracker_filename
    rerun_state_machine.result_rejected_tracker_filename = None
    try:
        yield
    finally:
        rerun_state_machine.result_rejected_tracker_filename = tracker


def _validate_loss(loss: torch.Tensor, training: bool) -> None:
    """megatron's checks of this rank's loss, before the data-parallel reduction; the rerun
    state machine reruns the step, and stops the job for a NaN or Inf that reproduces.

    The machine keeps the tensor it rejected and compares the rerun's with it, so it gets a
    copy: megatron's schedule divides the returned loss in place by the token and micro-batch
    counts (megatron-core 0.19.2 schedules.forward_step_calc_loss), and a kept original made
    every spike look "not reproducible ... Possible transient error!" (a fault of the GPU), its
    value over the rerun's by exactly tokens x micro-batches."""
    loss = loss.detach().clone()
    args = get_args()
    rerun_state_machine = get_rerun_state_machine()
    with _tracker_lines_kept(rerun_state_machine, training):
        if args.check_for_nan_in_loss_and_grad:
            for rejection_func, name in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                rerun_state_machine.validate_result(
                    result=loss, rejection_func=rejection_func,
                    message=f"found {name} in local forward loss calculation",
                    tolerance=0.0,  # the forward pass is deterministic
                    fatal=True)
        if args.check_for_spiky_loss:
            rerun_state_machine.validate_result(
                result=loss,
                rejection_func=partial(rerun_state_machine.is_unexpectedly_large,
                                       threshold=SPIKY_LOSS_FACTOR, context="loss"),
                message="Spiky loss", tolerance=0.0, fatal=False)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, training: bool):
    """Sum of token losses, the token count, and the (sum, count) pair megatron averages.

    Under context parallelism both cover this rank's slice of the sequence: megatron's schedule
    and its data-parallel reduction (over DP x CP) combine the slices. `training`: the model
    is training, not evaluated."""
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    _validate_loss(loss_sum, training)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    args = get_args()
    batch = _next_batch(data_iterator)
    # The schedule passes the DDP/FSDP wrapper; the chunk's virtual stage is on the GPTModel.
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"] if (is_last or args.mtp_num_layers) else None,
        loss_mask=batch["loss_mask"],
    )
    return output, partial(loss_func, batch["loss_mask"], training=model.training)
