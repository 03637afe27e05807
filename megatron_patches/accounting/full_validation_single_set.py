"""--full-validation over one validation set reports its loss instead of a TypeError.

Upstream: none found; megatron-core 0.19.2 `megatron/training/training.py`
(`evaluate_and_print_results`). Targets megatron-core 0.19.x.

--full-validation evaluates the whole validation split: megatron sizes the run's evaluation by
the longest validation loader over the data-parallel ranks and keeps that count in
`args.eval_iters`, a list with --multiple-validation-sets and an int without. At every
evaluation `evaluate_and_print_results` broadcasts `args.eval_iters` from rank 0 as a tensor and
reads element 0 of the result back: an int gives a tensor of no dimension, whose `tolist()` is
an int again, and `eval_iters[0]` failed with `TypeError: 'int' object is not subscriptable` on
every rank at the first evaluation (after --eval-interval iterations of training), so a run with
--full-validation and one validation set could never report a validation loss.

The fix, at megatron's call site: for that one call the single count is the one-element list
megatron's multiple-set path broadcasts; megatron turns it back into the int itself (or this
wrapper does, where the call fails before that).
"""

from __future__ import annotations

import functools
import inspect

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "full-validation-single-set"


def _single_count_as_list(evaluate_and_print_results):
    @functools.wraps(evaluate_and_print_results)
    def evaluate_and_print_results_one_set(*args, **kwargs):
        from megatron.training import get_args

        run = get_args()
        count = run.eval_iters
        if not (run.full_validation and not run.multiple_validation_sets
                and isinstance(count, int)):
            return evaluate_and_print_results(*args, **kwargs)
        run.eval_iters = [count]
        try:
            return evaluate_and_print_results(*args, **kwargs)
        finally:
            if isinstance(run.eval_iters, list):
                run.eval_iters = run.eval_iters[0]

    evaluate_and_print_results_one_set.__wrapped_by__ = NAME
    return evaluate_and_print_results_one_set


def _apply() -> None:
    from megatron.training import training

    if wrapped_by(training.evaluate_and_print_results, NAME):
        return
    training.evaluate_and_print_results = _single_count_as_list(
        training.evaluate_and_print_results)


def _not_needed_because(context: PatchContext) -> str | None:
    """Reads megatron's evaluation: the broadcast count is subscripted whatever its shape."""
    from megatron.training import training

    source = inspect.getsource(inspect.unwrap(training.evaluate_and_print_results))
    if "eval_iters.tolist()" not in source or \
            "eval_iters[0] if not args.multiple_validation_sets" not in source:
        return "megatron's evaluation no longer reads element 0 of a single broadcast count"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 training.evaluate_and_print_results (--full-validation's "
             "single count broadcast as a tensor of no dimension, then subscripted)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="--full-validation with one validation set reports its loss instead of a "
            "TypeError on every rank at the first evaluation",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
