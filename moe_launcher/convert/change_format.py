"""to-torch-dist and to-fsdp-dtensor: a checkpoint's model weights in the other format, as a
`release` checkpoint (megatron's convention for converted weights, as import-hf writes it).

Megatron-FSDP saves and loads fsdp_dtensor only (megatron-core 0.19.2), torch FSDP2 torch_dcp
(to-torch-dist reads both); every other layout (DDP, the distributed optimizer, PP/VPP)
torch_dist only. The weights cross; the optimizer state,
scheduler, RNG state and consumed-sample counts do not: megatron loads a release at iteration 0
and builds fresh optimizer state from the weights, as for a fine-tune. Both say so when they
finish.
"""

from __future__ import annotations

import torch

from . import fsdp_dtensor, megatron_side
from .errors import ConvertError
from .staging import check_target, staged_folder

_WEIGHTS_ONLY = ("model weights only: a run that loads it starts at iteration 0, from the "
                 "data's first sample, with fresh optimizer state (Adam moments, learning-rate "
                 "schedule), as from an import")


def _source(ckpt_dir: str, iteration: int | None, wanted: tuple[str, ...]):
    """The checkpoint's iteration folder and saved args, once it is checked to be of a `wanted`
    format."""
    path = megatron_side.iteration_dir(ckpt_dir, iteration)
    found = megatron_side.checkpoint_format(path)
    if found not in wanted:
        raise ConvertError(f"{path} is a {found} checkpoint, not {' or '.join(wanted)}")
    megatron_side.start()
    return path, megatron_side.saved_args(path)


def _model_and_reader(path: str, args):
    """The one-rank model of the checkpoint's args on the meta device (names and shapes: each
    weight is read as it is written) and the checkpoint's reader, checked to hold every weight."""
    with torch.device("meta"):
        model = megatron_side.build(megatron_side.world_one_config(args))
    reader = megatron_side.open_reader(model, path)
    megatron_side.check_covers(reader, model, path)
    return model, reader


def to_torch_dist(ckpt_dir: str, out_dir: str, iteration: int | None) -> None:
    check_target(out_dir)
    path, args = _source(ckpt_dir, iteration, ("fsdp_dtensor", "torch_dcp"))
    model, reader = _model_and_reader(path, args)
    with staged_folder(out_dir) as staging:
        megatron_side.save_release(model, reader.read, megatron_side.world_one_args(args),
                                   staging)
    print(f"convert: to-torch-dist: {_WEIGHTS_ONLY}", flush=True)


def to_fsdp_dtensor(ckpt_dir: str, out_dir: str, iteration: int | None, spec: str) -> None:
    check_target(out_dir)
    path, args = _source(ckpt_dir, iteration, ("torch_dist",))
    model, reader = _model_and_reader(path, args)
    with staged_folder(out_dir) as staging:
        fsdp_dtensor.save_release(model, reader.read,
                                  megatron_side.world_one_args(args, "fsdp_dtensor"), staging, spec)
    print(f"convert: to-fsdp-dtensor: module names of the {spec} spec (a run with "
          f"--transformer-impl {spec} loads it); {_WEIGHTS_ONLY}", flush=True)
