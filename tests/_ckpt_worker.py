"""Writes real megatron-core checkpoints of a tiny MoE GPT from 2 gloo processes on CPU.

    torchrun --nproc-per-node=2 tests/_ckpt_worker.py SCENARIO OUT_DIR
    (the tests run it through _checkpoints.run_scenario, i.e. the suite's _launch.launch)

Scenarios (each one run of 2 ranks, results in OUT_DIR/result_rank{R}.json):
  make    good checkpoints etp1/ (TP1 EP2 ETP1) and etp2/ (TP2 EP1 ETP2), and damaged/.
  guards  with both guard patches applied: save good, then try to save a damaged layout on top
          (#1836 shapes, then true shapes with ETP rank 1's chunks dropped); try to load
          OUT_DIR/damaged/, then load OUT_DIR/etp2/ (made by `make`); judge the keys and shapes
          TEGroupedMLP produces against real ETP-sharded parameters.
  fsdp_guard  fsdp_dtensor saves and loads of DTensor state dicts through megatron.training's
          own call sites (generate_state_dict, preprocess_fsdp_dtensor_state_dict,
          _load_base_checkpoint).
  bench   save the model at ETP1 and ETP2, then time ETP2 saves with and without the save guard.

State dicts are built by megatron.training.checkpointing.generate_state_dict, the call
save_checkpoint makes, so the save guard's hook there sees them as in a training run.

How the damaged checkpoint reproduces Megatron-LM #1836: we build the real ETP=2 sharded state
dict, apply its factories, then rewrite every expert ShardedTensor the way the buggy code
declared it: the ETP-sharded axis gets a global size of one ETP shard, the chunk offset loses
its ETP component, and ETP ranks > 0 become non-main replicas. Main replicas then tile the
shrunken global shape perfectly (megatron's own validation passes) and only ETP rank 0's half
of every expert matrix is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

WORLD = 2
ITER_NAME = "iter_{:07d}"
TRACKER = "latest_checkpointed_iteration.txt"
LAYOUTS = {"etp1": dict(tp=1, ep=2, etp=1), "etp2": dict(tp=2, ep=1, etp=2)}


def model_args(tp: int, ep: int, etp: int, swiglu: bool = True,
               ckpt_format: str = "torch_dist") -> argparse.Namespace:
    """The args megatron.training would store in the checkpoint for this model (and the few
    generate_state_dict reads)."""
    return argparse.Namespace(
        num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
        group_query_attention=False, num_query_groups=None, ffn_hidden_size=64,
        num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48, swiglu=swiglu,
        padded_vocab_size=128, seq_length=16, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        ckpt_format=ckpt_format, no_save_optim=True, no_save_rng=True,
    )


def build_model(tp: int, ep: int, etp: int, swiglu: bool = True, ckpt_format: str = "torch_dist"):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    a = model_args(tp, ep, etp, swiglu, ckpt_format)
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        kv_channels=a.kv_channels, ffn_hidden_size=a.ffn_hidden_size, num_moe_experts=a.num_experts,
        moe_router_topk=a.moe_router_topk, moe_ffn_hidden_size=a.moe_ffn_hidden_size,
        gated_linear_unit=a.swiglu, add_bias_linear=False, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp)
    torch.manual_seed(1234)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=8),
                     vocab_size=a.padded_vocab_size, max_sequence_length=a.seq_length)
    return model, a


def state_dict(model, args, iteration: int, damage: str | None = None) -> dict:
    """What save_checkpoint saves, built by megatron.training's generate_state_dict (looked up at
    call time, like save_checkpoint does); damage="shrink" declares the model's expert tensors
    as #1836 did, damage="holes" keeps their true shapes but drops ETP rank 1's chunks."""
    from megatron.training import checkpointing

    if damage is None:
        return checkpointing.generate_state_dict(args, [model], None, None, None, iteration=iteration)
    # #1836 lived in the model's sharded_state_dict: stand in for that method.
    original = model.sharded_state_dict
    model.sharded_state_dict = lambda **kw: damage_like_1836(original(**kw), damage == "shrink")
    try:
        return checkpointing.generate_state_dict(args, [model], None, None, None, iteration=iteration)
    finally:
        del model.sharded_state_dict


