"""activation-memory-report: the training log's activation memory priced on the layers built.

At its first log lines rank 0 prints megatron's `Theoretical memory footprints: weight and
optimizer=.. MB, activation=.. MB, total=.. MB`. megatron-core 0.19.2 prices the activations
with the dense GPT formulas of Korthikanti et al. (Table 2, or a variant for runs without
sequence parallelism and selective recompute): every layer an MLP of --ffn-hidden-size over
every token beside attention of --hidden-size, nothing recomputed. A MoE layer's experts work on
top-k copies of each token at --moe-ffn-hidden-size, grouped-query and multi-latent attention
keep other widths, MTP layers and the pipeline schedule their own share, and recompute frees
most of it, none of which the formula sees: the line's activation and total were another model's
(the test's tiny MoE at PP2: 1.13 MB where its first stage keeps 1.84 MB; the recipes' figures
are in README.md).

This patch prices them with moe_launcher/activation_memory.py, the dry run's model (judged
against what megatron's own layers keep, tests/moe_launcher/test_activation_memory_cpu.py), on
the model megatron built (its config places the layers on the pipeline stages, through the
layer-census record), for the run's kernels (Transformer Engine's, or the local spec's), the
pipeline stage that holds the most; the lines before it say what was priced. The weight and
optimizer figure stays megatron's function (counted on the model built where parameter-census
is applied). HybridModel runs keep megatron's report: neither prices Mamba layers.
Targets megatron-core 0.19.x (0.15 ships no megatron.training).
"""

from __future__ import annotations

import functools
import types

from moe_launcher import activation_memory
from megatron_patches import registry
from megatron_patches.accounting import layer_census  # registered first: this patch requires it
from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "activation-memory-report"
MEGABYTE = 1024 * 1024  # megatron's NUM_BYTES_IN_MEGABYTE


def kernels_of(args) -> str:
    return "te" if args.transformer_impl == "transformer_engine" else "local"


def megabytes(nbytes: float) -> str:
    return f"{nbytes / MEGABYTE:.2f} MB"


def report_lines(args, config, microbatches: int) -> tuple[list[str], float]:
    """(the lines that say what was priced, the activation bytes of the pipeline stage holding
    the most)."""
    from moe_launcher.preflight import moe_pattern

    kernels = kernels_of(args)
    pattern = moe_pattern(args)
    ranks = activation_memory.rank_activations(args, config, pattern, args.padded_vocab_size,
                                               microbatches, kernels)
    busiest = max(ranks, key=lambda rank: rank.total)
    lines = [
        f"[megatron_patches] {activation_memory.estimate_said(args, pattern, kernels, megabytes)}",
        f"[megatron_patches] activations of the pipeline stage holding the most "
        f"({busiest.pp_rank}): {activation_memory.peak_said(args, busiest, megabytes)}"]
    lines += [f"[megatron_patches] activations: {note}"
              for note in activation_memory.not_modelled_said(args)]
    if args.use_megatron_fsdp:
        lines.append("[megatron_patches] memory: Megatron-FSDP's gathered weights and unsharded "
                     "gradients are not in this total (the dry run, examples/moe/plan.py, prices "
                     "them)")
    return lines, busiest.total


def _megatron_prices_no_experts() -> bool:
    """Whether megatron's activation formulas give a MoE layer's top-1 and top-8 routing the
    same figure, i.e. price no expert tokens."""
    from megatron.training import theoretical_memory_usage as usage

    def figures(topk: int) -> tuple[float, float]:
        args = types.SimpleNamespace(
            seq_length=128, micro_batch_size=1, hidden_size=256, ffn_hidden_size=1024,
            num_layers=2, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            virtual_pipeline_model_parallel_size=None, padded_vocab_size=1024,
            num_experts=8, moe_router_topk=topk, moe_ffn_hidden_size=512,
            moe_shared_expert_intermediate_size=None, sequence_parallel=False)
        return (usage.compute_activation_memory(args, num_microbatches=1),
                usage.compute_activation_memory_without_sp(args, num_microbatches=1))

    return figures(1) == figures(8)


def _not_needed_because(context: PatchContext) -> str | None:
    if not _megatron_prices_no_experts():
        return "megatron's activation formulas price the experts' tokens"
    return None


def _apply() -> None:
    from megatron.training import training
    from megatron.training.theoretical_memory_usage import is_hybrid_model

    megatron_report = training.report_theoretical_memory
    if wrapped_by(megatron_report, NAME):
        return

    @functools.wraps(megatron_report)
    def report_theoretical_memory(args, num_microbatches=None, verbose=False):
        built = registry.record_of(layer_census.PATCH.name).built
        if built is None or is_hybrid_model(args) or num_microbatches is None:
            return megatron_report(args, num_microbatches=num_microbatches, verbose=verbose)
        from megatron.training import theoretical_memory_usage

        weights = theoretical_memory_usage.compute_weight_and_optimizer_memory(
            args, verbose=verbose) / MEGABYTE
        lines, activations = report_lines(args, built.config, num_microbatches)
        activations /= MEGABYTE
        if verbose:
            print("\n".join(lines), flush=True)
        print(f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
              f"activation={activations:.2f} MB, total={weights + activations:.2f} MB\n",
              flush=True)
        return weights, activations, weights + activations

    report_theoretical_memory.__wrapped_by__ = NAME
    training.report_theoretical_memory = report_theoretical_memory


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 training/theoretical_memory_usage.py: Korthikanti et "
             "al.'s dense formulas, no experts, recompute, MLA or MTP)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="the log's `Theoretical memory footprints` prices activations on the layers built "
            "(experts' top-k tokens, MLA, MTP, recompute, the pipeline schedule's micro-batches "
            "in flight) with the dry run's model, for the pipeline stage holding the most "
            "(megatron.training.training.report_theoretical_memory)",
    not_needed_because=_not_needed_because,
    apply=_apply,
    requires=(layer_census.PATCH.name,),
))
