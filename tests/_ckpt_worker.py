"""Writes real megatron-core checkpoints of a tiny MoE GPT from 2 gloo processes on CPU.

    python tests/_ckpt_worker.py SCENARIO OUT_DIR

Scenarios (each one spawn of 2 ranks, results in OUT_DIR/result_rank{R}.json):
  make    good checkpoints etp1/ (TP1 EP2 ETP1) and etp2/ (TP2 EP1 ETP2), and damaged/.
  guards  with both guard patches applied: save good, then try to save a damaged layout on top;
          try to load OUT_DIR/damaged/, then load OUT_DIR/etp2/ (made by `make`).
  fsdp_guard  DTensor checkpoints in fsdp_dtensor's layout through the guarded DCP save.
  bench   save the model at ETP1 and ETP2, then time ETP2 saves with and without the save guard.

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
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
ITER_NAME = "iter_{:07d}"
TRACKER = "latest_checkpointed_iteration.txt"
LAYOUTS = {"etp1": dict(tp=1, ep=2, etp=1), "etp2": dict(tp=2, ep=1, etp=2)}


def model_args(tp: int, ep: int, etp: int) -> argparse.Namespace:
    """The args megatron.training would store in the checkpoint for this model."""
    return argparse.Namespace(
        num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
        group_query_attention=False, num_query_groups=None, ffn_hidden_size=64,
        num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48, swiglu=True,
        padded_vocab_size=128, seq_length=16, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )


def build_model(tp: int, ep: int, etp: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    a = model_args(tp, ep, etp)
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


def state_dict(model, args, iteration: int) -> dict:
    return {"model": model.sharded_state_dict(), "args": args, "iteration": iteration}


def damage_like_1836(sd: dict) -> dict:
    """Rewrites the expert ShardedTensors as megatron-core <0.16 declared them (see module doc)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron_patches.checkpoint_audit import is_expert_key

    apply_factories(sd)
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()

    def shrink(sh):
        if not (isinstance(sh, ShardedTensor) and is_expert_key(sh.key)):
            return sh
        p = sh.prepend_axis_num
        axes = [i for i, (g, l) in enumerate(zip(sh.global_shape[p:], sh.local_shape)) if l < g]
        if not axes:
            return sh
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

    dict_list_map_inplace(shrink, sd)
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
    save(damage_like_1836(state_dict(model, args, 1)), os.path.join(out, "damaged"), 1)
    return {"ok": True}


def _attempt(fn) -> str | None:
    """None if fn() succeeded, else the exception's type and message."""
    try:
        fn()
        return None
    except Exception as e:  # the test asserts on the type and message
        return f"{type(e).__name__}: {e}"


def scenario_guards(out: str) -> dict:
    from megatron_patches import checkpoint_guard, registry

    statuses = registry.apply_patches(registry.current_context(cpu_backend=True))
    model, args = build_model(**LAYOUTS["etp2"])
    root = os.path.join(out, "guarded")
    save(state_dict(model, args, 1), root, 1)
    before = _snapshot(root)
    damaged_save = _attempt(lambda: save(damage_like_1836(state_dict(model, args, 2)), root, 2))
    dist.barrier()  # reaching this proves no rank hung
    after = _snapshot(root)
    guard_fn = checkpoint_guard.state_dict_utils.validate_sharding_integrity
    registry.apply_patches(registry.current_context(cpu_backend=True))
    checkpoint_guard.apply_save_guard()
    checkpoint_guard.apply_load_guard()
    idempotent = guard_fn is checkpoint_guard.state_dict_utils.validate_sharding_integrity
    damaged_load = _attempt(lambda: load(model, args, os.path.join(out, "damaged")))
    dist.barrier()
    good_load = _attempt(lambda: load(model, args, os.path.join(out, "etp2")))
    return {
        "statuses": [s.line() for s in statuses],
        "error_type": checkpoint_guard.IncompleteCheckpointError.__name__,
        "damaged_save": damaged_save,
        "files_before_damaged_save": before,
        "files_after_damaged_save": after,
        "idempotent": idempotent,
        "damaged_load": damaged_load,
        "good_load": good_load,
    }


