"""torch-format-shard-guard (NVIDIA/Megatron-LM#1719): `--ckpt-format torch` names each rank's
file by its tensor, pipeline and expert-parallel ranks only (megatron.training.checkpointing.
get_checkpoint_name). Ranks that hold different pieces of the model but no different one of
those ranks -- the expert tensor-parallel pieces where ETP is not TP -- write one file: the last
writer's pieces survive, the others are lost without a word, and a rank that loads a file
written from another piece trains on it. Measured on megatron-core 0.19.2, 2 ranks, ETP 2: one
file for both halves of every expert; the resumed losses are 1e-3, then 7e-3 off.

The guard judges the model megatron built when setup_model_and_optimizer hands it to
get_megatron_optimizer (before anything is loaded, trained or written), on every rank: the file
megatron's own get_checkpoint_name gives this rank, and which piece it holds of every
tensor-parallel parameter (its place in the group that partitions it,
moe_launcher/model/param_shapes.py), with its pipeline stage and, where it holds experts, its
expert-parallel rank. Ranks that would share a file while holding different pieces are refused,
rank 0 naming the file, the ranks and the fix (`--ckpt-format torch_dist`, which names every
piece). Layouts whose file-sharing ranks hold the same pieces (TP1 x EP2, TP2 x ETP1 x EP2,
ETP = TP) run as before; so does every other format.

At the same point it judges the checkpoint --load would read, when that is in the torch format
(megatron reads it whatever --ckpt-format says): a save at the layout its arguments record that
lost expert pieces (plain megatron's, or this launcher's before the guard) is refused
(moe_launcher/checkpoint_files/torch_format.py, rank 0 reading one file's arguments).

Targets megatron-core 0.15.x - 0.19.x; needed while get_checkpoint_name has no parameter for
the expert tensor-parallel rank.
"""

from __future__ import annotations

import functools
import inspect
import os

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by
from moe_launcher.checkpoint_files import torch_format
from moe_launcher.checkpoint_files.commit_protocol import loaded_iteration_dir
from moe_launcher.checkpoint_files.torch_format import UPSTREAM
from moe_launcher.model import layer_layout
from moe_launcher.model.param_shapes import ModelParams
from moe_launcher.runtime import collectives
from moe_launcher.runtime.refusals import PreflightError


def held_pieces(model_chunks) -> tuple:
    """What this rank holds, as far as it differs between ranks: its pipeline stage, its
    expert-parallel rank where it holds experts, and its piece of every partitioned parameter
    (in the chunks' order)."""
    from megatron.core import parallel_state as ps

    truths = [truth for _, truth in
              ModelParams(layer_layout.unwrap(chunk) for chunk in model_chunks).by_id.values()]
    pieces = tuple((t.name, t.partition_rank) for t in truths if t.partition is not None)
    expert_rank = ps.get_expert_model_parallel_rank() if any(t.expert for t in truths) else 0
    return ps.get_pipeline_model_parallel_rank(), expert_rank, pieces


def _torch_format(args) -> bool:
    return "torch" in (args.ckpt_format, getattr(args, "ckpt_convert_format", None))


def check_saved(args) -> None:
    """Refuses (PreflightError, on every rank) a --load of a torch-format checkpoint that a save
    at its layout left without pieces of every expert, judged by rank 0 from the arguments saved
    in it; megatron would read it whatever --ckpt-format says. A collective."""
    why = None
    if collectives.rank() == 0 and (directory := loaded_iteration_dir(
            args.load, getattr(args, "ckpt_step", None))) is not None:
        if torch_format.is_torch_format(directory):
            why = torch_format.lost_pieces(directory)
            why = why and f"--load {directory}: {why}"
    why = collectives.gather_objects(why)[0]
    if why:
        raise PreflightError(
            "--load", f"refusing {why}; fix: resume from a checkpoint saved in --ckpt-format "
                      f"torch_dist (or from an iteration saved at a layout whose expert TP "
                      f"divides its TP, with --ckpt-step), or start over with --ckpt-format "
                      f"torch_dist")


def check_model(model_chunks, args) -> None:
    """Refuses (PreflightError, on every rank) a torch-format run whose ranks would share a
    file while holding different pieces. A collective: every rank calls it."""
    from megatron.training.checkpointing import get_checkpoint_name

    directory = args.save or args.load or getattr(args, "ckpt_convert_save", None)
    if not directory or not _torch_format(args):
        return
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    mine = (get_checkpoint_name(directory, 0), held_pieces(chunks))
    shared = torch_format.shared(collectives.gather_objects(mine))
    if shared:
        from megatron.core import parallel_state as ps

        name, ranks = shared[0]
        raise PreflightError(
            "--ckpt-format",
            f"--ckpt-format torch: ranks {ranks} hold different pieces of the model (TP "
            f"{ps.get_tensor_model_parallel_world_size()}, expert TP "
            f"{ps.get_expert_tensor_parallel_world_size()}) but would all write and read one file, "
            f"iter_*/{os.path.relpath(name, os.path.dirname(os.path.dirname(name)))}: all but "
            f"one piece would be lost without a word ({UPSTREAM}); fix: --ckpt-format "
            "torch_dist (or an expert tensor-parallel size that divides the tensor-parallel size)")


def _wrap_optimizer_builder(get_megatron_optimizer):
    signature = inspect.signature(get_megatron_optimizer)

    @functools.wraps(get_megatron_optimizer)
    def get_megatron_optimizer_checked(*args, **kwargs):
        # setup_model_and_optimizer's first call with the model it built (get_model's or a
        # config container builder's), before the optimizer, the load and any save.
        from megatron.training import get_args

        check_saved(get_args())
        check_model(signature.bind(*args, **kwargs).arguments["model_chunks"], get_args())
        return get_megatron_optimizer(*args, **kwargs)

    get_megatron_optimizer_checked.__wrapped_by__ = PATCH.name
    return get_megatron_optimizer_checked


def _apply() -> None:
    from megatron.training import training

    if not wrapped_by(training.get_megatron_optimizer, PATCH.name):
        training.get_megatron_optimizer = _wrap_optimizer_builder(
            training.get_megatron_optimizer)


def _not_needed_because(context: PatchContext) -> str | None:
    from megatron.training.checkpointing import get_checkpoint_name

    named_by = inspect.signature(get_checkpoint_name).parameters
    if any("expert_tensor" in name for name in named_by):
        return "megatron's get_checkpoint_name names the expert tensor-parallel rank"
    return None


PATCH = register(Patch(
    name="torch-format-shard-guard",
    upstream=UPSTREAM,
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="refuses --ckpt-format torch where ranks holding different pieces would share a "
            "file, judged on the model built (megatron.training.training."
            "get_megatron_optimizer), and a --load of a torch-format checkpoint saved so",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