def damage_like_1836(sd: dict, shrink: bool = True) -> dict:
    """Rewrites the expert ShardedTensors as megatron-core <0.16 declared them (see module doc);
    shrink=False keeps the true global shape and only makes ETP ranks > 0 non-main replicas."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from moe_launcher.checkpoint_files.shape_rules import is_expert_key

    apply_factories(sd)
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()

    def damage(sh):
        if not (isinstance(sh, ShardedTensor) and is_expert_key(sh.key)):
            return sh
        p = sh.prepend_axis_num
        axes = [i for i, (g, l) in enumerate(zip(sh.global_shape[p:], sh.local_shape)) if l < g]
        if not axes:
            return sh
        if not shrink:
            return dataclasses.replace(sh, replica_id=(etp_rank,) + tuple(sh.replica_id[1:]))
        axis = p + axes[0]
        local = sh.local_shape[axes[0]]
        global_shape = list(sh.global_shape)
        global_offset = list(sh.global_offset)
        global_shape[axis] //= etp
        global_offset[axis] = (global_offset[axis] - etp_rank * local) // etp
        return dataclasses.replace(
            sh, global_shape=tuple(global_shape), global_offset=tuple(global_offset),
            axis_fragmentations=tuple(g // l for g, l in zip(
                global_shape, (1,) * p + tuple(sh.local_shape))),
            replica_id=(etp_rank,) + tuple(sh.replica_id[1:]))

    dict_list_map_inplace(damage, sd)
    return sd


def save(sd: dict, root: str, iteration: int) -> float:
    """Saves like megatron.training: iteration dir first, tracker file only after success."""
    from megatron.core import dist_checkpointing

    path = os.path.join(root, ITER_NAME.format(iteration))
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    start = time.perf_counter()
    dist_checkpointing.save(sd, path)
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return elapsed


def load(model, args, root_or_iter: str):
    from megatron.core import dist_checkpointing

    path = root_or_iter
    if os.path.isfile(os.path.join(root_or_iter, TRACKER)):
        with open(os.path.join(root_or_iter, TRACKER)) as f:
            path = os.path.join(root_or_iter, ITER_NAME.format(int(f.read())))
    return dist_checkpointing.load(state_dict(model, args, 0), path)





def scenario_make(out: str) -> dict:
    for name, layout in LAYOUTS.items():
        model, args = build_model(**layout)
        save(state_dict(model, args, 1), os.path.join(out, name), 1)
    model, args = build_model(**LAYOUTS["etp2"])
    save(state_dict(model, args, 1, damage="shrink"), os.path.join(out, "damaged"), 1)
    return {"ok": True}


def _attempt(fn) -> str | None:
    """None if fn() succeeded, else the exception's type and message."""
    try:
        fn()
        return None
    except Exception as e:  # the test asserts on the type and message
        return f"{type(e).__name__}: {e}"


