"""Preflight checks of --save and --load as folders: --save can be written (probed), --load
exists and is a checkpoint. megatron-core 0.19.2 trains from random weights, without an error,
for a --load that is missing, a file, or a folder that holds files but no checkpoint (a typo
naming a run's parent folder, or a data folder). An empty folder, and the run's own --save
before its first checkpoint, start fresh, as megatron does. A --save that holds another run's
committed checkpoint is refused to a run that does not continue it (save_continuity); a
torch_dist --load to a Megatron-FSDP run, which loads fsdp_dtensor only; a distributed --load
under --ckpt-format torch, and a torch-format --load at another TP or PP size (megatron fails on
both only once the model is built), and --no-initialization or --init-model-with-meta-device
(without Megatron-FSDP) where no checkpoint will be loaded: megatron leaves the weights
uninitialized memory. Registered with
`preflight_check` (imported by megatron_validation.checked_command_line).
"""

from __future__ import annotations

import os

from moe_launcher.checkpoint_files import save_continuity, torch_format
from moe_launcher.checkpoint_files.commit_protocol import TRACKER, loaded_iteration_dir
from moe_launcher.checkpoint_files.metadata import (
    UnreadableCheckpoint, read_checkpoint_metadata, saved_backend)
from moe_launcher.preflight import preflight_check, refuse_unwritable_folder
from moe_launcher.runtime.refusals import PreflightError



@preflight_check("save-writable", machine=True)
def check_save_writable(args) -> None:
    if args.save:
        refuse_unwritable_folder("--save", args.save)


@preflight_check("load-exists", machine=True)
def check_load_exists(args) -> None:
    # megatron warns about a missing --load and trains from random weights. The one missing
    # --load that is meant is the run's own --save before its first checkpoint (a job that
    # requeues itself passes --load == --save from the start).
    if not args.load or os.path.exists(args.load):
        return
    if args.save and os.path.abspath(args.save) == os.path.abspath(args.load):
        return
    raise PreflightError("--load", f"--load {args.load} does not exist (megatron would start from "
                                   "random weights); fix: pass an existing checkpoint folder, or "
                                   "drop --load to start fresh")


def _holds_checkpoint(folder: str) -> bool:
    """Whether a folder is megatron's checkpoint: its tracker, or an iteration folder."""
    return any(name == TRACKER or name.startswith("iter_") or name == "release"
               for name in os.listdir(folder))


@preflight_check("load-is-a-checkpoint", machine=True)
def check_load_is_a_checkpoint(args) -> None:
    if not args.load or not os.path.exists(args.load):
        return  # load-exists has judged a missing one
    if not os.path.isdir(args.load):
        raise PreflightError("--load", f"--load {args.load} is a file, not a checkpoint folder "
                                       "(megatron would start from random weights); fix: pass "
                                       "the folder --save wrote")
    own_save = args.save and os.path.abspath(args.save) == os.path.abspath(args.load)
    if own_save or not os.listdir(args.load) or _holds_checkpoint(args.load):
        return
    raise PreflightError("--load", f"--load {args.load} holds files but no checkpoint (no "
                                   f"{TRACKER}, no iter_* folder; megatron would start from "
                                   "random weights); fix: pass the folder --save wrote, not its "
                                   "parent or a data folder")


@preflight_check("save-holds-another-run", machine=True)
def check_save_continues(args) -> None:
    # A --save that holds a committed checkpoint is for the run that continues it (--load of the
    # same folder, no --finetune); megatron would let any other run write over it, silently.
    if line := save_continuity.refusal(save_continuity.save_use(args)):
        raise PreflightError("--save", line)


