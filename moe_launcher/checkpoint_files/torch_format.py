"""Legacy `--ckpt-format torch` checkpoints (`iter_N/mp_rank_*/model_optim_rng.pt`): the layout
saved in them, and the expert pieces a save at that layout lost (NVIDIA/Megatron-LM#1719).

megatron-core names a torch-format file by the tensor, pipeline and expert-parallel ranks only.
Where expert tensor parallelism is not a divisor of tensor parallelism, ranks holding different
expert tensor-parallel pieces wrote one file: one piece survives, the others are gone, and a
resume (megatron reads the format whatever --ckpt-format says) trains on a wrong model without a
word. The save-time guard (torch-format-shard-guard) stops such saves from this launcher; this
module judges a checkpoint saved before it, or by plain megatron, from the arguments saved in it,
with the rank layout megatron's own RankGenerator builds from them.
"""

from __future__ import annotations

import dataclasses
import glob
import os

UPSTREAM = "NVIDIA/Megatron-LM#1719"
MODEL_FILE = "model_optim_rng.pt"


def is_torch_format(iteration_dir: str) -> bool:
    """megatron's own test (`_get_checkpoint_format`): an `mp_rank_0*` entry."""
    return any(name.startswith("mp_rank_0") for name in os.listdir(iteration_dir))


def model_files(iteration_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(iteration_dir, "mp_rank_*", MODEL_FILE)))


def saved_args(path: str):
    """The megatron arguments a torch-format file was saved with (None where it has none). The
    tensors are mapped, not read; a file that cannot be read raises (`readable_saved_args`)."""
    import torch

    return torch.load(path, map_location="cpu", mmap=True, weights_only=False).get("args")


def readable_saved_args(path: str):
    """saved_args, or None where the file cannot be read (a file cut short): for the checks that
    judge by the arguments before a load, which leave a damaged file to megatron's load, and
    whose rank 0 must not raise while the other ranks wait for its verdict."""
    try:
        return saved_args(path)
    except Exception:  # a damaged pickle or zip archive raises anything
        return None


def _positions(generator, token: str) -> dict[int, int]:
    return {rank: place for group in generator.get_ranks(token)
            for place, rank in enumerate(group)}


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """The parallel layout megatron's saved arguments record."""
    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    experts: int | None
    tp_pp_dp_mapping: bool

    @classmethod
    def from_args(cls, args) -> "SavedLayout":
        tp = args.tensor_model_parallel_size
        return cls(world=args.world_size, tp=tp, pp=args.pipeline_model_parallel_size,
                   cp=getattr(args, "context_parallel_size", 1) or 1,
                   ep=getattr(args, "expert_model_parallel_size", 1) or 1,
                   etp=getattr(args, "expert_tensor_parallel_size", None) or tp,
                   experts=getattr(args, "num_experts", None),
                   tp_pp_dp_mapping=bool(getattr(args, "use_tp_pp_dp_mapping", False)))

    def describe(self) -> str:
        return (f"{self.world} ranks, TP {self.tp}, PP {self.pp}, CP {self.cp}, EP {self.ep}, "
                f"expert TP {self.etp}, " + (f"{self.experts} experts" if self.experts
                                             else "no experts"))


def by_file(files_and_pieces: list[tuple[str, object]]) -> dict[str, dict[object, list[int]]]:
    """Rank r's (file it writes, piece it holds) -> per file, the ranks writing it by piece."""
    grouped: dict[str, dict[object, list[int]]] = {}
    for rank, (name, piece) in enumerate(files_and_pieces):
        grouped.setdefault(name, {}).setdefault(piece, []).append(rank)
    return grouped


def shared(files_and_pieces: list[tuple[str, object]]) -> list[tuple[str, list[int]]]:
    """(file, ranks) for every file that ranks holding different pieces would write."""
    return [(name, sorted(r for ranks in pieces.values() for r in ranks))
            for name, pieces in by_file(files_and_pieces).items() if len(pieces) > 1]


def writers(layout: SavedLayout) -> list[tuple[str, int]]:
    """Rank r's file in a torch-format save at `layout` (megatron's get_checkpoint_name: TP, PP
    and EP ranks) and the expert TP piece it holds, with the rank layout megatron's own
    RankGenerator builds."""
    from megatron.core.parallel_state import RankGenerator

    world, tp, pp, cp, ep = layout.world, layout.tp, layout.pp, layout.cp, layout.ep
    etp = layout.etp if layout.experts else tp
    order = "tp-cp-ep-pp-dp" if layout.tp_pp_dp_mapping else "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    tp_of, pp_of = _positions(dense, "tp"), _positions(dense, "pp")
    etp_of, ep_of = _positions(expert, "tp"), _positions(expert, "ep")
    return [(f"mp_rank_{tp_of[rank]:02d}" + (f"_{pp_of[rank]:03d}" if pp > 1 else "")
             + (f"_{ep_of[rank]:03d}" if ep > 1 else ""),
             etp_of[rank] if layout.experts else 0) for rank in range(world)]


def shared_files(args) -> list[tuple[str, list[int]]]:
    """(file, ranks) for every torch-format file that ranks holding different expert pieces
    wrote, at the layout `args` describes (megatron's saved arguments)."""
    return shared(writers(SavedLayout.from_args(args)))


def damage(layout: SavedLayout, name: str, ranks: list[int]) -> str:
    return (f"it was saved in --ckpt-format torch at TP {layout.tp}, expert TP {layout.etp} on "
            f"{layout.world} ranks: ranks {ranks} held different pieces of every expert but "
            f"wrote one file, {name}/{MODEL_FILE}, so all but one piece were lost ({UPSTREAM})")


def lost_pieces(iteration_dir: str) -> str | None:
    """Why a torch-format checkpoint lacks expert pieces, judged from its saved arguments; None
    when its layout kept every piece, or when it saved no (readable) arguments to judge by."""
    files = model_files(iteration_dir)
    args = readable_saved_args(files[0]) if files else None
    if args is None:
        return None
    shared = shared_files(args)
    return damage(SavedLayout.from_args(args), *shared[0]) if shared else None
