"""The checkpoint checks at 64..1,024 ranks, simulated on one process (issue 14).

    python bench/scale_sim.py [--sizes 64,128,256,512,1024] [--models deepseek-v3,mixtral-8x22b]

Per simulated rank it builds the ShardedTensors a megatron-core 0.19 torch_dist save of that
rank declares -- megatron's own `ShardedTensor.from_rank_offsets` (the factory its layers call)
on the real parameter shapes of each layer, partitioned as megatron partitions them (TP on the
column/row dim, experts over EP with an expert axis prepended and ETP on the same dims, layers
over PP, replicas over DP / expert-DP), plus the distributed optimizer's fully_reshardable
states (fp32 param, exp_avg, exp_avg_sq: param-shaped ShardedTensors) -- on meta tensors. Then:

* megatron's own check, `validate_sharding_integrity` (rank 0's work), on all ranks' metadata;
* the save guard at a structure's first save (every rank's work): the fingerprint of the rank's
  own part, then the tiling check (`checkpoint_guard.enforce_complete_layout`) on the same
  metadata; later saves of that structure cost the fingerprint only;
* on a real directory: a `.metadata` as torch writes it (every tensor's global shape and main-
  replica chunks, one storage entry per chunk), megatron's metadata.json and one (sparse)
  .distcp file per rank. Inside one load's `checkpoint_reads.reading_once`, as in a real load:
  the `.metadata` unpickle (megatron's own read, once per rank, which the checks reuse), the load
  guard of the rank with the most tensors (`checkpoint_load_guard.load_problems`) and the
  load-integrity file check (`file_checks.file_problems`, rank 0 only), counting their
  filesystem calls.

The ratio is (save guard + load guard + integrity) / megatron's check. Filesystem operations per
rank and in total are counted from that run and from the code paths (what each rank opens/stats
at load and fsyncs at commit). Peak memory is the process's peak resident size so far (sizes run
in increasing order, so it is that size's peak).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import json
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
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica  # noqa: E402
from megatron.core.dist_checkpointing.validation import validate_sharding_integrity  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from moe_launcher.checkpoint_files import commit_protocol, file_checks  # noqa: E402
from megatron_patches.checkpointing import checkpoint_completeness_guard as checkpoint_guard
from megatron_patches.checkpointing import checkpoint_load_guard
from moe_launcher.checkpoint_files import reads as checkpoint_reads


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


class _CountedListing:
    """A directory listing as os.scandir returns it (an iterator and a context manager)."""

    def __init__(self, entries: list):
        self.entries, self._next = entries, iter(entries)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._next)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def counting_commit_calls(counts: dict[str, int]):
    """Counts the commit's filesystem calls inside the block (measurement only): stats (a name
    looked up), fsyncs, and directory listings with the names they return."""
    real = {name: getattr(os, name) for name in ("stat", "fsync", "scandir")}

    def counted_scandir(*a, **k):
        with real["scandir"](*a, **k) as entries:
            listing = _CountedListing(list(entries))
        counts["listings"] += 1
        counts["names_listed"] += len(listing.entries)
        return listing

    def counter(name):
        def counted(*a, **k):
            counts[name] += 1
            return real[name](*a, **k)
        return counted

    os.stat, os.fsync, os.scandir = counter("stat"), counter("fsync"), counted_scandir
    try:
        yield counts
    finally:
        os.stat, os.fsync, os.scandir = real["stat"], real["fsync"], real["scandir"]


def write_checkpoint_dir(path: str, global_metadata, world: int) -> int:
    """A torch_dist directory as the load checks see it: a `.metadata` as torch writes it (each
    tensor's global shape and main-replica chunks; one storage entry per chunk, spread over one
    sparse .distcp file per rank) and megatron's metadata.json."""
    state, storage, ends = {}, {}, [0] * world
    by_key: dict[str, list] = {}
    for rank, shardings in enumerate(global_metadata):
        for sh in shardings:
            by_key.setdefault(sh.key, []).append((rank, sh))
    for key, ranked in by_key.items():
        chunks = []
        for rank, sh in ranked:
            if not is_main_replica(sh.replica_id):
                continue
            offsets, sizes = tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(
                sh.local_shape)
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            length = math.prod(sizes) * 2
            storage[MetadataIndex(key, offsets)] = _StorageInfo(f"__{rank}_0.distcp", ends[rank],
                                                                length)
            ends[rank] += length
        state[key] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                           torch.Size(ranked[0][1].global_shape), chunks)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=state, storage_data=storage), f)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    for rank, end in enumerate(ends):
        with open(os.path.join(path, f"__{rank}_0.distcp"), "wb") as f:
            f.truncate(end)
    return len(storage)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def simulate(model: Model, world: int) -> dict:
    global_metadata = [rank_shardings(model, world, r) for r in range(world)]
    shards = sum(map(len, global_metadata))
    busiest = max(range(world), key=lambda r: len(global_metadata[r]))
    megatron = timed(lambda: validate_sharding_integrity(global_metadata))
    # A structure's first save: the fingerprint of the rank's own part, then the tiling check.
    save_guard = timed(lambda: (checkpoint_guard._structure_fingerprint(global_metadata[busiest]),
                                checkpoint_guard.enforce_complete_layout(global_metadata)))
    later_save = timed(lambda: checkpoint_guard._structure_fingerprint(global_metadata[busiest]))
    with tempfile.TemporaryDirectory(prefix="scale_sim_") as directory:
        entries = write_checkpoint_dir(directory, global_metadata, world)
        with checkpoint_reads.reading_once() as reads:
            # megatron's own read of .metadata (once per rank); the checks reuse it.
            unpickle = timed(lambda: reads.metadata(directory))
            guard_ops, integrity_ops = {"open": 0, "stat": 0}, {"open": 0, "stat": 0}
            with counting_filesystem_calls(guard_ops):
                start = time.perf_counter()
                problems = checkpoint_load_guard.load_problems(global_metadata[busiest], directory)
                load_guard = time.perf_counter() - start
            with counting_filesystem_calls(integrity_ops):
                start = time.perf_counter()
                problems += file_checks.file_problems(directory)
                integrity = time.perf_counter() - start
        assert problems == [], problems[:3]
        # The commit: the last rank syncs its own files (every rank alike), then rank 0 the rest.
        own_ops, rank0_ops = ({"stat": 0, "fsync": 0, "listings": 0, "names_listed": 0}
                              for _ in range(2))
        with counting_commit_calls(own_ops):
            synced = [commit_protocol.fsync_own_files(directory, world - 1)]
        with counting_commit_calls(rank0_ops):
            commit_protocol._fsync_unowned(directory, [1] * (world - 1) + synced)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    files = world + 2  # one .distcp per rank, .metadata, metadata.json
    guard_ops, integrity_ops = sum(guard_ops.values()), sum(integrity_ops.values())
    # Per load: every rank the layout guard's reads, rank 0 also the file check. Before
    # (issue 14): every rank ran both checks, each reading .metadata and every rank stat-ing
    # every file.
    load_ops_total = integrity_ops + guard_ops * world
    before_total = world * (integrity_ops + 2 * files + 4)
    return {"model": model.name, "world": world, "layout": model.layout(world),
            "shards": shards, "chunks_saved": entries, "megatron_s": megatron,
            "save_guard_s": save_guard, "later_save_s": later_save, "unpickle_s": unpickle,
            "load_guard_s": load_guard, "integrity_s": integrity,
            "peak_mib": peak / 2**20, "guard_ops": guard_ops, "integrity_ops": integrity_ops,
            "load_ops_total": load_ops_total, "load_ops_total_before": before_total,
            "files": files, "commit_own_ops": own_ops, "commit_rank0_ops": rank0_ops}