@preflight_check("megatron-fsdp-loads-fsdp-dtensor", machine=True)
def check_megatron_fsdp_load_format(args) -> None:
    # Megatron-FSDP loads fsdp_dtensor checkpoints only; megatron-core 0.19.2 reads a torch_dist
    # one (import-hf's, a DDP run's) into it as if it were one and dies on every rank with
    # KeyError: 'model'. megatron's metadata.json names a torch_dist checkpoint's backend.
    iteration = loaded_iteration_dir(args.load, args.ckpt_step)
    if not getattr(args, "use_megatron_fsdp", False) or iteration is None:
        return
    # (no megatron metadata.json: an fsdp_dtensor checkpoint, or one the load checks judge)
    if saved_backend(iteration) == "torch_dist":
        raise PreflightError("--load", f"--load {iteration} is a torch_dist checkpoint, but "
                                       "--use-megatron-fsdp loads fsdp_dtensor checkpoints only "
                                       "(megatron-core 0.19.2 fails on every rank with KeyError: "
                                       "'model'); fix: convert its weights with `python -m "
                                       "moe_launcher.convert to-fsdp-dtensor "
                                       f"{args.load} OUT_DIR` and --load OUT_DIR, or train "
                                       "without --use-megatron-fsdp (--use-distributed-optimizer, "
                                       "--ckpt-format torch_dist)")


# What decides which global layers each pipeline stage builds.
_PIPELINE_LAYOUT = ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                    "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                    "decoder_last_pipeline_num_layers")


@preflight_check("megatron-fsdp-loads-its-pipeline-layout", machine=True)
def check_megatron_fsdp_pipeline_layout(args) -> None:
    # megatron-core 0.19.2's fsdp_dtensor checkpoints name layers by each stage's local index
    # (Megatron-FSDP's state dict is the module's own; only sharded_state_dict adds the stage's
    # offset), so a Megatron-FSDP run whose stages hold other layers than the saving run's loads
    # the wrong layers, strictly and without a word (Megatron-LM #7452, finding 12). With one
    # stage on both sides the local and global indices agree.
    iteration = loaded_iteration_dir(args.load, args.ckpt_step)
    if not getattr(args, "use_megatron_fsdp", False) or iteration is None \
            or saved_backend(iteration) == "torch_dist":
        return  # (megatron-fsdp-loads-fsdp-dtensor judges a torch_dist one)
    try:
        saved = read_checkpoint_metadata(iteration, with_payload=False).args
    except UnreadableCheckpoint:
        return  # the load checks judge it
    run = {name: getattr(args, name, None) for name in _PIPELINE_LAYOUT}
    was = {name: getattr(saved, name, None) for name in _PIPELINE_LAYOUT}
    if run == was or (run["pipeline_model_parallel_size"] or 1) == \
            (was["pipeline_model_parallel_size"] or 1) == 1:
        return
    differ = ", ".join(f"{name} {was[name]} -> {run[name]}" for name in _PIPELINE_LAYOUT
                       if run[name] != was[name])
    raise PreflightError("--pipeline-model-parallel-size",
                         f"--load {iteration} is an fsdp_dtensor checkpoint saved with another "
                         f"pipeline layout ({differ}); megatron-core 0.19.2 names its layers by "
                         "each stage's local index, so this run's stages would load other "
                         "layers than theirs, without an error (Megatron-LM #7452, finding 12); "
                         "fix: resume with the saved pipeline layout, or go through torch_dist "
                         "(`python -m moe_launcher.convert to-torch-dist` and a run without "
                         "--use-megatron-fsdp)")


# Why each flag leaves the model's weights uninitialized memory (megatron-core 0.19.2), and what
# else than dropping it or loading a checkpoint fixes that.
_UNINITIALIZED_BY = {
    "--no-initialization": ("megatron's layers skip their init methods and keep the torch.empty "
                            "memory they allocated", ""),
    "--init-model-with-meta-device": ("without --use-megatron-fsdp megatron gives the "
                                      "meta-device weights torch.empty_like memory and "
                                      "initializes none of them (Transformer Engine's layers on "
                                      "a GPU, every layer with --use-cpu-initialization)",
                                      " (or add --use-megatron-fsdp, which initializes each "
                                      "module it materializes)"),
}