def scenario_guards(out: str) -> dict:
    from megatron_patches import registry
    from megatron_patches.checkpointing import checkpoint_completeness_guard as checkpoint_guard
    from megatron_patches.checkpointing import checkpoint_load_guard

    statuses = registry.apply_patches(registry.current_context(cpu_backend=True))
    model, args = build_model(**LAYOUTS["etp2"])
    root = os.path.join(out, "guarded")
    save(state_dict(model, args, 1), root, 1)
    before = _snapshot(root)
    damaged_save = _attempt(lambda: save(state_dict(model, args, 2, damage="shrink"), root, 2))
    dist.barrier()  # reaching this proves no rank hung
    holes_save = _attempt(lambda: save(state_dict(model, args, 2, damage="holes"), root, 2))
    dist.barrier()
    after = _snapshot(root)
    from megatron.training import checkpointing

    guard_fns = (checkpoint_guard.state_dict_utils.validate_sharding_integrity,
                 checkpointing.generate_state_dict, checkpointing._load_base_checkpoint)
    registry.apply_patches(registry.current_context(cpu_backend=True))
    checkpoint_guard.apply_save_guard()
    checkpoint_load_guard.apply_load_guard()
    idempotent = guard_fns == (checkpoint_guard.state_dict_utils.validate_sharding_integrity,
                               checkpointing.generate_state_dict, checkpointing._load_base_checkpoint)
    damaged_load = _attempt(lambda: load(model, args, os.path.join(out, "damaged")))
    dist.barrier()
    good_load = _attempt(lambda: load(model, args, os.path.join(out, "etp2")))
    return {
        "statuses": [s.line() for s in statuses],
        "error_type": checkpoint_guard.IncompleteCheckpointError.__name__,
        "damaged_save": damaged_save,
        "holes_save": holes_save,
        "files_before_damaged_save": before,
        "files_after_damaged_save": after,
        "idempotent": idempotent,
        "damaged_load": damaged_load,
        "good_load": good_load,
        "te_grouped": _te_grouped_verdicts(),
    }


def _te_grouped_verdicts() -> dict:
    """The keys and shapes TEGroupedMLP produces (Transformer Engine is not installable here):
    parameters named and sharded as TE's grouped linear holds them (`weight0`, `weight1`, one
    ETP-sharded matrix per local expert, or one grouped `weight` split per expert), wrapped the
    way TEGroupedMLP._sharded_state_dict_grouped wraps them (megatron's own
    make_sharded_tensors_for_checkpoint, the expert axis prepended, keys without the index) and,
    for fsdp_dtensor, as DTensors keyed `linear_fc1.weight0`. Judged against the parameters."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.device_mesh import init_device_mesh

    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    from moe_launcher.model import param_shapes

    etp_group = parallel_state.get_expert_tensor_parallel_group()
    h, rows, local_experts = 32, 24, 2  # rows per ETP rank

    class GroupedLinear(torch.nn.Module):  # the parameter layout of TE's GroupedLinear
        def __init__(self, single_grouped_weight: bool):
            super().__init__()
            self._tp_group = etp_group
            names = ["weight"] if single_grouped_weight else [f"weight{i}" for i in range(local_experts)]
            for name in names:
                n = local_experts if single_grouped_weight else 1
                param = torch.nn.Parameter(torch.zeros(n * rows, h))
                param.tensor_model_parallel, param.partition_dim, param.allreduce = True, 0, False
                self.register_parameter(name, param)

    def sharded(module, single: bool, declared_rows: int | None = None) -> dict:
        sd = {}
        for i in range(local_experts):
            weight = module.weight.chunk(local_experts)[i] if single else getattr(module, f"weight{i}")
            sub = make_sharded_tensors_for_checkpoint(
                {f"{i}.weight": weight}, "", {f"{i}.weight": 0}, ((0, i, local_experts),),
                tp_group=etp_group, dp_cp_group=parallel_state.get_data_parallel_group())
            sh = sub[f"{i}.weight"]
            if declared_rows:  # #1836: one ETP shard's rows as the global size
                sh = dataclasses.replace(sh, global_shape=(local_experts, declared_rows, h),
                                         global_offset=(i, 0, 0), axis_fragmentations=(local_experts, 1, 1))
            sd[f"decoder.layers.0.mlp.experts.linear_fc1.weight{i}"] = dataclasses.replace(
                sh, key="decoder.layers.0.mlp.experts.experts.linear_fc1.weight")
        return sd

    verdicts = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    for single in (False, True):
        module = GroupedLinear(single)
        params = param_shapes.ModelParams([module])
        for damaged in (False, True):
            sd = sharded(module, single, declared_rows=rows if damaged else None)
            verdict = param_shapes.judge_sharded_state_dict(sd, params)
            verdicts[f"torch_dist single={single} damaged={damaged}"] = dataclasses.asdict(verdict)
        if not single:
            for damaged in (False, True):
                dtensors = {f"decoder.layers.0.mlp.experts.linear_fc1.weight{i}": DTensor.from_local(
                    getattr(module, f"weight{i}").detach(), mesh, [Replicate() if damaged else Shard(0)])
                    for i in range(local_experts)}
                # Named as in the model: decoder.layers.0.mlp.experts.linear_fc1.weight0
                named = torch.nn.ModuleDict({"linear_fc1": module})
                for part in reversed("decoder.layers.0.mlp.experts".split(".")):
                    named = torch.nn.ModuleDict({part: named})
                verdict = param_shapes.judge_dtensor_state_dict(
                    dtensors, param_shapes.ModelParams([named]))
                verdicts[f"fsdp_dtensor damaged={damaged}"] = dataclasses.asdict(verdict)
    return verdicts


class FsdpDTensorModel(torch.nn.Module):
    """Stands in for Megatron-FSDP, which needs CUDA: `state_dict_for_save_checkpoint` (what
    generate_state_dict calls for fsdp_dtensor) gives the wrapped model's parameters as DTensors
    on a mesh over both ranks, keyed `module.<name>` like Megatron-FSDP's. Expert parameters are
    ETP-sharded on their partition dim; damaged=True declares them the #1836 way, Replicate at
    one ETP shard's size."""

    def __init__(self, model, mesh, damaged: bool):
        super().__init__()
        self.module, self.mesh, self.damaged = model, mesh, damaged

    def state_dict_for_save_checkpoint(self) -> dict:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        state = {}
        for name, param in self.module.named_parameters():
            etp_sharded = not getattr(param, "allreduce", True) and param.tensor_model_parallel
            placement = Shard(param.partition_dim) if etp_sharded and not self.damaged else Replicate()
            state[f"module.{name}"] = DTensor.from_local(param.detach(), self.mesh, [placement])
        return state


