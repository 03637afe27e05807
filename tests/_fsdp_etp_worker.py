"""One rank of the #1836 reproduction (megatron-core 0.15.x, CPU, gloo); run under torchrun.

    python -m torch.distributed.run --nproc-per-node=2 tests/_fsdp_etp_worker.py CKPT_DIR OUT_JSON

Builds a tiny MoE GPT (local spec, TP=1, ETP=2, EP=1), wraps it in megatron-core's own
Megatron-FSDP (`FullyShardedDataParallel`), saves it the way `--ckpt-format fsdp_dtensor` does
(torch.distributed.checkpoint of the module's DTensor state dict) into real files, then builds a
second model from another seed, loads the checkpoint into it and compares, per rank, every expert
weight's local ETP slice with the one that rank saved. Megatron patches are applied through the
registry, so MEGATRON_PATCHES_DISABLE=fsdp-expert-etp-sharding reproduces the bug.
Writes OUT_JSON (rank 0): the checkpoint's metadata for the expert weights and every rank's
comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from megatron_patches import registry  # noqa: E402

ETP = int(os.environ.get("ETP", "2"))
STRATEGY = os.environ.get("FSDP_STRATEGY", "no_shard")


def build(seed: int):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
        add_bias_linear=False, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
        moe_token_dispatcher_type="alltoall", expert_tensor_parallel_size=ETP,
        expert_model_parallel_size=1, tensor_model_parallel_size=1,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4),
                     vocab_size=64, max_sequence_length=16)
    # Each rank's own ETP slice of every expert weight, before Megatron-FSDP takes the model.
    slices = {name: p.detach().clone() for name, p in model.named_parameters() if ".experts." in name}
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=STRATEGY,
        overlap_grad_reduce=STRATEGY != "no_shard", overlap_param_gather=STRATEGY != "no_shard",
    )
    return FullyShardedDataParallel(config, ddp_config, model), slices


def expert_dtensors(fsdp_model) -> dict[str, DTensor]:
    return {k: v for k, v in fsdp_model.state_dict().items()
            if ".experts." in k and k.endswith("weight")}


def main(ckpt_dir: str, out_json: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_tensor_parallel_size=ETP,
        expert_model_parallel_size=1)
    import megatron_patches.fsdp.fsdp_expert_etp_sharding  # noqa: F401  (registers the patch)

    statuses = registry.apply_patches(registry.current_context(cpu_backend=True))
    patch_line = next(s.line() for s in statuses if s.name == "fsdp-expert-etp-sharding") \
        if any(s.name == "fsdp-expert-etp-sharding" for s in statuses) else "not registered"

    saved_model, saved_slices = build(seed=1)
    saved = expert_dtensors(saved_model)
    # The training args go with the weights, as megatron.training saves them, so the audit can
    # compare the saved shapes with the ones the model implies.
    args = argparse.Namespace(
        hidden_size=16, num_attention_heads=2, num_experts=4, moe_ffn_hidden_size=32,
        ffn_hidden_size=64, swiglu=False, expert_tensor_parallel_size=ETP, padded_vocab_size=64)
    if os.environ.get("SAVE_GUARD"):
        # The completeness guard checks the DTensors' global shapes against the parameters
        # before anything is written. megatron-core 0.15 has no megatron.training save call
        # site to hook, so this core-only save calls the guard where it builds its state dict.
        from megatron_patches.checkpointing import checkpoint_completeness_guard as checkpoint_guard

        try:
            checkpoint_guard.refuse_wrong_model_shapes({"model": saved}, [saved_model])
            dcp.save({"model": saved, "args": args}, checkpoint_id=ckpt_dir)
        except checkpoint_guard.IncompleteCheckpointError as refusal:
            with open(f"{out_json}.rank{rank}", "w") as out:
                json.dump({"patch": patch_line, "refused": str(refusal)}, out)
            return
    dcp.save({"model": saved, "args": args}, checkpoint_id=ckpt_dir)
    dist.barrier()
    # What every ETP rank saved, to tell whose slice a rank holds after the reload.
    from megatron.core import parallel_state as ps
    etp_group = ps.get_expert_tensor_parallel_group()
    etp_saved = {}
    for key, t in saved.items():
        local = t.to_local().detach().contiguous()
        etp_saved[key] = [torch.empty_like(local) for _ in range(dist.get_world_size(etp_group))]
        dist.all_gather(etp_saved[key], local, group=etp_group)

    loaded_model, _ = build(seed=2)
    target = expert_dtensors(loaded_model)
    fresh = {key: t.to_local().detach().clone() for key, t in target.items()}
    dcp.load({"model": target}, checkpoint_id=ckpt_dir)

    rows = {}
    for key, dtensor in target.items():
        raw_name = key.removeprefix("module.").removeprefix("module.")
        got, want = dtensor.to_local(), saved[key].to_local()
        rows[key] = {
            "etp_slice_shape": list(saved_slices[raw_name].shape),
            "dtensor_global_shape": list(dtensor.shape),
            "placements": [str(p) for p in dtensor.placements],
            "mesh": dtensor.device_mesh.mesh.tolist(),
            # What this rank holds after the reload is exactly what it held when it saved.
            "reload_bit_exact": bool(torch.equal(got, want)),
            # Whose saved slice it holds: the #1836 symptom is another ETP rank's.
            "reloaded_from_etp_ranks": [i for i, s in enumerate(etp_saved[key])
                                        if torch.equal(got, s)],
            "changed_by_load": not torch.equal(got, fresh[key]),
        }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "etp_rank":
                                      parallel_state.get_expert_tensor_parallel_rank(),
                                      "rows": rows})
    if rank == 0:
        metadata = dcp.FileSystemReader(ckpt_dir).read_metadata()
        saved_meta = {}
        for key, meta in metadata.state_dict_metadata.items():
            if ".experts." not in key or not key.endswith("weight"):
                continue
            elem = torch.tensor([], dtype=meta.properties.dtype).element_size()
            logical = sum(int(torch.Size(c.sizes).numel()) * elem for c in meta.chunks)
            file_bytes = sum(info.length for index, info in metadata.storage_data.items()
                             if index.fqn == key)
            saved_meta[key] = {"global_shape": list(meta.size), "bytes": logical,
                               "file_bytes": file_bytes, "chunks": len(meta.chunks)}
        Path(out_json).write_text(json.dumps(
            {"patch": patch_line, "strategy": STRATEGY, "etp": ETP,
             "saved": saved_meta, "ranks": gathered}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
