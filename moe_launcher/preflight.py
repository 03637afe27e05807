"""Preflight: refuse a command line that cannot run, before megatron validates or builds anything.

pretrain_moe.py runs `check_environment()` first (before megatron is imported), then
`check_args(args)` on the flags as megatron's parser reads them (`parse_args`, before
`validate_args`, process groups and the model). Every refusal is a `PreflightError`: one line
that names the flag and the fix; the launcher prints it once (rank 0) and exits with status 2,
so nothing is initialised and nothing is written to --save.

The layout arithmetic here is shared with the dry-run planner (examples/moe/plan.py), so the
launcher and the planner refuse the same layouts with the same words.

Checks are registered with `@preflight_check(name)` and run in registration order; the first
refusal stops the run. A check that judges the machine it runs on (files, folders, installed
packages) or the launcher's process (its patches) is registered with `machine=True`; the dry
run, which may run elsewhere and applies no patch, runs every other check (`check_flags`), so it
refuses what the launcher would refuse for the flags alone.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Callable

from moe_launcher.command_line import flag_value
from moe_launcher.runtime.refusals import PreflightError

@dataclasses.dataclass(frozen=True)
class PreflightCheck:
    name: str
    run: Callable  # (args) -> None, raises PreflightError
    # judges more than the flags: this machine's files, folders or packages, or the launcher's
    # own process (the patches it applied)
    machine: bool


_CHECKS: dict[str, PreflightCheck] = {}


def preflight_check(name: str, machine: bool = False):
    def register(fn):
        if name in _CHECKS and _CHECKS[name].run is not fn:
            raise ValueError(f"two preflight checks are named {name!r}")
        _CHECKS[name] = PreflightCheck(name, fn, machine)
        return fn
    return register


# --------------------------------------------------------------------------------------------
# Environment (runs before megatron is imported)
# --------------------------------------------------------------------------------------------
def check_environment(megatron_version: str | None = None) -> str:
    """The megatron-core track ('default'/'legacy'); PreflightError for an unsupported install."""
    from moe_launcher.runtime.versions import (
        UnsupportedMegatronVersion, check_megatron_version, check_training_package)

    try:
        track = check_megatron_version(megatron_version)
        check_training_package()
        return track
    except UnsupportedMegatronVersion as exc:
        raise PreflightError("megatron-core", str(exc)) from None


# What a command line asks of a GPU by name: (flag, value, what a CPU run passes instead). On CPU
# the launcher adds --transformer-impl local and gloo only where the flag is not given, so a
# given value is the user's (a GPU recipe's) own.
_GPU_REQUESTS = (
    ("--transformer-impl", "transformer_engine", "pass --transformer-impl local"),
    ("--distributed-backend", "nccl", "drop --distributed-backend nccl (it uses gloo)"),
    ("--pipeline-model-parallel-comm-backend", "nccl",
     "drop --pipeline-model-parallel-comm-backend nccl"),
)


def check_gpu_request(argv: list[str], cuda_available: bool, environ=os.environ) -> None:
    """Refuses a command line that asks for GPUs by name where no CUDA device is visible (a GPU
    recipe submitted without --gpus-per-node, a driver gone): the launcher would switch to its
    CPU backend and fail much later, inside Transformer Engine or NCCL. Runs before the CPU
    backend is activated; command lines that name no GPU feature run on CPU as before."""
    if cuda_available:
        return
    for flag, value, cpu_fix in _GPU_REQUESTS:
        if flag_value(argv, flag) != value:
            continue
        import socket

        nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
        where = f"host {socket.gethostname()}" + (
            f", job {environ['SLURM_JOB_ID']} on {nodes} node(s)" if environ.get("SLURM_JOB_ID")
            else "")
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        raise PreflightError(flag, f"{flag} {value} asks for GPUs, but this rank sees no CUDA "
                             f"device ({where}; torch.cuda.is_available() is False"
                             f"{f', CUDA_VISIBLE_DEVICES={visible!r}' if visible is not None else ''}"
                             "), and the CPU backend the launcher would switch to cannot run it; "
                             "fix: give every rank a GPU (sbatch/srun --gpus-per-node=N on a GPU "
                             f"partition, N the ranks per node), or for a CPU run {cpu_fix}")


# --------------------------------------------------------------------------------------------
# Layout arithmetic (shared with examples/moe/plan.py)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Layout:
    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    vpp: int | None
    stages: list[int]
    moe_pattern: list[int]  # 1 = MoE layer, 0 = dense, one entry per layer

    def line(self) -> str:
        return (f"[layout] world={self.world} TP={self.tp} PP={self.pp} CP={self.cp} "
                f"DP={self.dp} | EP={self.ep} ETP={self.etp} expert-DP={self.edp} | "
                f"VPP={self.vpp or 1} | layers per stage: {','.join(map(str, self.stages))}")


def _virtual_pipeline(args) -> int | None:
    if args.num_virtual_stages_per_pipeline_rank is not None:
        return args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage is not None and args.pipeline_model_parallel_size:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        return max(1, per_stage // args.num_layers_per_virtual_pipeline_stage)
    return None


def moe_pattern(args) -> list[int]:
    if not args.num_experts:
        return [0] * args.num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    pattern = list(freq)
    if len(pattern) != args.num_layers:
        raise PreflightError("--moe-layer-freq",
                             f"--moe-layer-freq describes {len(pattern)} layers but --num-layers "
                             f"is {args.num_layers}; make the pattern list {args.num_layers} long")
    return pattern


def _sizes(args) -> tuple[int, int, int, int, int, int]:
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp  # megatron's default: ETP = TP
    return args.world_size, tp, pp, cp, ep, etp


@preflight_check("model-parallel-fits-world")
def check_model_parallel(args) -> None:
    w, tp, pp, cp, _, _ = _sizes(args)
    model = tp * pp * cp
    if w % model:
        flag = ("--tensor-model-parallel-size" if tp > 1 else "--pipeline-model-parallel-size"
                if pp > 1 else "--context-parallel-size")
        raise PreflightError(flag,
            f"world size {w} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {model}; "
            f"fix: run on a multiple of {model} GPUs (NODES x GPUS_PER_NODE) or change "
            f"--pipeline-model-parallel-size/--tensor-model-parallel-size")


@preflight_check("expert-grid-fits-stage")
def check_expert_grid(args) -> None:
    # Expert grid: EP x ETP x expert-DP spans the same ranks as TP x CP x DP within a stage.
    w, _, pp, _, ep, etp = _sizes(args)
    per_stage = w // pp
    if per_stage % (ep * etp):
        raise PreflightError("--expert-model-parallel-size",
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} "
            f"does not divide the {per_stage} ranks of a pipeline stage (world {w} / "
            f"--pipeline-model-parallel-size {pp}); fix: choose --expert-model-parallel-size and "
            f"--expert-tensor-parallel-size whose product divides {per_stage}, or run on more GPUs")


@preflight_check("experts-split")
def check_experts(args) -> None:
    _, _, _, _, ep, etp = _sizes(args)
    if args.num_experts:
        if args.num_experts % ep:
            raise PreflightError("--expert-model-parallel-size",
                f"--num-experts {args.num_experts} is not divisible by "
                f"--expert-model-parallel-size {ep}; fix: use an EP that divides "
                f"{args.num_experts}")
        ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
        if ffn and ffn % etp:
            raise PreflightError("--expert-tensor-parallel-size",
                f"--moe-ffn-hidden-size {ffn} is not divisible by "
                f"--expert-tensor-parallel-size {etp}; fix: use an ETP that divides {ffn}")
        if etp > 1 and args.transformer_impl == "inference_optimized":
            raise PreflightError("--expert-tensor-parallel-size",
                "--transformer-impl inference_optimized has no expert tensor parallelism "
                f"(--expert-tensor-parallel-size {etp}); fix: pass "
                "--expert-tensor-parallel-size 1")
    elif ep > 1:
        raise PreflightError("--expert-model-parallel-size",
                             f"--expert-model-parallel-size {ep} > 1 needs --num-experts; fix: "
                             "pass --num-experts (a multiple of the EP size) or "
                             "--expert-model-parallel-size 1")
    elif args.expert_tensor_parallel_size and args.expert_tensor_parallel_size > 1:
        raise PreflightError("--expert-tensor-parallel-size",
                             "--expert-tensor-parallel-size > 1 without --num-experts; fix: drop "
                             "it or pass --num-experts")


@preflight_check("tensor-and-context-split")
def check_tp_cp(args) -> None:
    _, tp, _, cp, _, _ = _sizes(args)
    heads = args.num_attention_heads
    if heads and heads % tp:
        raise PreflightError("--tensor-model-parallel-size",
                             f"--num-attention-heads {heads} is not divisible by "
                             f"--tensor-model-parallel-size {tp}; fix: use a TP that divides "
                             f"{heads}")
    if args.group_query_attention and not args.multi_latent_attention:
        groups = args.num_query_groups
        if groups % tp:
            raise PreflightError("--tensor-model-parallel-size",
                                 f"--num-query-groups {groups} is not divisible by "
                                 f"--tensor-model-parallel-size {tp}; fix: use a TP that "
                                 f"divides {groups}")
    if args.ffn_hidden_size and args.ffn_hidden_size % tp:
        raise PreflightError("--tensor-model-parallel-size",
                             f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
                             f"--tensor-model-parallel-size {tp}; fix: use a TP that divides it")
    if cp > 1 and args.seq_length and args.seq_length % (2 * cp):
        raise PreflightError("--context-parallel-size",
                             f"--seq-length {args.seq_length} must be divisible by 2 x "
                             f"--context-parallel-size {cp}; fix: change either")


@preflight_check("positive-sizes")
def check_positive_sizes(args) -> None:
    # megatron divides by --micro-batch-size (ZeroDivisionError) and asserts on --train-iters 0;
    # --log-interval 0 and --eval-interval 0 divide by zero at the first iteration's log and
    # evaluation test; --seq-length, --kv-channels and --moe-ffn-hidden-size 0 fail at the
    # model's build or first forward; --seed 0 raises as megatron seeds its generators
    # (initialize._set_random_seed takes positive seeds only).
    for flag, value in (("--micro-batch-size", args.micro_batch_size),
                        ("--train-iters", args.train_iters),
                        ("--log-interval", args.log_interval),
                        ("--eval-interval", args.eval_interval),
                        ("--seq-length", args.seq_length),
                        ("--kv-channels", args.kv_channels),
                        ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size),
                        ("--seed", args.seed)):
        if value is not None and value < 1:
            raise PreflightError(flag, f"{flag} {value}: it must be at least 1; fix: pass "
                                       f"{flag} 1 or more")


@preflight_check("value-ranges")
def check_value_ranges(args) -> None:
    """Values torch refuses where megatron hands them on: at the model's build or first
    forward (dropout, the initialisation's standard deviation), the optimizer's construction
    (Adam's betas), the first batch (data loader workers); and --mtp-num-layers below 0, which
    megatron builds as none (the layer census then stops the run after the build)."""
    def probability(value):
        return 0 <= value <= 1

    def beta(value):
        return 0 <= value < 1

    def not_negative(value):
        return value >= 0

    ranges = [("--hidden-dropout", args.hidden_dropout, probability, "between 0 and 1"),
              ("--attention-dropout", args.attention_dropout, probability, "between 0 and 1"),
              ("--init-method-std", args.init_method_std, not_negative, "0 or more"),
              ("--num-workers", args.num_workers, not_negative, "0 or more"),
              ("--mtp-num-layers", args.mtp_num_layers, not_negative, "0 or more")]
    if args.optimizer != "sgd":
        ranges += [("--adam-beta1", args.adam_beta1, beta, "at least 0 and below 1"),
                   ("--adam-beta2", args.adam_beta2, beta, "at least 0 and below 1")]
    for flag, value, allowed, said in ranges:
        if value is not None and not allowed(value):
            raise PreflightError(flag, f"{flag} {value}: it must be {said}; fix: pass {flag} "
                                       "in that range")


@preflight_check("attention-head-groups")
def check_attention_head_groups(args) -> None:
    # megatron-core 0.19.2's TransformerConfig takes query groups that do not divide the heads;
    # its attention then fails reshaping q/k/v at the first forward, on every rank.
    if not args.group_query_attention or args.multi_latent_attention:
        return
    heads, groups = args.num_attention_heads, args.num_query_groups
    if heads and groups and heads % groups:
        raise PreflightError("--num-query-groups",
                             f"--num-query-groups {groups} does not divide --num-attention-heads "
                             f"{heads}: every query group serves the same number of heads; fix: "
                             f"pass a --num-query-groups that divides {heads}")


@preflight_check("batch-split")
def check_batch(args) -> None:
    w, tp, pp, cp, _, _ = _sizes(args)
    dp = w // (tp * pp * cp)
    if args.global_batch_size is not None and args.global_batch_size % (
            args.micro_batch_size * dp):
        raise PreflightError("--global-batch-size",
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}; fix: make "
            f"--global-batch-size a multiple of {args.micro_batch_size * dp}")
    if args.train_iters is not None and args.eval_interval is None:
        raise PreflightError("--eval-interval",
                             "--eval-interval is unset: megatron 0.19.2 divides --train-iters by "
                             "it when it builds the datasets (also with --eval-iters 0); fix: "
                             "pass --eval-interval N")


@preflight_check("training-length")
def check_training_length(args) -> None:
    if args.train_iters is None and args.train_samples is None:
        raise PreflightError("--train-iters", "neither --train-iters nor --train-samples is set: "
                                              "megatron needs to know how long to train; fix: "
                                              "pass --train-iters N (or --train-samples N)")


@preflight_check("validation-sets")
def check_validation_sets(args) -> None:
    # megatron-core 0.19.2 checks these only once it has started: --multiple-validation-sets
    # without full validation raises NotImplementedError as the data loaders are built, and
    # --validation-set-names without it fails its assertion at the first evaluation, after
    # --eval-interval iterations of training.
    if args.multiple_validation_sets and not (args.full_validation or args.skip_train):
        raise PreflightError("--multiple-validation-sets",
                             "--multiple-validation-sets without --full-validation: "
                             "megatron-core 0.19.2 cannot yet count the samples each set has "
                             "consumed and fails as it builds the data loaders; fix: add "
                             "--full-validation, or drop --multiple-validation-sets")
    if args.validation_set_names and not args.multiple_validation_sets:
        raise PreflightError("--validation-set-names",
                             "--validation-set-names names the sets of "
                             "--multiple-validation-sets, which is not set (megatron-core "
                             "0.19.2 fails at the first evaluation); fix: add "
                             "--multiple-validation-sets --full-validation, or drop "
                             "--validation-set-names")


@preflight_check("external-data-loader")
def check_external_data_loader(args) -> None:
    # --dataloader-type external hands the data provider's return to the training loop as the
    # iterators themselves; this launcher's provider returns megatron's datasets, which are no
    # iterators (TypeError at the first step, on every rank).
    if args.dataloader_type == "external":
        raise PreflightError("--dataloader-type",
                             "--dataloader-type external passes the data provider's datasets "
                             "to the training loop as iterators, and this launcher's provider "
                             "builds megatron's datasets (a TypeError at the first step); fix: "
                             "drop --dataloader-type (single) or pass cyclic")


@preflight_check("sharp-group")
def check_sharp_group(args) -> None:
    # megatron-core 0.19.2 judges these only in initialize_model_parallel, after the process
    # group is up: --sharp-enabled-group needs --use-sharp, dp_replica needs more than one
    # distributed-optimizer instance; and --use-sharp on the dp group (its default) barriers on
    # the data-parallel group with context parallelism before that function has made it
    # ("... is not initialized", an AssertionError on every rank, on any backend).
    group = args.sharp_enabled_group
    if group is not None and not args.use_sharp:
        raise PreflightError("--sharp-enabled-group",
                             f"--sharp-enabled-group {group} without --use-sharp (megatron "
                             "fails on every rank as it makes its process groups); fix: add "
                             "--use-sharp, or drop --sharp-enabled-group")
    if group == "dp_replica" and args.num_distributed_optimizer_instances <= 1:
        raise PreflightError("--sharp-enabled-group",
                             "--sharp-enabled-group dp_replica needs "
                             "--num-distributed-optimizer-instances above 1 (megatron fails on "
                             "every rank as it makes its process groups); fix: raise "
                             "--num-distributed-optimizer-instances, or pass dp")
    if args.use_sharp and group in (None, "dp"):
        raise PreflightError("--use-sharp",
                             "--use-sharp on the data-parallel group (--sharp-enabled-group dp, "
                             "the default): megatron-core 0.19.2 waits on that group before it "
                             "has made it and fails on every rank as it makes its process "
                             "groups; fix: drop --use-sharp, or pass --sharp-enabled-group "
                             "dp_replica with --num-distributed-optimizer-instances above 1")


@preflight_check("learning-rate-schedule")
def check_learning_rate_schedule(args) -> None:
    """megatron-core 0.19.2 builds its learning-rate and weight-decay schedule
    (training.get_optimizer_param_scheduler, OptimizerParamScheduler) after the model, and a
    schedule it cannot run fails there on every rank: bare AssertionErrors (a short smoke run
    with train.sh's TRAIN_ITERS below a GPU recipe's --lr-warmup-iters 2000), a TypeError for
    an unset --lr. The same rules, refused before any work."""
    if args.train_iters is None and args.train_samples is None:
        return  # training-length refuses it
    if args.lr is None:
        raise PreflightError("--lr", "--lr is unset: megatron's optimizer and learning-rate "
                                     "schedule need a peak learning rate; fix: pass --lr "
                                     "(e.g. --lr 3e-4)")
    by_iterations = bool(args.train_iters)
    unit = "iterations" if by_iterations else "samples"
    length_flag, decay_flag, warmup_flag, wsd_flag = (
        ("--train-iters", "--lr-decay-iters", "--lr-warmup-iters", "--lr-wsd-decay-iters")
        if by_iterations else
        ("--train-samples", "--lr-decay-samples", "--lr-warmup-samples", "--lr-wsd-decay-samples"))
    decay_given = args.lr_decay_iters if by_iterations else args.lr_decay_samples
    decay = decay_given if decay_given is not None else (
        args.train_iters if by_iterations else args.train_samples)
    decay_named = (f"{decay_flag} {decay}" if decay_given is not None
                   else f"{length_flag} {decay}, the decay's default length")
    warmup = args.lr_warmup_iters if by_iterations else args.lr_warmup_samples
    if decay < 1:
        raise PreflightError(decay_flag, f"{decay_flag} {decay}: the learning rate would decay "
                                         f"over no {unit}; fix: pass {decay_flag} 1 or more, or "
                                         f"drop it (it then decays over {length_flag})")
    if args.lr_warmup_fraction is not None and args.lr_warmup_fraction >= 1:
        raise PreflightError("--lr-warmup-fraction",
                             f"--lr-warmup-fraction {args.lr_warmup_fraction}: the warmup must "
                             f"end before the decay does ({decay_named}); fix: pass a fraction "
                             "below 1")
    if args.lr_warmup_fraction is None and warmup >= decay:
        longer = (f"or a longer {length_flag} (train.sh: TRAIN_ITERS)" if decay_given is None
                  else f"or a longer {decay_flag}")
        raise PreflightError(warmup_flag,
                             f"{warmup_flag} {warmup} is not below the {decay} {unit} the "
                             f"learning rate decays over ({decay_named}); fix: pass "
                             f"{warmup_flag} below {decay}, {longer}")
    wsd_decay = args.lr_wsd_decay_iters if by_iterations else args.lr_wsd_decay_samples
    if args.lr_decay_style == "WSD" and wsd_decay is None:
        raise PreflightError(wsd_flag, f"--lr-decay-style WSD without {wsd_flag}: megatron's WSD "
                                       f"schedule needs the length of its final decay; fix: pass "
                                       f"{wsd_flag} N")
    if not 0 <= args.min_lr <= args.lr:
        raise PreflightError("--min-lr", f"--min-lr {args.min_lr} with --lr {args.lr}: the "
                                         "minimum learning rate must lie between 0 and --lr; "
                                         "fix: pass --min-lr in that range")
    if args.lr_warmup_init > args.lr:
        raise PreflightError("--lr-warmup-init",
                             f"--lr-warmup-init {args.lr_warmup_init} is above --lr {args.lr}: "
                             "the warmup rises from it to --lr; fix: pass --lr-warmup-init at "
                             f"most {args.lr}")
    constant = args.weight_decay_incr_style == "constant"
    start, end = ((args.weight_decay, args.weight_decay) if constant
                  else (args.start_weight_decay, args.end_weight_decay))
    if start is not None and end is not None and not 0 <= start <= end:
        raise PreflightError(
            "--weight-decay" if constant else "--start-weight-decay",
            f"weight decay from {start} to {end}: megatron's schedule keeps or raises a "
            "non-negative weight decay; fix: pass " + (
                "--weight-decay 0 or more" if constant else
                "--start-weight-decay 0 or more and --end-weight-decay at least as large"))
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise PreflightError("--override-opt_param-scheduler",
                             "--override-opt_param-scheduler with --use-checkpoint-opt_param-"
                             "scheduler: the first takes this command line's schedule, the "
                             "second the checkpoint's; fix: pass one of them")


@preflight_check("checkpoint-format")
def check_checkpoint_format(args) -> None:
    # Megatron-FSDP in 0.19.2 saves only fsdp_dtensor.
    if args.use_megatron_fsdp and args.ckpt_format != "fsdp_dtensor":
        raise PreflightError("--ckpt-format",
                             f"--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (got "
                             f"--ckpt-format {args.ckpt_format}); fix: pass --ckpt-format "
                             "fsdp_dtensor")
    if args.ckpt_format == "fsdp_dtensor" and not args.use_megatron_fsdp:
        raise PreflightError("--ckpt-format",
                             "--ckpt-format fsdp_dtensor is only for --use-megatron-fsdp; fix: "
                             "pass --use-megatron-fsdp or use --ckpt-format " +
                             ("torch_dcp" if args.use_torch_fsdp2 else "torch_dist"))
    # megatron-core 0.19.2 builds a torch_dist save's optimizer state from the model's sharded
    # state dict, which under torch FSDP2 names no parameter the optimizer holds: the run trains
    # up to its first save, which fails on every rank (KeyError); torch_dcp saves and resumes.
    if args.use_torch_fsdp2 and args.ckpt_format == "torch_dist" and args.save:
        raise PreflightError("--ckpt-format",
                             "--use-torch-fsdp2 with --ckpt-format torch_dist (the default): "
                             "every save fails on every rank (KeyError in megatron-core's "
                             "optimizer state for the saved parameters), so the run would stop "
                             "at its first save; fix: pass --ckpt-format torch_dcp, megatron's "
                             "format for torch FSDP2")


# The rank order megatron-core 0.19.2's Megatron-FSDP adapter lays its dense device mesh out in
# (mcore_fsdp_adapter._get_dp_tp_mesh): the whole world as data x expert x tensor parallel ranks,
# with no pipeline axis.
_FSDP_MESH_WITHOUT_PIPELINE = "(dp_cp ep tp) -> ep dp_cp tp"


def _megatron_fsdp_mesh_has_no_pipeline_axis() -> bool:
    """Read from the adapter megatron runs; another layout (a later megatron) is not judged."""
    try:
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    except ImportError:
        return False
    mesh = getattr(mcore_fsdp_adapter, "_get_dp_tp_mesh", None)
    return mesh is not None and _FSDP_MESH_WITHOUT_PIPELINE in mesh.__code__.co_consts


@preflight_check("megatron-fsdp-pipeline-parallel")
def check_megatron_fsdp_pipeline_parallel(args) -> None:
    # With PP > 1 the world is PP times the data x expert x tensor ranks the adapter's mesh
    # arranges, and every rank fails building it (an einops "Shape mismatch" traceback) after
    # megatron has initialised and built the model.
    if args.use_megatron_fsdp and args.pipeline_model_parallel_size > 1 \
            and _megatron_fsdp_mesh_has_no_pipeline_axis():
        raise PreflightError("--pipeline-model-parallel-size",
                             f"--use-megatron-fsdp with --pipeline-model-parallel-size "
                             f"{args.pipeline_model_parallel_size}: megatron-core's Megatron-FSDP "
                             "lays its device mesh over data, expert and tensor parallel ranks "
                             "only, and every rank fails building it; fix: use "
                             "--pipeline-model-parallel-size 1 with --use-megatron-fsdp (more "
                             "data parallelism), or drop --use-megatron-fsdp for pipeline "
                             "parallelism")


@preflight_check("megatron-fsdp-main-weights-clip")
def check_megatron_fsdp_main_weights_clip(args) -> None:
    # Megatron-FSDP hands the optimizer gradients in its main weights' dtype; megatron-core
    # 0.19.2's gradient clipping asserts fp32 gradients (clip_grad_by_total_norm_fp32), so
    # bf16/fp16 main weights (or 'auto' on a bf16/fp16 model) with --clip-grad above 0 fail on
    # every rank at the first step. The precision-aware optimizer clips its decoupled fp32 grads.
    if not args.use_megatron_fsdp or not args.clip_grad or args.clip_grad <= 0 \
            or args.use_precision_aware_optimizer:
        return
    dtype = args.megatron_fsdp_main_params_dtype
    if dtype == "auto":
        dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if dtype in ("bf16", "fp16"):
        raise PreflightError("--megatron-fsdp-main-params-dtype",
                             f"--use-megatron-fsdp with {dtype} main weights "
                             f"(--megatron-fsdp-main-params-dtype "
                             f"{args.megatron_fsdp_main_params_dtype}) and --clip-grad "
                             f"{args.clip_grad}: megatron-core 0.19.2 clips fp32 gradients only "
                             f"and every rank fails at the first step; fix: pass "
                             f"--megatron-fsdp-main-params-dtype fp32, or --clip-grad 0")


@preflight_check("megatron-fsdp-meta-device-cpu-initialization")
def check_megatron_fsdp_meta_device_cpu_initialization(args) -> None:
    # --init-model-with-meta-device builds the model under torch's meta device; with
    # --use-cpu-initialization (the CPU platform's default) megatron's own layers (the embedding,
    # the local spec's linears) make their weights there too, and Megatron-FSDP can materialize
    # only modules with a reset_parameters: every rank fails wrapping the model. Without it those
    # layers allocate on the GPU and Transformer Engine's layers reset themselves.
    if args.use_megatron_fsdp and getattr(args, "init_model_with_meta_device", False) \
            and args.use_cpu_initialization:
        raise PreflightError("--init-model-with-meta-device",
                             "--init-model-with-meta-device with --use-cpu-initialization "
                             "(the CPU platform's default): megatron's own layers are then made "
                             "on the meta device, which Megatron-FSDP cannot materialize (no "
                             "reset_parameters), and every rank fails wrapping the model; fix: "
                             "drop --init-model-with-meta-device (on a GPU, dropping "
                             "--use-cpu-initialization keeps it)")


@preflight_check("distributed-optimizer-state-function")
def check_distributed_optimizer_state_function(args) -> None:
    # megatron-core 0.19.2's DistributedOptimizer takes Adam, or an optimizer built with a state
    # function (Lion, the emerging optimizers); it builds SGD without one and asserts on every
    # rank once the model is built. Megatron-FSDP always uses the distributed optimizer.
    if args.optimizer == "sgd" and (args.use_distributed_optimizer or args.use_megatron_fsdp):
        raise PreflightError("--optimizer",
                             "--optimizer sgd with the distributed optimizer "
                             "(--use-distributed-optimizer, which --use-megatron-fsdp needs): "
                             "megatron-core 0.19.2 hands it no state function and asserts on "
                             "every rank once the model is built; fix: --optimizer adam, or "
                             "train SGD without --use-distributed-optimizer and "
                             "--use-megatron-fsdp")


@preflight_check("qk-clip-megatron-fsdp")
def check_qk_clip_megatron_fsdp(args) -> None:
    # megatron-core 0.19.2's QK-clip rescales each attention layer's weights as whole matrices
    # (a view by heads); Megatron-FSDP hands it its DTensor shards (uneven: one rank may hold
    # none of a weight), so every rank dies at the first step whose logits pass the threshold,
    # under every sharding strategy (tests/megatron_patches/moe/test_qk_clip_cpu.py runs
    # megatron's clip on its own Megatron-FSDP model).
    if getattr(args, "qk_clip", False) and args.use_megatron_fsdp:
        raise PreflightError("--qk-clip",
                             "--qk-clip with --use-megatron-fsdp: megatron-core 0.19.2's QK-clip "
                             "rescales attention weights as whole matrices, Megatron-FSDP holds "
                             "them as shards, and every rank dies at the first step whose "
                             "attention logits pass --qk-clip-threshold; fix: drop --qk-clip, "
                             "or train without --use-megatron-fsdp (the distributed optimizer "
                             "clips, patch qk-clip-distributed-optimizer)")


@preflight_check("save-interval")
def check_save_interval(args) -> None:
    if args.save and args.save_interval is None:
        raise PreflightError("--save-interval",
                             f"--save {args.save} without --save-interval (megatron asserts on "
                             "it); fix: pass --save-interval N (iterations between checkpoints)")


@preflight_check("pipeline-layer-layout")
def check_layer_layout(args) -> list[int]:
    from moe_launcher.model.layer_layout import LayerLayout, validate_layer_layout
    from moe_launcher.runtime.refusals import LayerLayoutError

    if args.num_layers is None:  # e.g. --use-checkpoint-args: megatron fills it in later
        return [-1] * args.pipeline_model_parallel_size
    moe_pattern(args)
    layer_layout = LayerLayout.from_args(args)
    if layer_layout is None:  # explicit layouts: megatron's validate_args/TransformerConfig
        return [-1] * args.pipeline_model_parallel_size
    try:
        return list(validate_layer_layout(layer_layout))
    except LayerLayoutError as exc:
        # The message starts with the flags; the flag to change is the one the problem names.
        problem = str(exc).split(": ", 1)[-1]
        candidates = ["--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                      "--num-layers", "--pipeline-model-parallel-size"]
        flag = next((f for f in candidates if f in problem), None) or next(
            (f for f in candidates[:2] if f in str(exc)), "--num-layers")
        raise PreflightError(flag, str(exc)) from None


@preflight_check("layernorm-1p-local-spec")
def check_layernorm_1p_local_spec(args) -> None:
    # megatron-core 0.19.2 parses --apply-layernorm-1p into layernorm_zero_centered_gamma,
    # 0.15 into apply_layernorm_1p.
    zero_centred = (getattr(args, "layernorm_zero_centered_gamma", False)
                    or getattr(args, "apply_layernorm_1p", False))
    if zero_centred and args.transformer_impl == "local":
        raise PreflightError("--apply-layernorm-1p",
                             "--apply-layernorm-1p needs Transformer Engine's norms: megatron's "
                             "local spec (--transformer-impl local, the CPU backend's) fails on "
                             "it once the model is built; fix: drop --apply-layernorm-1p, or "
                             "run with Transformer Engine")


@preflight_check("fp32-residual-local-norm", machine=True)
def check_fp32_residual_local_norm(args) -> None:
    # --fp32-residual-connection hands every norm fp32 hidden states. Without apex megatron's
    # local spec norms with torch's (WrappedTorchNorm): their bf16/fp16 weights meet fp32 input,
    # and the first forward fails on every rank (a mixed-dtype norm or matmul). Transformer
    # Engine's layers and apex's fused norm are left to megatron: not judged here.
    if not (args.fp32_residual_connection and args.transformer_impl == "local"
            and (args.bf16 or args.fp16)):
        return
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if gpt_layer_specs.LNImpl is WrappedTorchNorm:
        raise PreflightError("--fp32-residual-connection",
                             "--fp32-residual-connection on megatron's local spec without apex "
                             "(--transformer-impl local, torch's norms) fails at the first "
                             "forward: fp32 hidden states meet the norms' and layers' "
                             f"{'bf16' if args.bf16 else 'fp16'} weights; fix: drop "
                             "--fp32-residual-connection, or run with Transformer Engine")


@preflight_check("tokens-per-expert-dump-experts")
def check_tokens_per_expert_dump_experts(args) -> None:
    # megatron-core 0.19.2 counts the tokens per expert it dumps at Transformer Engine's grouped
    # expert linears only (hooks on TEGroupedLinear's linear_fc1); other experts (the local spec,
    # TE without --moe-grouped-gemm) train as asked and the dump is never written, silently.
    if getattr(args, "save_tokens_per_expert_interval", None) is None:
        return
    if not (args.transformer_impl == "transformer_engine" and args.moe_grouped_gemm):
        raise PreflightError("--save-tokens-per-expert-interval",
                             "--save-tokens-per-expert-interval counts tokens at Transformer "
                             "Engine's grouped-GEMM experts only: these experts "
                             f"(--transformer-impl {args.transformer_impl}"
                             f"{'' if args.moe_grouped_gemm else ', no --moe-grouped-gemm'}) "
                             "would write no dump, without a word; fix: pass --transformer-impl "
                             "transformer_engine --moe-grouped-gemm, or drop "
                             "--save-tokens-per-expert-interval (the launcher's [expert load] "
                             "log line counts tokens per expert on any experts)")


@preflight_check("context-parallel-attention")
def check_context_parallel_attention(args) -> None:
    # Context parallelism runs in Transformer Engine's attention; megatron's own
    # DotProductAttention (the local spec's, and --attention-backend local's) asserts
    # context_parallel_size == 1 when the model is built. Kitchen's attention (the local spec
    # with --use-kitchen-attention) may support it: that is left to megatron.
    if args.context_parallel_size <= 1:
        return
    from megatron.core.transformer.enums import AttnBackend

    local_attention = ((args.transformer_impl == "local" and not args.use_kitchen_attention)
                       or args.attention_backend == AttnBackend.local)
    if local_attention:
        raise PreflightError("--context-parallel-size",
                             f"--context-parallel-size {args.context_parallel_size} needs "
                             "Transformer Engine's attention, but this run builds megatron's "
                             f"local attention (--transformer-impl {args.transformer_impl}, "
                             f"--attention-backend {args.attention_backend.name}); fix: install "
                             "Transformer Engine and pass --transformer-impl transformer_engine "
                             "(not --attention-backend local), or pass --context-parallel-size 1")


def _spec_local_imports() -> bool:
    """Whether megatron's config builder can import `--spec local` (it imports --spec as a
    (module, function) pair; megatron-core 0.19.2 raises ValueError on the one word)."""
    from megatron.core.transformer.spec_utils import import_module

    try:
        return import_module(["local"]) is not None
    except Exception:  # noqa: BLE001 -- whatever megatron's importer raises
        return False


@preflight_check("attention-backend-local")
def check_attention_backend_local(args) -> None:
    # megatron's validation takes --attention-backend local only with --spec local, and its
    # config builder (before the model) imports --spec, which 'local' names no module of: every
    # such command line failed before work with a TypeError or ValueError naming neither flag.
    # The local spec's attention is the same DotProductAttention (--transformer-impl local).
    from megatron.core.transformer.enums import AttnBackend

    if args.attention_backend != AttnBackend.local or (args.spec == ["local"]
                                                       and _spec_local_imports()):
        return
    raise PreflightError("--attention-backend",
                         "--attention-backend local cannot run on this megatron-core: its "
                         "validation asks for --spec local, which its config builder cannot "
                         "import; fix: drop --attention-backend local (--transformer-impl local "
                         "builds megatron's own attention, DotProductAttention), or pass flash, "
                         "fused, unfused or auto")


@preflight_check("pipeline-comm-backend-ucc", machine=True)
def check_pipeline_comm_backend_ucc(args) -> None:
    # megatron-core 0.19.2 makes its pipeline groups with the backend this flag names; a torch
    # built without UCC (PyPI's wheels) fails there on every rank ("Distributed package doesn't
    # have UCC built in"), after the process group is up. Judged by this torch.
    import torch

    if args.pipeline_model_parallel_comm_backend == "ucc" and \
            not torch.distributed.is_ucc_available():
        raise PreflightError("--pipeline-model-parallel-comm-backend",
                             "--pipeline-model-parallel-comm-backend ucc: this torch has no UCC "
                             "(torch.distributed.is_ucc_available() is False), and megatron "
                             "fails on every rank as it makes its pipeline groups; fix: drop "
                             "the flag (pipeline stages then talk over --distributed-backend), "
                             "or use a torch built with UCC")


@preflight_check("rerun-mode")
def check_rerun_mode(args) -> None:
    # megatron-core 0.19.2's parser offers --rerun-mode report_stats, but its rerun state
    # machine's RerunMode names that mode report_determinism_stats (which the parser does not
    # offer): initialize_megatron's RerunMode(args.rerun_mode) failed on every rank with a
    # ValueError traceback. Judged by megatron's own enum.
    from megatron.core.rerun_state_machine import RerunMode

    try:
        RerunMode(args.rerun_mode)
    except ValueError:
        modes = ", ".join(mode.value for mode in RerunMode)
        raise PreflightError("--rerun-mode",
                             f"--rerun-mode {args.rerun_mode} is not a mode of megatron-core's "
                             f"rerun state machine ({modes}), which fails on every rank as it "
                             "initialises; fix: pass --rerun-mode validate_results (the "
                             "default) or disabled") from None


@preflight_check("unpadded-vocabulary-size")
def check_unpadded_vocabulary_size(args) -> None:
    # --no-pad-vocab-size only stops megatron's tokenizer from setting the padded size; with no
    # --padded-vocab-size megatron-core 0.19.2's GPT builder then pads the vocabulary itself
    # (should_pad_vocab), so the model gets the padded rows anyway, and every reader of the
    # padded size finds None: megatron's FLOPs count at the first log line (TypeError), this
    # launcher's token-id check at the first step. An exact size is --padded-vocab-size's job.
    if args.pad_vocab_size or args.padded_vocab_size is not None:
        return
    raise PreflightError("--no-pad-vocab-size",
                         "--no-pad-vocab-size without --padded-vocab-size: megatron-core "
                         "0.19.2's model builder pads the vocabulary anyway, and its FLOPs "
                         "count fails at the first iteration on the padded size it then lacks; "
                         "fix: pass --padded-vocab-size N for a model of exactly N embedding "
                         "rows, or drop --no-pad-vocab-size")


@preflight_check("data-path", machine=True)
def check_data_path(args) -> None:
    if getattr(args, "mock_data", False):
        return
    from moe_launcher.data import datasets_read, index_problem

    for name in ("data_args_path", "per_split_data_args_path"):
        listing = getattr(args, name, None)
        if listing and not os.path.isfile(listing):
            flag = "--" + name.replace("_", "-")
            raise PreflightError(flag, f"{flag} {listing}: no such file; fix: pass the file "
                                       "that lists the datasets, or --data-path")
    datasets = datasets_read(args)
    for flag in dict.fromkeys(flag for flag, _ in datasets):
        missing = [p for f, p in datasets if f == flag
                   and not (os.path.exists(p + ".bin") and os.path.exists(p + ".idx"))]
        if missing:
            raise PreflightError(flag,
                                 f"{flag} {missing[0]}: no {missing[0]}.bin/.idx"
                                 + (f" (and {len(missing) - 1} more prefixes missing)"
                                    if len(missing) > 1 else "")
                                 + "; fix: pass the prefix of an indexed dataset (the path "
                                 "without .bin/.idx) or --mock-data")
    for flag, prefix in datasets:
        if problem := index_problem(prefix):
            raise PreflightError(flag, f"{flag} {prefix}: {problem}; fix: copy the dataset "
                                       "again, or rebuild it (python -m "
                                       "moe_launcher.prepare_data)")


@preflight_check("result-rejected-tracker", machine=True)
def check_result_rejected_tracker(args) -> None:
    """megatron's rerun state machine opens --result-rejected-tracker-filename for appending on
    every rank as it starts, and raises there (a traceback per rank) when it cannot."""
    path = getattr(args, "result_rejected_tracker_filename", None)
    if not path:
        return
    flag = "--result-rejected-tracker-filename"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = "is a folder"
    elif not os.path.isdir(folder):
        problem = f"is in a folder that does not exist ({folder})"
    elif not os.access(path if os.path.exists(path) else folder, os.W_OK):
        problem = "cannot be written"
    else:
        return
    raise PreflightError(flag, f"{flag} {path} {problem}; fix: pass a file in a folder the job "
                               "can write (every job of the run appends to the same file)")


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def refuse_unwritable_folder(flag: str, folder: str) -> None:
    """PreflightError where `folder` (made if missing) cannot be written. Probed, not guessed
    (root passes every permission test, and a read-only mount or /proc refuses root too): a
    temporary folder made and removed in `folder`, or in the nearest folder above it that
    exists, so nothing is left behind."""
    existing = _nearest_existing(folder)
    if not os.path.isdir(existing):
        raise PreflightError(flag, f"{flag} {folder}: {existing} is a file, not a folder; fix: "
                                   f"pass a folder path for {flag}")
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".pretrain_moe-write-probe-").cleanup()
    except OSError as error:
        where = "" if existing == os.path.abspath(folder) else f" (it would be made in {existing})"
        raise PreflightError(flag, f"{flag} {folder} cannot be written{where}: "
                                   f"{error.strerror}; fix: pass a {flag} folder you can "
                                   "write") from None


@preflight_check("logging-folders", machine=True)
def check_logging_folders(args) -> None:
    """megatron-core 0.19.2 makes its TensorBoard writer and its wandb run on the last rank
    alone (global_vars._set_tensorboard_writer, _set_wandb_writer): a folder it cannot write,
    or wandb with no folder at all (its run goes in --wandb-save-dir, else --save/wandb), failed
    that one rank, torchrun stopped the others, and no rank said why (the launcher's refusal
    line is rank 0's). Judged on every rank alike."""
    if args.wandb_project and not (args.wandb_save_dir or args.save):
        raise PreflightError("--wandb-save-dir",
                             f"--wandb-project {args.wandb_project} without --wandb-save-dir or "
                             "--save: megatron puts the wandb run in --wandb-save-dir, else in "
                             "--save/wandb; fix: pass --wandb-save-dir DIR")
    # (--save is save-writable's; the launcher's --tensorboard-dir for wandb lies in this one)
    if args.wandb_project and args.wandb_save_dir:
        refuse_unwritable_folder("--wandb-save-dir", args.wandb_save_dir)
    if args.tensorboard_dir:
        refuse_unwritable_folder("--tensorboard-dir", args.tensorboard_dir)


@preflight_check("tokenizer-model-folder", machine=True)
def check_tokenizer_model_folder(args) -> None:
    # megatron's HuggingFaceTokenizer hands --tokenizer-model to transformers' AutoTokenizer,
    # which downloads a hub id: every rank would, a download storm on a cluster and a failure
    # offline (moe_launcher/tokenizer_folder.py).
    if args.tokenizer_type != "HuggingFaceTokenizer":
        return
    from moe_launcher.tokenizer_folder import download_hint, folder_problem

    if args.tokenizer_model is None:
        raise PreflightError("--tokenizer-model",
                             "--tokenizer-type HuggingFaceTokenizer without --tokenizer-model; "
                             "fix: pass --tokenizer-model DIR, a local tokenizer folder "
                             f"(`{download_hint('')}` makes one)")
    problem = folder_problem(args.tokenizer_model)
    if problem:
        raise PreflightError("--tokenizer-model",
                             f"--tokenizer-model: {problem}; fix: pass "
                             "--tokenizer-model DIR, a local folder with the tokenizer "
                             f"(`{download_hint(args.tokenizer_model)}` makes one)")


@preflight_check("router-top-k")
def check_router_top_k(args) -> None:
    experts, top_k = args.num_experts, args.moe_router_topk
    if not experts:
        return
    if top_k < 1:  # megatron trains such a MoE: its experts never see a token
        raise PreflightError("--moe-router-topk",
                             f"--moe-router-topk {top_k} with --num-experts {experts}: no token "
                             f"would reach an expert, so the experts would never train; fix: "
                             f"pass --moe-router-topk 1 or more")
    # megatron's TransformerConfig reads a negative factor as dropless (None); 0 reaches its
    # get_capacity, which gives every expert room for no token
    if args.moe_expert_capacity_factor == 0:
        raise PreflightError("--moe-expert-capacity-factor",
                             "--moe-expert-capacity-factor 0: no expert would have room for a "
                             "token, so every token would be dropped and the experts would never "
                             "train; fix: pass a positive factor (1.0 or more drops few tokens), "
                             "or drop the flag for dropless routing")
    if top_k > experts:
        raise PreflightError("--moe-router-topk",
                             f"--moe-router-topk {top_k} is more than --num-experts {experts}: "
                             f"a token cannot go to {top_k} different experts; fix: pass "
                             f"--moe-router-topk of at most {experts}")
    groups, group_top_k = args.moe_router_num_groups, args.moe_router_group_topk
    if not (groups and group_top_k):
        return  # megatron's TransformerConfig names what is missing
    if experts % groups:
        return  # megatron's TransformerConfig refuses it with its own message
    if group_top_k > groups:
        raise PreflightError("--moe-router-group-topk",
                             f"--moe-router-group-topk {group_top_k} is more than "
                             f"--moe-router-num-groups {groups}; fix: pass "
                             f"--moe-router-group-topk of at most {groups}")
    reachable = group_top_k * (experts // groups)
    if top_k > reachable:
        raise PreflightError("--moe-router-topk",
                             f"--moe-router-topk {top_k} is more than the {reachable} experts of "
                             f"the --moe-router-group-topk {group_top_k} groups a token may use "
                             f"({experts // groups} experts per group of "
                             f"--moe-router-num-groups {groups}); fix: raise "
                             f"--moe-router-group-topk or lower --moe-router-topk to {reachable}")


def _one_or_list(value) -> list:
    """A flag megatron reads as one value or a list (nargs='+'), as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


# Load-balancing types that route (choose the experts) rather than add a loss: megatron's
# TopKRouter.routing applies one only when it is the whole --moe-router-load-balancing-type.
ROUTING_BALANCERS = ("sinkhorn", "quantile_balancing")


@preflight_check("router-load-balancing")
def check_router_load_balancing(args) -> None:
    # Each of these is accepted by megatron's arguments and TransformerConfig and fails, or does
    # nothing, only in the router's or the experts' first forward (megatron-core 0.19.2).
    if not args.num_experts:
        return
    types = _one_or_list(args.moe_router_load_balancing_type)
    balancers = [kind for kind in types if kind in ROUTING_BALANCERS]
    if balancers and len(types) > 1:  # the list compares unequal to each: plain top-k routing
        raise PreflightError("--moe-router-load-balancing-type",
                             f"--moe-router-load-balancing-type {' '.join(types)}: megatron "
                             f"routes with {balancers[0]} only when it is the one type; in a list "
                             f"it routes by plain top-k and never applies it; fix: pass "
                             f"--moe-router-load-balancing-type {balancers[0]} alone, or drop it "
                             f"from the list")
    coefficients = _one_or_list(args.moe_aux_loss_coeff)
    if types == ["sinkhorn"] and any(coefficients):
        raise PreflightError("--moe-aux-loss-coeff",
                             f"--moe-router-load-balancing-type sinkhorn balances without an "
                             f"auxiliary loss: megatron's router asserts --moe-aux-loss-coeff 0 "
                             f"at the first forward (given {' '.join(map(str, coefficients))}); "
                             f"fix: pass --moe-aux-loss-coeff 0")
    if types == ["quantile_balancing"]:
        if args.moe_router_fusion:
            raise PreflightError("--moe-router-fusion",
                                 "--moe-router-load-balancing-type quantile_balancing has no "
                                 "fused router: megatron asserts at the first forward; fix: drop "
                                 "--moe-router-fusion")
        if args.moe_router_num_groups or args.moe_router_group_topk:
            raise PreflightError("--moe-router-num-groups",
                                 "--moe-router-load-balancing-type quantile_balancing does not "
                                 "route by groups: megatron asserts at the first forward; fix: "
                                 "drop --moe-router-num-groups and --moe-router-group-topk")
    if args.moe_apply_probs_on_input and args.moe_router_topk != 1:
        raise PreflightError("--moe-apply-probs-on-input",
                             f"--moe-apply-probs-on-input weights an expert's input by its one "
                             f"routing probability: megatron's experts assert --moe-router-topk 1 "
                             f"at the first forward (given {args.moe_router_topk}); fix: pass "
                             f"--moe-router-topk 1, or drop --moe-apply-probs-on-input")


@preflight_check("moe-expert-parallel-overlap")
def check_moe_expert_parallel_overlap(args) -> None:
    if args.overlap_moe_expert_parallel_comm:
        raise PreflightError("--overlap-moe-expert-parallel-comm",
                             "--overlap-moe-expert-parallel-comm runs megatron's combined 1F1B "
                             "schedule, which needs a forward step that returns a schedule plan "
                             "(return_schedule_plan); pretrain_moe's forward step does not; fix: "
                             "drop --overlap-moe-expert-parallel-comm")


@preflight_check("mtp-per-token-loss")
def check_mtp_per_token_loss(args) -> None:
    # megatron-core 0.19.2's process_mtp_loss weights a micro-batch's MTP loss by that
    # micro-batch's own original/rolled token counts, where per-token loss needs the step's; the
    # counts differ between micro-batches only when the loss mask does (--eod-mask-loss), and
    # the step's counts are not known before the first backward, so no sound fix exists here.
    if getattr(args, "mtp_num_layers", None) and args.calculate_per_token_loss and \
            args.eod_mask_loss:
        raise PreflightError("--calculate-per-token-loss",
                             "--calculate-per-token-loss with --mtp-num-layers and "
                             "--eod-mask-loss: megatron-core 0.19.2 weights each micro-batch's "
                             "MTP loss by its own token counts, not the step's, so the MTP "
                             "gradient is silently off wherever EOD masks differ (Megatron-LM "
                             "#7452); fix: drop --calculate-per-token-loss (or --eod-mask-loss)")


@preflight_check("muon-precision")
def check_muon_precision(args) -> None:
    # megatron-core 0.19.2's emerging optimizers (Muon) refuse fp16 when the optimizer is built,
    # after the model (a traceback on every rank); with the distributed optimizer they run under
    # its layer-wise optimizer, which wraps them in megatron's optimizer class for bf16 only: in
    # fp32 every rank dies at the first step ('TensorParallelMuon' object has no attribute
    # 'get_loss_scale').
    from moe_launcher.platform_defaults import MUON_OPTIMIZERS

    if args.optimizer not in MUON_OPTIMIZERS:
        return
    if args.fp16:
        raise PreflightError("--fp16", f"--optimizer {args.optimizer} with --fp16: megatron-core "
                                       "0.19.2's emerging optimizers do not train in fp16; fix: "
                                       "pass --bf16 instead")
    layer_wise = args.use_distributed_optimizer or args.optimizer == "dist_muon"
    if layer_wise and not args.bf16:
        raise PreflightError("--use-distributed-optimizer",
                             f"--optimizer {args.optimizer} with the distributed optimizer in "
                             "fp32: megatron-core 0.19.2's layer-wise optimizer, which takes "
                             "Muon's matrices then, trains only in bf16 (in fp32 every rank "
                             "dies at the first step); fix: pass --bf16, or drop "
                             "--use-distributed-optimizer")


def adaptive_muon_step_failure() -> str | None:
    """Why megatron's TensorParallelAdaptiveMuon cannot take a step, or None when it can (or
    when emerging-optimizers is not installed: megatron names it): one step on a 2 x 2 matrix,
    on the CPU, without process groups."""
    import torch
    from megatron.core.optimizer.emerging_optimizers import (
        HAVE_EMERGING_OPTIMIZERS,
        TensorParallelAdaptiveMuon,
    )

    if not HAVE_EMERGING_OPTIMIZERS:
        return None
    matrix = torch.nn.Parameter(torch.ones(2, 2))
    matrix.grad = torch.eye(2)
    try:
        TensorParallelAdaptiveMuon([matrix], lr=0.1, fp32_matmul_prec="high").step()
    except AttributeError as exc:
        return str(exc)
    return None


@preflight_check("adaptive-muon-step", machine=True)
def check_adaptive_muon_step(args) -> None:
    # megatron-core 0.19.2's TensorParallelAdaptiveMuon hands its step to emerging-optimizers'
    # AdaptiveMuon.step, which in 0.3.0 (the only release on PyPI) scales the update by
    # self.scale_mode after the second moment; megatron's class never sets that attribute, so
    # every rank dies at its first update, after the model is built. Decided by a step of the
    # installed packages (hence of the machine), so that a release that mends it passes.
    if args.optimizer != "adaptive_muon":
        return
    failure = adaptive_muon_step_failure()
    if failure:
        raise PreflightError("--optimizer",
                             "--optimizer adaptive_muon: megatron-core's "
                             "TensorParallelAdaptiveMuon cannot take a step with the installed "
                             f"emerging-optimizers ({failure}), so every rank would die at its "
                             "first update; fix: use --optimizer muon")


@preflight_check("gated-delta-net-tensor-parallel-norm")
def check_gated_delta_net_tensor_parallel_norm(args) -> None:
    # megatron-core 0.19.2's gated delta net splits its value heads over TP but keeps one
    # out_norm over the head dimension on every TP rank; each rank's gradient of it covers its
    # own heads only, and finalize_model_grads sums a replicated parameter over TP only when it
    # is marked sequence-parallel under --sequence-parallel (TE's norm marks itself then) or is
    # a q/k layernorm. Without sequence parallelism every TP rank trains its own copy
    # (Megatron-LM #7452, finding 11). The same GatedDeltaNet (ssm/gated_delta_net) is built for
    # `G` in a hybrid pattern and for a GPT model's --experimental-attention-variant
    # gated_delta_net layers. GDN needs TE's spec and flash-linear-attention, so only a GPU run
    # reaches this: refused rather than patched blind.
    pattern = args.hybrid_layer_pattern or args.hybrid_override_pattern
    if pattern and "G" in pattern:
        layers = f"--hybrid-layer-pattern {pattern!r} has gated delta net layers (G)"
    elif getattr(args, "experimental_attention_variant", None) == "gated_delta_net":
        layers = "--experimental-attention-variant gated_delta_net builds gated delta net layers"
    else:
        return
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise PreflightError("--sequence-parallel",
                             f"{layers} at --tensor-model-parallel-size "
                             f"{args.tensor_model_parallel_size} without --sequence-parallel: "
                             "megatron-core 0.19.2 never sums their out_norm weight gradient "
                             "over TP, so each TP rank trains its own copy (Megatron-LM #7452, "
                             "finding 11); fix: add --sequence-parallel (the norm is then summed "
                             "over TP) or use TP 1")


@preflight_check("multi-latent-attention-spec", machine=True)
def check_multi_latent_attention_spec(args) -> None:
    if not args.multi_latent_attention or args.transformer_impl != "local":
        return
    from megatron_patches.build.local_mla_core_attention import local_core_attention_builds_mla
    from megatron_patches.registry import probe_output_dropped

    with probe_output_dropped():
        builds_mla = local_core_attention_builds_mla()
    if not builds_mla:  # (patch local-mla-core-attention left out)
        raise PreflightError("--multi-latent-attention",
                             "--multi-latent-attention on megatron's local spec "
                             "(--transformer-impl local): megatron-core's local core attention "
                             "takes no k_channels/v_channels (Megatron-LM #1589) and the model "
                             "fails to build; fix: keep the patch local-mla-core-attention "
                             "applied (out of MEGATRON_PATCHES_DISABLE), or pass "
                             "--transformer-impl transformer_engine with Transformer Engine "
                             "installed")


@preflight_check("mla-yarn-flags", machine=True)
def check_mla_yarn_flags(args) -> None:
    # (MLA's rope is yarn unless --rope-type says otherwise)
    if not args.multi_latent_attention or args.rope_type not in (None, "yarn"):
        return
    from megatron_patches.build.mla_yarn_flags import YARN_FIELDS, mla_config_takes_yarn_flags
    from megatron_patches.registry import probe_output_dropped

    given = [arg for arg in YARN_FIELDS if getattr(args, arg, None) is not None]
    with probe_output_dropped():
        takes_yarn = bool(given) and mla_config_takes_yarn_flags()
    if given and not takes_yarn:  # (patch mla-yarn-flags left out)
        flag = "--" + given[0].replace("_", "-")
        raise PreflightError(flag, f"{flag} with --multi-latent-attention: megatron-core 0.19.2 "
                                   "builds MLA's YaRN without it (beta_fast 32, beta_slow 1, "
                                   "original context 4096) and says nothing; fix: keep the patch "
                                   "mla-yarn-flags applied (out of MEGATRON_PATCHES_DISABLE)")


@preflight_check("moe-tensor-parallel-sequence-parallel")
def check_moe_tensor_parallel_sequence_parallel(args) -> None:
    # megatron's MoE layer raises this in its first training forward, not in validate_args.
    if args.num_experts and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise PreflightError("--sequence-parallel",
                             "MoE with --tensor-model-parallel-size "
                             f"{args.tensor_model_parallel_size} trains only with "
                             "--sequence-parallel (megatron's MoE layer refuses it at the first "
                             "step); fix: pass --sequence-parallel")


@preflight_check("expert-bias-local-spec")
def check_expert_bias_local_spec(args) -> None:
    # megatron 0.19.2's local expert MLP adds the bias in place onto the output of its
    # row-parallel reduce, which at expert tensor parallel size 1 is its input returned as is:
    # autograd refuses that at the first step ("Output 0 of _ReduceFromModelParallelRegion is a
    # view and is being modified inplace"). Seen at ETP 1; other sizes are left to megatron.
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    if (args.num_experts and args.add_bias_linear and args.transformer_impl == "local"
            and not args.moe_grouped_gemm and etp == 1):
        raise PreflightError("--disable-bias-linear",
                             "MoE experts with bias on megatron's local spec (--transformer-impl "
                             "local, expert tensor parallel size 1) fail at the first step in "
                             "megatron-core's expert MLP (in-place bias add on a reduce output); "
                             "fix: pass --disable-bias-linear, or use --transformer-impl "
                             "transformer_engine")


def check_args(args, only: tuple[str, ...] | None = None) -> None:
    """Runs every registered check (or those named in `only`) on megatron's parsed args."""
    for check in _CHECKS.values():
        if only is None or check.name in only:
            check.run(args)


def check_flags(args) -> None:
    """The checks that judge the flags alone (the dry run's): every one not of the machine."""
    check_args(args, only=tuple(check.name for check in _CHECKS.values() if not check.machine))


LAYOUT_CHECKS = ("model-parallel-fits-world", "expert-grid-fits-stage", "experts-split",
                 "tensor-and-context-split", "positive-sizes", "batch-split", "checkpoint-format",
                 "pipeline-layer-layout", "megatron-fsdp-pipeline-parallel")


def check_layout(args) -> Layout:
    """The layout arithmetic checks (the planner's view); returns the layout they describe."""
    check_args(args, only=LAYOUT_CHECKS)
    w, tp, pp, cp, ep, etp = _sizes(args)
    dp = w // (tp * pp * cp)
    edp = (w // pp) // (ep * etp)
    return Layout(w, tp, pp, cp, dp, ep, etp, edp, _virtual_pipeline(args),
                  check_layer_layout(args), moe_pattern(args))


@preflight_check("hybrid-layer-pattern")
def check_hybrid_layer_pattern(args) -> None:
    # --hybrid-layer-pattern builds megatron's HybridModel (moe_launcher/model/hybrid_spec.py); a
    # layer family it cannot build here is refused rather than left to fail mid-build.
    pattern = args.hybrid_layer_pattern or args.hybrid_override_pattern
    if not pattern:
        return
    from moe_launcher.model.hybrid_spec import pattern_problem

    problem = pattern_problem(pattern, args.transformer_impl)
    if problem:
        raise PreflightError("--hybrid-layer-pattern", f"--hybrid-layer-pattern {pattern!r}: "
                             + problem)
    # megatron-core 0.19.2 builds the pattern's layers and replaces --num-layers by their
    # number without a word: the #1778 class (layers built != layers asked) for HybridModel.
    decoder_layers = len(pattern.split("/")[0].replace("|", ""))
    if args.num_layers is not None and args.num_layers != decoder_layers:
        raise PreflightError("--num-layers",
                             f"--num-layers {args.num_layers} but --hybrid-layer-pattern "
                             f"{pattern!r} has {decoder_layers} decoder layers; megatron-core "
                             f"would build {decoder_layers} and report them as "
                             f"{args.num_layers} nowhere (NVIDIA/Megatron-LM#1778 class); fix: "
                             f"pass --num-layers {decoder_layers} or change the pattern")