def scenario_fsdp_guard(out: str) -> dict:
    """fsdp_dtensor saves and loads through megatron.training's own call sites, guards applied:
    a good save, a #1836 save (refused), then loads of a #1836 checkpoint written without the
    guard (refused) and of the good one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from megatron.training import checkpointing
    from megatron_patches.checkpointing import checkpoint_completeness_guard as checkpoint_guard
    from megatron_patches.checkpointing import checkpoint_load_guard

    dcp_save = dcp.save
    checkpoint_guard.apply_save_guard()
    checkpoint_load_guard.apply_load_guard()
    model, args = build_model(tp=1, ep=1, etp=2, swiglu=False, ckpt_format="fsdp_dtensor")
    mesh = init_device_mesh("cpu", (WORLD,))
    good, damaged = (FsdpDTensorModel(model, mesh, d) for d in (False, True))

    def save_like_megatron(wrapper, root: str, generate=checkpointing.generate_state_dict) -> None:
        # save_checkpoint's fsdp_dtensor path: generate, preprocess, DCP save, then the tracker.
        path = os.path.join(root, ITER_NAME.format(1))
        state = generate(args, [wrapper], None, None, None, iteration=1)
        state = checkpointing.preprocess_fsdp_dtensor_state_dict(args, state, wrapper)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
        if dist.get_rank() == 0:
            with open(os.path.join(root, TRACKER), "w") as f:
                f.write("1")
        dist.barrier()

    def load_like_megatron(root: str) -> None:
        load_args = argparse.Namespace(**vars(args), non_persistent_global_ckpt_dir=None,
                                       non_persistent_ckpt_type=None, ckpt_step=None,
                                       exit_on_missing_checkpoint=False, use_megatron_fsdp=True,
                                       strict_fsdp_dtensor_load=False)
        state = checkpointing.generate_state_dict(load_args, [good], None, None, None, iteration=1)
        state["_model"] = [good]
        checkpointing._load_base_checkpoint(root, load_args, rank0=False, sharded_state_dict=state)

    good_save = _attempt(lambda: save_like_megatron(good, os.path.join(out, "fsdp_good")))
    damaged_save = _attempt(lambda: save_like_megatron(damaged, os.path.join(out, "fsdp_damaged")))
    dist.barrier()
    damaged_written = os.path.exists(os.path.join(out, "fsdp_damaged", ITER_NAME.format(1), ".metadata"))
    # The #1836 checkpoint as an unguarded run wrote it.
    unguarded = getattr(checkpointing.generate_state_dict, "__wrapped__")
    save_like_megatron(damaged, os.path.join(out, "fsdp_1836"), generate=unguarded)
    damaged_load = _attempt(lambda: load_like_megatron(os.path.join(out, "fsdp_1836")))
    dist.barrier()
    good_load = _attempt(lambda: load_like_megatron(os.path.join(out, "fsdp_good")))
    return {"dcp_save_untouched": dcp.save is dcp_save,
            "good_save": good_save, "damaged_save": damaged_save,
            "damaged_written": damaged_written, "damaged_load": damaged_load,
            "good_load": good_load}


def _snapshot(root: str) -> dict[str, list[int]]:
    """(size, mtime_ns) of every file under root, to show a refused save changed nothing."""
    files = {}
    for directory, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(directory, name))
            files[os.path.relpath(os.path.join(directory, name), root)] = [st.st_size, st.st_mtime_ns]
    return files


def scenario_bench(out: str, repeats: int = 15) -> dict:
    """Saves etp1/ and etp2/ once, then the ETP=2 model repeatedly without and with the guard
    (each timed from building the state dict to the end of the save)."""
    from megatron.training import checkpointing
    from megatron_patches.checkpointing import checkpoint_completeness_guard as checkpoint_guard

    for name, layout in LAYOUTS.items():
        model, args = build_model(**layout)
        save(state_dict(model, args, 1), os.path.join(out, name), 1)
    model, args = build_model(**LAYOUTS["etp2"])
    unguarded = (checkpoint_guard.state_dict_utils.validate_sharding_integrity,
                 checkpoint_guard.serialization.save_preprocess, checkpointing.generate_state_dict)
    check_times: list[float] = []

    def timed(check):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return check(*a, **k)
            finally:
                check_times.append(time.perf_counter() - start)
        return run

    # Both checks are looked up at call time: the shapes against the parameters, the tiling.
    checkpoint_guard.enforce_complete_layout = timed(checkpoint_guard.enforce_complete_layout)
    checkpoint_guard.refuse_wrong_model_shapes = timed(checkpoint_guard.refuse_wrong_model_shapes)
    times: dict[str, list[float]] = {"without_guard": [], "with_guard": []}
    iteration = 1
    for _ in range(repeats):
        for mode in times:  # interleaved, so drift in machine load hits both alike
            if mode == "with_guard":
                checkpoint_guard.apply_save_guard()
            else:
                (checkpoint_guard.state_dict_utils.validate_sharding_integrity,
                 checkpoint_guard.serialization.save_preprocess,
                 checkpointing.generate_state_dict) = unguarded
            iteration += 1
            start = time.perf_counter()
            sd = state_dict(model, args, iteration)
            built = time.perf_counter() - start
            times[mode].append(built + save(sd, os.path.join(out, "timed", mode), iteration))
    # Two checks per guarded save: report their sum per save.
    return {"times": times, "check_times": [a + b for a, b in zip(check_times[::2], check_times[1::2])]}


SCENARIOS = {"make": scenario_make, "guards": scenario_guards, "bench": scenario_bench,
             "fsdp_guard": scenario_fsdp_guard}


def main() -> None:
    """One rank of a scenario, started by the suite's harness (tests/_launch.py, torchrun)."""
    scenario, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    os.makedirs(out, exist_ok=True)
    # Before megatron is imported: the project's CPU backend stands in for CUDA.
    from moe_launcher import cpu_backend

    cpu_backend.activate()
    dist.init_process_group("gloo")
    try:
        result = SCENARIOS[scenario](out)
    except Exception:
        result = {"crash": traceback.format_exc()}
    with open(os.path.join(out, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