@preflight_check("uninitialized-weights-need-a-checkpoint", machine=True)
def check_uninitialized_weights_loaded(args) -> None:
    # Two flags build the model without initializing its weights, for a run that loads them:
    # --no-initialization ("when you know you are going to load values from a checkpoint"), and
    # --init-model-with-meta-device, which Megatron-FSDP materializes through each module's
    # reset_parameters (an initialization) but get_model, without it, through
    # to_empty_if_meta_device. Only a checkpoint the run loads (--load, or megatron's fallback
    # --pretrained-checkpoint) turns that memory into weights; a run without one trained from
    # it, without a word (on CPU a NaN gradient norm at the first step; on a GPU possibly finite
    # garbage). torch FSDP2 materializes in fully_shard: not judged here.
    if not args.perform_initialization:
        flag = "--no-initialization"
    elif (getattr(args, "init_model_with_meta_device", False) and not args.use_megatron_fsdp
          and not args.use_torch_fsdp2):
        flag = "--init-model-with-meta-device"
    else:
        return
    if any(loaded_iteration_dir(folder, args.ckpt_step)
           for folder in (args.load, args.pretrained_checkpoint)):
        return
    why, other_fix = _UNINITIALIZED_BY[flag]
    raise PreflightError(flag, f"{flag} with no checkpoint to load: {why}, so the run would train "
                               f"from whatever that memory held; fix: drop {flag}, or --load a "
                               f"checkpoint{other_fix}")


@preflight_check("load-format", machine=True)
def check_load_format(args) -> None:
    # megatron-core 0.19.2 reads --load in --ckpt-format's format unless
    # --auto-detect-ckpt-format: a distributed checkpoint under --ckpt-format torch fails on
    # every rank once the model is built ("RuntimeError: Detected load from a distributed
    # checkpoint, but neither --use-dist-ckpt nor --auto-detect-ckpt-format is set").
    iteration = loaded_iteration_dir(args.load, args.ckpt_step)
    if (iteration is None or args.ckpt_format != "torch" or args.auto_detect_ckpt_format
            or not os.path.isfile(os.path.join(iteration, ".metadata"))):
        return
    try:
        saved = read_checkpoint_metadata(iteration, with_args=False, with_payload=False).format
    except UnreadableCheckpoint:
        return  # the load checks judge it
    raise PreflightError("--ckpt-format",
                         f"--load {iteration} is a {saved} checkpoint, but --ckpt-format torch "
                         f"reads the torch format only (megatron fails on every rank once the "
                         f"model is built); fix: pass --ckpt-format {saved}, or "
                         f"--auto-detect-ckpt-format")


# The layout a torch-format checkpoint's files are cut by, which a load cannot change.
_TORCH_FORMAT_LAYOUT = (("--tensor-model-parallel-size", "tensor_model_parallel_size"),
                        ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"))


@preflight_check("load-torch-format-layout", machine=True)
def check_load_torch_format_layout(args) -> None:
    # --ckpt-format torch keeps a file per tensor- and pipeline-parallel rank; megatron-core
    # 0.19.2 asserts the saved sizes in check_checkpoint_args, on every rank once the model is
    # built and its file read ("tensor_model_parallel_size value from checkpoint (2) is not
    # equal to the input argument value (1)"). --finetune skips that check; other --ckpt-format
    # values are not judged here.
    iteration = loaded_iteration_dir(args.load, args.ckpt_step)
    if (iteration is None or args.finetune or args.ckpt_format != "torch"
            or not torch_format.is_torch_format(iteration)):
        return
    files = torch_format.model_files(iteration)
    saved = torch_format.readable_saved_args(files[0]) if files else None
    if saved is None:
        return
    changed = [(flag, getattr(saved, name), getattr(args, name))
               for flag, name in _TORCH_FORMAT_LAYOUT
               if getattr(saved, name, None) not in (None, getattr(args, name))]
    if changed:
        raise PreflightError(changed[0][0],
                             f"--load {iteration} is a torch-format checkpoint saved at "
                             + ", ".join(f"{flag} {was}" for flag, was, _ in changed)
                             + "; its files are cut by that layout, so this run's "
                             + ", ".join(f"{flag} {now}" for flag, _, now in changed)
                             + " cannot load it (megatron fails on every rank once the model is "
                             "built); fix: resume with "
                             + " ".join(f"{flag} {was}" for flag, was, _ in changed)
                             + " (torch_dist checkpoints load at any layout)")
