"""A skipped iteration consumes its batch on every rank, as the launcher's forward step reads.

Upstream: local (the launcher's data path); megatron-core 0.19.2
`megatron/training/training.py` (`dummy_train_step`). Targets megatron-core 0.19.x.

megatron skips an iteration (its `iterations_to_skip`, from --result-rejected-tracker-filename)
with `dummy_train_step`, which reads the iteration's micro-batches on tensor-parallel rank 0
only and broadcasts them to the other TP ranks: megatron's own GPT step reads data there alone.
The launcher's forward step (moe_launcher/gpt_step.py) has every rank read its own copy of each
batch, so after a skip the data iterators of TP ranks > 0 were one global batch behind TP rank
0's: from then on the TP ranks of a replica trained on different batches (with sequence
parallelism each took its part of another sequence), without a word. With a virtual pipeline
(one data iterator per model chunk) megatron's skipped step fails on every rank ("'list' object
is not an iterator").

The fix: the skipped step reads the iteration's micro-batches on every rank, from each model
chunk's iterator as the forward step does, through megatron's rerun state machine loop as
megatron's does, and nothing else (no broadcast: every rank holds its own copy; nothing is
checked, the batch is skipped).
"""

from __future__ import annotations

import functools
import inspect

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "skipped-iteration-reads-every-rank"


def _reading_on_every_rank(dummy_train_step):
    @functools.wraps(dummy_train_step)
    def dummy_train_step_every_rank(data_iterator):
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        chunks = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        machine = get_rerun_state_machine()
        while machine.should_run_forward_backward(data_iterator):
            for chunk_iterator in chunks:
                if chunk_iterator is not None:
                    for _ in range(get_num_microbatches()):
                        next(chunk_iterator)

    dummy_train_step_every_rank.__wrapped_by__ = NAME
    return dummy_train_step_every_rank


def _apply() -> None:
    from megatron.training import training

    if wrapped_by(training.dummy_train_step, NAME):
        return
    training.dummy_train_step = _reading_on_every_rank(training.dummy_train_step)


def _not_needed_because(context: PatchContext) -> str | None:
    """Reads megatron's skipped step: it is right for the launcher if it reads on every rank,
    i.e. does not read on TP rank 0 alone."""
    from megatron.training import training

    if "tp_rank == 0" not in inspect.getsource(training.dummy_train_step):
        return "megatron's skipped step reads the batch on every rank"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="local: the launcher reads data on every rank; megatron-core 0.19.2 "
             "training.dummy_train_step reads on TP rank 0 only",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="an iteration megatron skips consumes its micro-batches on every rank, so the TP "
            "ranks go on reading the same batches",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
