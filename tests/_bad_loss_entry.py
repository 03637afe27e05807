"""pretrain_moe.py whose token losses get $BAD_LOSS added (nan, inf, or a number: a spike) from
the second iteration on, or at iteration $BAD_LOSS_AT only (1-based) where that is set, or,
with $BAD_LOSS_IN=evaluation, to the losses of evaluation only (test_loss_checks_cpu only).
With $TRACKER_LINE_PER_RANK=1 every check of the loss writes its failures to
--result-rejected-tracker-filename, on every rank and in evaluation too, as megatron's own GPT
step has them (gpt_step._tracker_lines_kept left out). With $BATCH_PROBE=1 every rank prints
`batch read: iteration <n> rank <r> tokens <sum of the token ids>` for each micro-batch it reads.
With $BAD_LOSS_RANK set, only that global rank's losses get $BAD_LOSS (a bad sample in one
data-parallel replica's batch); every rank's otherwise. With $BAD_LOSS_TIMES=1 the token losses
are multiplied by $BAD_LOSS instead: with nan the gradients are NaN too, as a batch that
overflows the model gives them.

The project's forward step and loss function run unchanged; the loss function is handed the
model's token losses plus a constant, so the gradients stay those of the true loss and only a
check of the loss itself can notice. (Megatron skips its checks on the first iteration.)
"""

import contextlib
import os

import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

if not torch.cuda.is_available():  # as pretrain_moe.py does, before megatron is imported
    from moe_launcher import cpu_backend

    cpu_backend.activate()

from megatron.training import get_args  # noqa: E402

from moe_launcher import gpt_step  # noqa: E402

forward_step = gpt_step.forward_step
if os.environ.get("BATCH_PROBE") == "1":
    read_batch = gpt_step._next_batch

    def _next_batch_probed(data_iterator):
        batch = read_batch(data_iterator)
        # one write (not print's two): the other rank's line cannot land inside it
        sys.stdout.write(f"batch read: iteration {get_args().curr_iteration + 1} rank "
                         f"{torch.distributed.get_rank()} tokens {int(batch['tokens'].sum())}\n")
        sys.stdout.flush()
        return batch

    gpt_step._next_batch = _next_batch_probed
if os.environ.get("TRACKER_LINE_PER_RANK") == "1":
    gpt_step._tracker_lines_kept = lambda machine, training: contextlib.nullcontext()


BAD_LOSS = float(os.environ["BAD_LOSS"])
BAD_LOSS_AT = int(os.environ.get("BAD_LOSS_AT", "0"))
IN_EVALUATION = os.environ.get("BAD_LOSS_IN") == "evaluation"
BAD_LOSS_RANK = os.environ.get("BAD_LOSS_RANK")
BAD_LOSS_TIMES = os.environ.get("BAD_LOSS_TIMES") == "1"


def _bad(iteration: int, training: bool) -> bool:  # megatron's curr_iteration counts from 0
    if BAD_LOSS_RANK is not None and torch.distributed.get_rank() != int(BAD_LOSS_RANK):
        return False
    if IN_EVALUATION:
        return not training
    return training and (iteration + 1 == BAD_LOSS_AT if BAD_LOSS_AT else iteration >= 1)


def forward_step_with_bad_loss(data_iterator, model):
    output, loss_func = forward_step(data_iterator, model)
    if not _bad(get_args().curr_iteration, model.training):
        return output, loss_func
    if BAD_LOSS_TIMES:
        return output, lambda output_tensor: loss_func(output_tensor * BAD_LOSS)
    return output, lambda output_tensor: loss_func(output_tensor + BAD_LOSS)


gpt_step.forward_step = forward_step_with_bad_loss  # pretrain_moe.main imports it from here
sys.argv[0] = str(REPO / "pretrain_moe.py")
runpy.run_path(sys.argv[0], run_name="__main__")
