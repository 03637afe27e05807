"""The checkpoint checks at 64..1,024 ranks, simulated on one process (issue 14).

    python bench/scale_sim.py [--sizes 64,128,256,512,1024] [--models deepseek-v3,mixtral-8x22b]

Per simulated rank it builds the ShardedTensors a megatron-core 0.19 torch_dist save of that
rank declares -- megatron's own `ShardedTensor.from_rank_offsets` (the factory its layers call)
on the real parameter shapes of each layer, partitioned as megatron partitions them (TP on the
column/row dim, experts over EP with an expert axis prepended and ETP on the same dims, layers
over PP, replicas over DP / expert-DP), plus the distributed optimizer's fully_reshardable
states (fp32 param, exp_avg, exp_avg_sq: param-shaped ShardedTensors) -- on meta tensors. Then:

* megatron's own check, `validate_sharding_integrity` (rank 0's work), on all ranks' metadata;
* the save guard's tiling check (`checkpoint_guard.enforce_complete_layout`, every rank's work)
  on the same metadata;
* the load guard of one rank (the rank with the most tensors) against a `.metadata` built from
  the main replicas (`checkpoint_guard.judge_against_saved`, as `load_problems` calls it);
* the load-integrity file check (`checkpoint_commit.file_problems`, rank 0 only) on a real
  directory: a `.metadata` with one storage entry per saved chunk and one (sparse) .distcp
  file per rank, counting its filesystem calls.

Filesystem operations per rank and in total are counted from that run and from the code paths
(what each rank opens/stats at load and fsyncs at commit). Peak memory is the process's peak
resident size so far (sizes run in increasing order, so it is that size's peak).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import math
import os
import pickle
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.validation import validate_sharding_integrity  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex  # noqa: E402

from megatron_patches import checkpoint_commit, checkpoint_guard  # noqa: E402
from megatron_patches.checkpoint_metadata import SavedTensor  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    split: int | None  # the dim TP (ETP for experts) partitions, None: replicated
    expert: bool = False


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int
    experts: int
    dense_layers: int  # the first layers with a dense MLP (DeepSeek-V3: 3)
    vocab: int
    hidden: int
    attention: tuple[Param, ...]
    dense_mlp: tuple[Param, ...]
    moe: tuple[Param, ...]  # router, shared experts, one expert's weights (expert=True)
    tp: int
    pp: int
    etp: int
    ep: int  # at most; fewer where the stage has fewer ranks

    def layout(self, world: int) -> dict[str, int]:
        stage = world // self.pp
        ep = min(self.ep, stage // self.etp)
        return {"PP": self.pp, "TP": self.tp, "DP": stage // self.tp, "ETP": self.etp, "EP": ep,
                "EDP": stage // (self.etp * ep)}


def deepseek_v3() -> Model:
    h, heads = 7168, 128
    attention = (
        Param("input_layernorm.weight", (h,), None),
        Param("self_attention.linear_q_down_proj.weight", (1536, h), None),
        Param("self_attention.linear_q_up_proj.layer_norm_weight", (1536,), None),
        Param("self_attention.linear_q_up_proj.weight", (heads * (128 + 64), 1536), 0),
        Param("self_attention.linear_kv_down_proj.weight", (512 + 64, h), None),
        Param("self_attention.linear_kv_up_proj.layer_norm_weight", (512,), None),
        Param("self_attention.linear_kv_up_proj.weight", (heads * (128 + 128), 512), 0),
        Param("self_attention.linear_proj.weight", (h, heads * 128), 1),
        Param("pre_mlp_layernorm.weight", (h,), None),
    )
    dense = (Param("mlp.linear_fc1.weight", (2 * 18432, h), 0),
             Param("mlp.linear_fc2.weight", (h, 18432), 1))
    moe = (Param("mlp.router.weight", (256, h), None),
           Param("mlp.router.expert_bias", (256,), None),
           Param("mlp.shared_experts.linear_fc1.weight", (2 * 2048, h), 0),
           Param("mlp.shared_experts.linear_fc2.weight", (h, 2048), 1),
           Param("mlp.experts.experts.linear_fc1.weight", (2 * 2048, h), 0, expert=True),
           Param("mlp.experts.experts.linear_fc2.weight", (h, 2048), 1, expert=True))
    return Model("deepseek-v3", 61, 256, 3, 129280, h, attention, dense, moe,
                 tp=2, pp=8, etp=2, ep=32)


def mixtral_8x22b() -> Model:
    h = 6144
    attention = (
        Param("self_attention.linear_qkv.layer_norm_weight", (h,), None),
        Param("self_attention.linear_qkv.weight", ((48 + 2 * 8) * 128, h), 0),
        Param("self_attention.linear_proj.weight", (h, 48 * 128), 1),
        Param("pre_mlp_layernorm.weight", (h,), None),
    )
    moe = (Param("mlp.router.weight", (8, h), None),
           Param("mlp.experts.experts.linear_fc1.weight", (2 * 16384, h), 0, expert=True),
           Param("mlp.experts.experts.linear_fc2.weight", (h, 16384), 1, expert=True))
    return Model("mixtral-8x22b", 56, 8, 0, 32768, h, attention, (), moe,
                 tp=2, pp=4, etp=2, ep=8)


MODELS = {m.name: m for m in (deepseek_v3(), mixtral_8x22b())}
_META: dict[tuple, torch.Tensor] = {}


def _meta(shape: tuple[int, ...]) -> torch.Tensor:
    if shape not in _META:
        _META[shape] = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    return _META[shape]


def _local(shape: tuple[int, ...], split: int | None, parts: int) -> tuple[int, ...]:
    return shape if split is None else tuple(
        n // parts if d == split else n for d, n in enumerate(shape))


def rank_shardings(model: Model, world: int, rank: int) -> list[ShardedTensor]:
    """The ShardedTensors rank `rank` declares in a torch_dist save (model + optimizer)."""
    lay = model.layout(world)
    per_stage = world // lay["PP"]
    pp, s = divmod(rank, per_stage)
    tp, dp = s % lay["TP"], s // lay["TP"]
    etp, ep, edp = s % lay["ETP"], (s // lay["ETP"]) % lay["EP"], s // (lay["ETP"] * lay["EP"])
    # Layers with different MLPs make megatron key each layer on its own (non-homogeneous
    # layers); a homogeneous stack shares one key per tensor with the layer axis prepended.
    per_layer_keys = model.dense_layers > 0
    stage_layers = range(pp * model.layers // lay["PP"], (pp + 1) * model.layers // lay["PP"])
    out = []

    def add(key, param, prepend, tp_rank, tp_size, replica):
        data = _meta(_local(param.shape, param.split, tp_size))
        split = [] if param.split is None else [(len(prepend) + param.split, tp_rank, tp_size)]
        for prefix in ("", "optimizer.state.fp32_param.", "optimizer.state.exp_avg.",
                       "optimizer.state.exp_avg_sq."):
            out.append(ShardedTensor.from_rank_offsets(
                prefix + key, data, *prepend, *split, replica_id=replica,
                prepend_axis_num=len(prepend)))

    def dense(key, param, prepend):
        replica = (0, 0 if param.split is not None else tp, dp)
        add(key, param, prepend, tp, lay["TP"], replica)

    for layer in stage_layers:
        stem = f"decoder.layers.{layer}." if per_layer_keys else "decoder.layers."
        prepend = [] if per_layer_keys else [(0, layer, model.layers)]
        mlp = model.dense_mlp if layer < model.dense_layers else model.moe
        for param in (*model.attention, *mlp):
            if not param.expert:
                dense(stem + param.name, param, prepend)
                continue
            local_experts = model.experts // lay["EP"]
            for i in range(local_experts):
                expert = ep * local_experts + i
                add(stem + param.name, param, [*prepend, (len(prepend), expert, model.experts)],
                    etp, lay["ETP"], (0, 0, edp))
    if pp == 0:
        dense("embedding.word_embeddings.weight", Param("", (model.vocab, model.hidden), 0), [])
    if pp == lay["PP"] - 1:
        dense("decoder.final_layernorm.weight", Param("", (model.hidden,), None), [])
        dense("output_layer.weight", Param("", (model.vocab, model.hidden), 0), [])
    return out


@contextlib.contextmanager
def counting_filesystem_calls(counts: dict[str, int]):
    """Counts open/stat calls made inside the block (measurement only)."""
    real_open, real_stat = builtins.open, os.stat

    def counted_open(*a, **k):
        counts["open"] += 1
        return real_open(*a, **k)

    def counted_stat(*a, **k):
        counts["stat"] += 1
        return real_stat(*a, **k)

    builtins.open, os.stat = counted_open, counted_stat
    try:
        yield counts
    finally:
        builtins.open, os.stat = real_open, real_stat


def write_checkpoint_dir(path: str, global_metadata, world: int) -> int:
    """A torch_dist directory as file_problems sees it: `.metadata` with one storage entry per
    saved (main replica) chunk, spread over one sparse .distcp file per rank."""
    storage, ends = {}, [0] * world
    for rank, shardings in enumerate(global_metadata):
        for sh in shardings:
            if sh.replica_id == 0 or all(r == 0 for r in sh.replica_id):
                length = math.prod(sh.local_shape) * 2
                storage[MetadataIndex(sh.key, sh.global_offset)] = _StorageInfo(
                    f"__{rank}_0.distcp", ends[rank], length)
                ends[rank] += length
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata={}, storage_data=storage), f)
    for rank, end in enumerate(ends):
        with open(os.path.join(path, f"__{rank}_0.distcp"), "wb") as f:
            f.truncate(end)
    return len(storage)


def saved_tensors(global_metadata) -> dict[str, SavedTensor]:
    by_key = {}
    for shardings in global_metadata:
        for sh in shardings:
            by_key.setdefault(sh.key, []).append(sh)
    return {key: SavedTensor(key, tuple(shs[0].global_shape), 2,
                             tuple(checkpoint_guard._main_replica_boxes(shs)))
            for key, shs in by_key.items()}


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def simulate(model: Model, world: int) -> dict:
    global_metadata = [rank_shardings(model, world, r) for r in range(world)]
    shards = sum(map(len, global_metadata))
    megatron = timed(lambda: validate_sharding_integrity(global_metadata))
    save_guard = timed(lambda: checkpoint_guard.enforce_complete_layout(global_metadata))
    saved = saved_tensors(global_metadata)
    busiest = max(range(world), key=lambda r: len(global_metadata[r]))
    layouts = ({**model.layout(world)}, {**model.layout(world)})

    load = timed(lambda: checkpoint_guard.judge_against_saved(
        global_metadata[busiest], saved, None, layouts))
    with tempfile.TemporaryDirectory(prefix="scale_sim_") as directory:
        entries = write_checkpoint_dir(directory, global_metadata, world)
        counts = {"open": 0, "stat": 0}
        with counting_filesystem_calls(counts):
            start = time.perf_counter()
            assert checkpoint_commit.file_problems(directory) == []
            integrity = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    files = world + 2  # one .distcp per rank, .metadata, metadata.json
    integrity_ops = counts["open"] + counts["stat"]
    # Per load: rank 0's file check (counted above), and on every rank the layout guard's
    # .metadata + metadata.json + saved-args reads (3). Per commit: each rank fsyncs its own
    # file (open+fsync), rank 0 the two shared ones and the directory.
    load_ops_total = integrity_ops + 3 * world
    before_total = world * (integrity_ops + 2 * files + 4)  # every rank: both checks, 2 reads
    return {"model": model.name, "world": world, "layout": model.layout(world),
            "shards": shards, "chunks_saved": entries, "megatron_s": megatron,
            "save_guard_s": save_guard, "load_guard_s": load, "integrity_s": integrity,
            "peak_mib": peak / 2**20, "integrity_ops_rank0": integrity_ops,
            "load_ops_per_rank": 3, "load_ops_total": load_ops_total,
            "load_ops_total_before": before_total, "commit_fsyncs_per_rank": 1,
            "commit_fsyncs_rank0": 4, "files": files}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,128,256,512,1024")
    parser.add_argument("--models", default=",".join(MODELS))
    options = parser.parse_args()
    # validate_sharding_integrity does its work on global rank 0: be that rank.
    store = tempfile.NamedTemporaryFile(prefix="scale_sim_store_")
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    ratio = None
    for name in options.models.split(","):
        for world in map(int, options.sizes.split(",")):
            r = simulate(MODELS[name], world)
            ours = r["save_guard_s"] + r["integrity_s"]
            layout = " ".join(f"{k}{v}" for k, v in r["layout"].items())
            print(f"{r['model']:14s} ranks {world:5d} {layout}: {r['shards']:8d} shards, "
                  f"{r['chunks_saved']:7d} saved chunks | megatron check {r['megatron_s']:7.2f} s"
                  f" | save guard {r['save_guard_s']:6.2f} s, load guard (1 rank) "
                  f"{r['load_guard_s']:5.2f} s, integrity (rank 0) {r['integrity_s']:5.2f} s = "
                  f"{ours / r['megatron_s']:.3f} of megatron's | peak {r['peak_mib']:7.0f} MiB | "
                  f"load FS ops: rank 0 {r['integrity_ops_rank0'] + 3}, others 3, total "
                  f"{r['load_ops_total']} (before: {r['load_ops_total_before']}); commit fsyncs: "
                  f"1 per rank + 4 on rank 0", flush=True)
            if world == 1024 and name == "deepseek-v3":
                ratio = ours / r["megatron_s"]
    dist.destroy_process_group()
    if ratio is not None:
        print(f"guard / megatron check at 1024 ranks: {ratio:.3f}")


if __name__ == "__main__":
    main()