def scenario_fsdp_guard(out: str) -> dict:
    """DTensor state dicts in fsdp_dtensor's layout, saved through the guarded DCP save: one
    sharded across both ranks (good), one with expert weights Replicate at 1/ETP rows (#1836
    under Megatron-FSDP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megatron_patches import checkpoint_guard

    checkpoint_guard.apply_save_guard()
    mesh = init_device_mesh("cpu", (WORLD,))
    args = model_args(tp=1, ep=1, etp=2)
    h, f = args.hidden_size, args.moe_ffn_hidden_size

    def model(rows: int, placement) -> dict:
        weights = {}
        for e in range(args.num_experts):
            name = f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc"
            weights[name + "1.weight_w"] = distribute_tensor(torch.ones(rows, h), mesh, [placement])
            weights[name + "1.weight_v"] = distribute_tensor(torch.ones(rows, h), mesh, [placement])
            weights[name + "2.weight"] = distribute_tensor(torch.ones(h, rows), mesh, [placement])
        return weights

    def save_dcp(name: str, weights: dict) -> None:
        dcp.save({"model": weights, "args": args}, checkpoint_id=os.path.join(out, name))

    good = _attempt(lambda: save_dcp("fsdp_good", model(f, Shard(0))))
    dist.barrier()
    damaged = _attempt(lambda: save_dcp("fsdp_damaged", model(f // 2, Replicate())))
    dist.barrier()
    return {"good": good, "damaged": damaged}


def _snapshot(root: str) -> dict[str, list[int]]:
    """(size, mtime_ns) of every file under root, to show a refused save changed nothing."""
    files = {}
    for directory, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(directory, name))
            files[os.path.relpath(os.path.join(directory, name), root)] = [st.st_size, st.st_mtime_ns]
    return files


def scenario_bench(out: str, repeats: int = 15) -> dict:
    """Saves etp1/ and etp2/ once, then the ETP=2 model repeatedly without and with the guard."""
    from megatron_patches import checkpoint_guard

    for name, layout in LAYOUTS.items():
        model, args = build_model(**layout)
        save(state_dict(model, args, 1), os.path.join(out, name), 1)
    model, args = build_model(**LAYOUTS["etp2"])
    unguarded = (checkpoint_guard.state_dict_utils.validate_sharding_integrity,
                 checkpoint_guard.serialization.save_preprocess)
    check_times: list[float] = []
    enforce = checkpoint_guard.enforce_complete_layout

    def timed_enforce(*a, **k):
        start = time.perf_counter()
        try:
            return enforce(*a, **k)
        finally:
            check_times.append(time.perf_counter() - start)

    checkpoint_guard.enforce_complete_layout = timed_enforce
    times: dict[str, list[float]] = {"without_guard": [], "with_guard": []}
    iteration = 1
    for _ in range(repeats):
        for mode in times:  # interleaved, so drift in machine load hits both alike
            if mode == "with_guard":
                checkpoint_guard.apply_save_guard()
            else:
                (checkpoint_guard.state_dict_utils.validate_sharding_integrity,
                 checkpoint_guard.serialization.save_preprocess) = unguarded
            iteration += 1
            times[mode].append(save(state_dict(model, args, iteration),
                                    os.path.join(out, "timed", mode), iteration))
    return {"times": times, "check_times": check_times}


SCENARIOS = {"make": scenario_make, "guards": scenario_guards, "bench": scenario_bench,
             "fsdp_guard": scenario_fsdp_guard}


def _rank_main(rank: int, scenario: str, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Before megatron is imported: the project's CPU backend stands in for CUDA.
    from megatron_patches import cpu_backend

    cpu_backend.activate()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = SCENARIOS[scenario](out)
    except Exception:
        result = {"crash": traceback.format_exc()}
    with open(os.path.join(out, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    mp.spawn(_rank_main, args=(scenario, out, _free_port()), nprocs=WORLD)


if __name__ == "__main__":
    main()