def commit_ops(ops: dict[str, int]) -> str:
    return (f"{ops['stat']} stats + {ops['fsync']} fsyncs + {ops['listings']} listings of "
            f"{ops['names_listed']} names")


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
            ours = r["save_guard_s"] + r["load_guard_s"] + r["integrity_s"]
            layout = " ".join(f"{k}{v}" for k, v in r["layout"].items())
            print(f"{r['model']:14s} ranks {world:5d} {layout}: {r['shards']:8d} shards, "
                  f"{r['chunks_saved']:7d} saved chunks | megatron check {r['megatron_s']:7.2f} s"
                  f" ({r['megatron_s'] / r['shards'] * 1e6:.1f} us/shard) | save guard "
                  f"{r['save_guard_s']:6.2f} s ({r['save_guard_s'] / r['shards'] * 1e6:.1f} "
                  f"us/shard; later saves "
                  f"{r['later_save_s'] * 1e3:.1f} ms), load guard (1 rank) "
                  f"{r['load_guard_s']:5.2f} s, integrity (rank 0) {r['integrity_s']:5.2f} s = "
                  f"{ours / r['megatron_s']:.3f} of megatron's | .metadata unpickle "
                  f"{r['unpickle_s']:5.2f} s, once per rank, shared with megatron's load | "
                  f"peak {r['peak_mib']:7.0f} MiB | load FS ops: rank 0 "
                  f"{r['guard_ops'] + r['integrity_ops']}, others {r['guard_ops']}, total "
                  f"{r['load_ops_total']} (before: {r['load_ops_total_before']}) | commit FS "
                  f"ops: each rank {commit_ops(r['commit_own_ops'])}, rank 0 adds "
                  f"{commit_ops(r['commit_rank0_ops'])} (before: every rank listed "
                  f"{r['files']} names)", flush=True)
            if world == 1024 and name == "deepseek-v3":
                ratio = ours / r["megatron_s"]
    dist.destroy_process_group()
    if ratio is not None:
        print(f"guard / megatron check at 1024 ranks: {ratio:.3f}")


if __name__ == "__main__":
    main()
