"""pretrain_moe.py with observers. Run under torchrun like pretrain_moe.py; each observer is on
when its environment variable names a directory:

* $SNAPSHOT_DIR: after megatron saves or loads a checkpoint, each rank writes a snapshot of its
  optimizer state (every torch optimizer state tensor and main parameter) to
  {save,load}_rank{R}.pt (a save's also to save<ITER>_rank{R}.pt; DTensors as this rank's
  local shard, so that a snapshot loads without a device mesh), the same state in model space
  (per model parameter name: the distributed optimizer's slice of it and where the slice lies) to
  model_{save<ITER>,load}_rank{R}.pt, and its CUDA RNG tracker states to
  rng_{save,save<ITER>,load}_rank{R}.pt;
* $GRAD_DIR: after megatron finalizes an iteration's gradients (DP reduction included), each
  rank writes the gradients its optimizer will step with (name -> tensor) to grads_rank{R}.pt:
  those of the parameters whose names match the regular expression $GRAD_NAMES (default: the
  routers' weights). Megatron-FSDP gives this rank's shard (its local part of the DTensor),
  and, to overwrite_rank{R}.json, each parameter's `overwrite_main_grad` flag as megatron's
  last gather left it (name -> true/false/null where the parameter has none);
* $MEMORY_DIR: after megatron's first training step (the optimizer states exist), each rank
  writes what it keeps of the model's weights, gradients, main weights and optimizer states to
  memory_rank{R}.json: {"weights": elements of the weights, "bytes": bytes of them all,
  "without_state": the optimizer's parameters it holds no state for (an empty shard gets no
  gradient, so its optimizer never makes state for it)}. A Megatron-FSDP model's are counted in
  its buffers (padding left out); a plain model's are its parameters and their `main_grad`s
  (megatron's gradient buffer, padding left out) and the main parameters the optimizer steps
  where they are not the model's own (mixed precision's fp32 copies or their shards); then, for
  both, every tensor of the optimizer's state but the step count;
* $FLOP_COUNT_FILE: before megatron's first training step, rank 0 runs one forward and backward
  of one micro-batch of random tokens through the model built (a causal mask, full S×S scores)
  under torch's FlopCounterMode, on the device it trains on, and writes
  {"device": ..., "flop_counter": FLOPs torch counted, "census": the FLOPs the layer census
  predicts for it (flops_from_layer_census, full attention)} to that file. The gradients it
  leaves are zeroed by the training step, which starts by zeroing the gradient buffers;
* $ROUTER_COUNT_DIR: at the first iteration's gradient finalization (before megatron's
  expert-bias update uses and zeroes them), each rank writes, per router, the dtype and values of
  its expert-bias token counter, the routing decisions its forwards made, counted here
  (routing_map summed, for forwards with gradients, as megatron counts), and the experts its
  routers chose (DeepSeek's loss-free balancing's count: each token's top-k by sigmoid score +
  expert bias, from the logits megatron's gating computed; no expert groups) and whether, in
  every such forward, the chosen tokens each expert kept were its first chosen ones (what
  `--moe-token-drop-policy position` documents), to router_counts_rank{R}.json;
* $CHUNK_DIR: around each call of megatron's `preprocess_fsdp_dtensor_state_dict` (an
  fsdp_dtensor save or load; the patches' wrappers of it outside this one), each rank counts the
  torch.distributed collectives the call runs, then, for every DTensor of the state dict it
  returns (megatron's sorted key order), compares the chunk and DCP write items the DTensor
  carries with those megatron's own `update_uneven_dtensor_chunk_metadata` gives it (the
  DTensor's hooks put back afterwards, so DCP writes with what the call attached), and writes
  chunks_call{N}_rank{R}.json: {"collectives": {name: calls}, "seconds": the call's wall time,
  "dtensors": n, "empty": empty local shards, "placements": the distinct (mesh shape,
  placements), "differ": keys that differ}; and around each Megatron-FSDP `ParamAndGradBuffer`
  built (wrapping the model), the same for the main weights it gives a chunk, to
  buffer{N}_rank{R}.json;
* $ACTIVATION_DIR: through megatron's first training step (every micro-batch's forward and
  backward, megatron's pipeline schedule included), each rank counts the bytes of the tensors
  autograd holds for the backward (under torch's saved-tensor hooks; each storage once, from
  when it is first saved until the last holder is gone), weights and the batch's s x s
  attention masks left out, and writes activation_rank{R}.json: {"peak": the most held at
  once, "planned": moe_launcher.activation_memory's figure for this pipeline rank on the local
  spec (its loss's logits in the activation dtype left out: autograd does not keep them),
  "parts": its RankActivations};
* $FSDP_BUCKET_DIR: through megatron's first training step, each rank counts the bytes of
  Megatron-FSDP's temporary buckets alive at once (gathered weights: its
  StorageResizeBasedBucketAllocator; unsharded gradients: the gradient buffers'
  TemporaryBucketAllocators), each from megatron's allocation of it to megatron's free, and
  writes fsdp_buckets_rank{R}.json: {"peak": the most bytes alive at once, "weights", "grads":
  the two kinds' bytes at that moment}.
"""

import collections
import dataclasses
import functools
import itertools
import json
import os
import re
import sys
import time

import torch

import pretrain_moe


def _local_copy(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor).detach().clone()  # a DTensor's local shard


def _optimizer_snapshot(optimizer) -> dict:
    snapshot = {}
    for index, chained in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = chained.optimizer
        for g, group in enumerate(inner.param_groups):
            for p, param in enumerate(group["params"]):
                key = f"{index}.{g}.{p}"
                snapshot[f"{key}.param"] = _local_copy(param)
                # .get: torch keeps state in a defaultdict, and an empty entry for a parameter
                # without state (an empty shard) would break the next save (KeyError exp_avg)
                for name, value in inner.state.get(param, {}).items():
                    snapshot[f"{key}.{name}"] = _local_copy(value)
    return snapshot


def _model_space_snapshot(model, optimizer) -> dict:
    """name -> the main param and optimizer state tensors this rank's distributed optimizer holds
    of that model parameter, the flat range [start, end) of the TP-local parameter they cover,
    and how the parameter is split over tensor parallelism (to reassemble it across layouts)."""
    from megatron.core import parallel_state as ps

    # Only the distributed optimizer holds slices; a plain mixed-precision optimizer has none.
    distributed = [chained for chained in getattr(optimizer, "chained_optimizers", [optimizer])
                   if hasattr(chained, "model_param_group_index_map")]
    snapshot = {}
    for chunk in model:
        for name, param in chunk.named_parameters():
            for chained in distributed:
                if param not in chained.model_param_group_index_map:
                    continue
                expert = not getattr(param, "allreduce", True)
                split = bool(getattr(param, "tensor_model_parallel", False))
                held = chained._get_model_param_range_map(param)["param"]
                state = chained._get_main_param_and_optimizer_states(param)
                snapshot[name] = {
                    "start": held.start, "end": held.end, "local_shape": tuple(param.shape),
                    "partition_dim": param.partition_dim if split else None,
                    "tp_rank": (ps.get_expert_tensor_parallel_rank() if expert
                                else ps.get_tensor_model_parallel_rank()),
                    "state": {key: value.detach().clone() for key, value in state.items()
                              if key != "step"}}
    return snapshot


def _dump(kind: str, model, optimizer, iteration: int | None = None) -> None:
    from megatron.core import tensor_parallel

    directory, rank = os.environ["SNAPSHOT_DIR"], torch.distributed.get_rank()
    model_kind = kind if iteration is None else f"{kind}{iteration}"
    snapshot = _optimizer_snapshot(optimizer)
    # {kind}_rank{R}.pt is the latest; a run that saves twice keeps the earlier save's too.
    for name in {kind, model_kind}:
        torch.save(snapshot, os.path.join(directory, f"{name}_rank{rank}.pt"))
    torch.save(_model_space_snapshot(model, optimizer),
               os.path.join(directory, f"model_{model_kind}_rank{rank}.pt"))
    rng = {name: state.clone() for name, state
           in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    for name in {kind, model_kind}:  # rng_save<ITER>_rank{R}.pt too
        torch.save(rng, os.path.join(directory, f"rng_{name}_rank{rank}.pt"))


def _observe_checkpoints(training) -> None:
    save, load = training.save_checkpoint, training.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(iteration, model, optimizer, *args, **kwargs):
        result = save(iteration, model, optimizer, *args, **kwargs)
        _dump("save", model, optimizer, iteration)
        return result

    @functools.wraps(load)
    def load_checkpoint(model, optimizer, *args, **kwargs):
        result = load(model, optimizer, *args, **kwargs)
        _dump("load", model, optimizer)
        return result

    training.save_checkpoint, training.load_checkpoint = save_checkpoint, load_checkpoint


def _reduced_grad(param) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    # After finish_grad_sync Megatron-FSDP's module parameters are DTensors whose `grad` is this
    # rank's reduced shard (None where the shard is empty); megatron's DDP keeps `main_grad`.
    if isinstance(param, DTensor):
        return param.grad.to_local() if param.grad is not None else torch.empty(0)
    return param.main_grad


def _observe_grads(training) -> None:
    finalize = training.finalize_model_grads
    names = re.compile(os.environ.get("GRAD_NAMES", r"router\.weight"))

    @functools.wraps(finalize)
    def finalize_model_grads(model, *args, **kwargs):
        result = finalize(model, *args, **kwargs)
        grads = {name: _reduced_grad(param).detach().clone()
                 for chunk in model for name, param in chunk.named_parameters()
                 if names.search(name)}
        rank = torch.distributed.get_rank()
        torch.save(grads, os.path.join(os.environ["GRAD_DIR"], f"grads_rank{rank}.pt"))
        flags = {name: getattr(param, "overwrite_main_grad", None)
                 for chunk in model for module in chunk.modules()
                 for param, name in getattr(module, "param_to_name", {}).items()}
        with open(os.path.join(os.environ["GRAD_DIR"], f"overwrite_rank{rank}.json"), "w") as f:
            json.dump(flags, f)
        return result

    training.finalize_model_grads = finalize_model_grads


def _plain_memory(model) -> tuple[int, int]:
    """(elements, bytes) of a plain model's weights and gradients."""
    params = [param for chunk in model for param in chunk.parameters()]
    weights = sum(param.numel() for param in params)
    nbytes = sum(param.numel() * param.element_size()
                 + param.main_grad.numel() * param.main_grad.element_size() for param in params)
    return weights, nbytes


def _memory(model, optimizer) -> dict:
    fsdp = hasattr(model[0].module, "param_and_grad_buffer")  # the MegatronFSDP module
    weights, nbytes = _fsdp_memory(model) if fsdp else _plain_memory(model)
    model_params = {id(param) for chunk in model for param in chunk.parameters()}
    without_state = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in chained.optimizer.param_groups:
            if not fsdp:  # (Megatron-FSDP's main weights are in its buffers, counted there)
                nbytes += sum(param.numel() * param.element_size() for param in group["params"]
                              if id(param) not in model_params)
            without_state += sum(not chained.optimizer.state.get(param)
                                 for param in group["params"])
        for state in chained.optimizer.state.values():
            for key, value in state.items():
                if key != "step" and torch.is_tensor(value):
                    local = getattr(value, "_local_tensor", value)
                    nbytes += local.numel() * local.element_size()
    return {"weights": weights, "bytes": nbytes, "without_state": without_state}


def _fsdp_memory(model) -> tuple[int, int]:
    """(elements, bytes) of what Megatron-FSDP keeps of the weights, gradients and main weights."""
    weights = nbytes = 0
    for chunk in model:
        groups = chunk.module.param_and_grad_buffer.parameter_groups  # the MegatronFSDP module
        for group in groups:
            buffers = (group.model_weight_buffer, group.main_weight_buffer, group.main_grad_buffer)
            for buffer in buffers:
                if buffer is None or buffer.data is None:
                    continue
                kept = sum(end - start for start, end in (
                    buffer.locate_item_in_global_item(item) for item in range(len(group.params))))
                nbytes += kept * buffer.data.element_size()
                if buffer is group.model_weight_buffer:
                    weights += kept
            if group.model_weight_buffer is None:  # no_shard: the weights are the parameters
                weights += sum(param.numel() for param in group.params)
                nbytes += sum(param.numel() * param.element_size() for param in group.params)
    return weights, nbytes


def _observe_memory(training) -> None:
    step = training.train_step

    @functools.wraps(step)
    def train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        result = step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        path = os.path.join(os.environ["MEMORY_DIR"],
                            f"memory_rank{torch.distributed.get_rank()}.json")
        if not os.path.exists(path):
            with open(path, "w") as out:
                json.dump(_memory(model, optimizer), out)
        return result

    training.train_step = train_step


def _micro_batch_flops(model) -> dict:
    """FlopCounterMode's count and the census prediction for one forward+backward of one
    micro-batch (tests/_megatron_cpu.py measured_flops, on the model megatron built)."""
    from megatron.training import get_args
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_patches import registry
    from megatron_patches.accounting import flops_from_layer_census as flops

    args = get_args()
    batch, seq = args.micro_batch_size, args.seq_length
    device = torch.cuda.current_device()
    ids = torch.randint(0, args.padded_vocab_size, (batch, seq), device=device)
    positions = torch.arange(seq, device=device).expand(batch, -1)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]
    with FlopCounterMode(display=False) as counter:
        loss = model[0](ids, positions, causal, labels=ids,
                        loss_mask=torch.ones(batch, seq, device=device))
        loss.sum().backward()
    built = registry.record_of("layer-census").built
    shape = flops.ModelShape.from_config(built.config, args.padded_vocab_size, batch, seq)
    predicted = flops.flops_per_batch(shape, built.layers, batch * seq, batch * seq ** 2,
                                      causal_fraction=1.0)
    return {"device": str(ids.device), "flop_counter": counter.get_total_flops(),
            "census": predicted}


def _observe_flops(training) -> None:
    step = training.train_step

    @functools.wraps(step)
    def train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        path = os.environ["FLOP_COUNT_FILE"]
        if torch.distributed.get_rank() == 0 and not os.path.exists(path):
            with open(path, "w") as out:
                json.dump(_micro_batch_flops(model), out)
        return step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)

    training.train_step = train_step


def _observe_router_counts(training) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    forward, gating = TopKRouter.forward, TopKRouter.gating
    finalize = training.finalize_model_grads

    @functools.wraps(gating)
    def counted_gating(self, *args, **kwargs):
        logits = gating(self, *args, **kwargs)
        if torch.is_grad_enabled() and self.expert_bias is not None:
            scores = torch.sigmoid(logits.detach().float()).reshape(-1, logits.shape[-1])
            top = torch.topk(scores + self.expert_bias, self.topk, dim=-1).indices
            self.observed_chosen = getattr(self, "observed_chosen", 0) + \
                torch.bincount(top.flatten(), minlength=logits.shape[-1])
            self.last_chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
        return logits

    @functools.wraps(forward)
    def counted_forward(self, *args, **kwargs):
        probs, routing_map = forward(self, *args, **kwargs)
        if torch.is_grad_enabled():
            self.observed_routed = getattr(self, "observed_routed", 0) + \
                routing_map.sum(dim=0).to(torch.int64)
            if getattr(self, "last_chosen", None) is not None:
                chosen = self.last_chosen
                kept = routing_map.bool() & chosen  # (a padded map holds padding too)
                first = chosen & (chosen.to(torch.int64).cumsum(dim=0) <= kept.sum(dim=0))
                self.kept_first_chosen = getattr(self, "kept_first_chosen", True) and \
                    torch.equal(kept, first)
        return probs, routing_map

    @functools.wraps(finalize)
    def finalize_model_grads(model, *args, **kwargs):
        path = os.path.join(os.environ["ROUTER_COUNT_DIR"],
                            f"router_counts_rank{torch.distributed.get_rank()}.json")
        if not os.path.exists(path):
            routers = [module for chunk in model for module in chunk.modules()
                       if isinstance(module, TopKRouter)]
            with open(path, "w") as f:
                json.dump([{"dtype": str(router.local_tokens_per_expert.dtype),
                            "counts": router.local_tokens_per_expert.tolist(),
                            "routed": router.observed_routed.tolist(),
                            "chosen": getattr(router, "observed_chosen", torch.zeros(0)).tolist(),
                            "kept_first_chosen": getattr(router, "kept_first_chosen", None)}
                           for router in routers], f)
        return finalize(model, *args, **kwargs)

    TopKRouter.forward, TopKRouter.gating = counted_forward, counted_gating
    training.finalize_model_grads = finalize_model_grads


COUNTED_COLLECTIVES = ("all_gather_object", "all_gather", "all_gather_into_tensor", "all_reduce",
                       "broadcast", "broadcast_object_list", "reduce_scatter_tensor")


def _megatron_chunk(dtensor, key: str):
    """(chunk list, write items) of megatron's own hooks for `dtensor`; its hooks as they were
    are put back."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor

    local = dtensor._local_tensor
    attached = {name: getattr(local, name) for name in
                ("__create_chunk_list__", "__create_write_items__") if hasattr(local, name)}
    uneven_dtensor.update_uneven_dtensor_chunk_metadata(dtensor)
    megatron = (local.__create_chunk_list__(), local.__create_write_items__(key, dtensor))
    for name, hook in attached.items():
        setattr(local, name, hook)
    return megatron


def _counted_call(function, *args, **kwargs):
    """function(*args, **kwargs), and {collective: calls} of the torch.distributed collectives
    it ran, and its wall time."""
    counts, dist = collections.Counter(), torch.distributed
    originals = {name: getattr(dist, name) for name in COUNTED_COLLECTIVES}

    def counted(name):
        def collective(*a, **k):
            counts[name] += 1
            return originals[name](*a, **k)
        return collective

    for name in COUNTED_COLLECTIVES:
        setattr(dist, name, counted(name))
    started = time.perf_counter()
    try:
        result = function(*args, **kwargs)
    finally:
        seconds = time.perf_counter() - started
        for name, original in originals.items():
            setattr(dist, name, original)
    return result, counts, seconds


def _chunk_report(path: str, counts, seconds: float, dtensors: dict) -> None:
    """Writes the chunk observer's record of `dtensors` (key -> DTensor, in megatron's order)."""
    differ, empty, placements = [], 0, set()
    for key, dtensor in dtensors.items():
        local = dtensor._local_tensor
        carried = (local.__create_chunk_list__(), local.__create_write_items__(key, dtensor))
        if repr(carried) != repr(_megatron_chunk(dtensor, key)):
            differ.append(key)
        empty += local.numel() == 0
        placements.add(f"{tuple(dtensor.device_mesh.shape)} {dtensor.placements}")
    with open(path, "w") as f:
        json.dump({"collectives": counts, "seconds": seconds, "dtensors": len(dtensors),
                   "empty": empty, "placements": sorted(placements), "differ": differ}, f)


def _observe_chunks(checkpointing) -> None:
    from torch.distributed.tensor import DTensor

    from megatron.core.distributed.fsdp.src.megatron_fsdp import (
        param_and_grad_buffer,
        uneven_dtensor,
    )

    preprocess, calls = checkpointing.preprocess_fsdp_dtensor_state_dict, itertools.count()
    buffer_init, buffers = param_and_grad_buffer.ParamAndGradBuffer.__init__, itertools.count()
    directory = os.environ["CHUNK_DIR"]

    @functools.wraps(preprocess)
    def preprocess_fsdp_dtensor_state_dict(*args, **kwargs):
        state_dict, counts, seconds = _counted_call(preprocess, *args, **kwargs)
        chains = sorted(uneven_dtensor.filter_unflattened_state_dict(
            state_dict, visit_condition=lambda value: isinstance(value, DTensor)))
        rank = torch.distributed.get_rank()
        _chunk_report(os.path.join(directory, f"chunks_call{next(calls)}_rank{rank}.json"),
                      counts, seconds,
                      {"/".join(map(str, chain)): uneven_dtensor.get_unflattened_state_dict(
                          state_dict, chain) for chain in chains})
        return state_dict

    @functools.wraps(buffer_init)
    def init(self, *args, **kwargs):
        _, counts, seconds = _counted_call(buffer_init, self, *args, **kwargs)
        rank = torch.distributed.get_rank()
        # The main weights megatron gives a chunk (the sharded strategies' DTensors).
        given = {name: t for name, t in self.dist_main_weight.items()
                 if hasattr(t._local_tensor, "__create_chunk_list__")}
        _chunk_report(os.path.join(directory, f"buffer{next(buffers)}_rank{rank}.json"),
                      counts, seconds, given)

    checkpointing.preprocess_fsdp_dtensor_state_dict = preprocess_fsdp_dtensor_state_dict
    param_and_grad_buffer.ParamAndGradBuffer.__init__ = init


class _HeldForBackward:
    """The bytes of the tensors autograd holds for the backward, live and at most."""

    def __init__(self, left_out: set[int], mask_shape: tuple[int, int]):
        self.left_out, self.mask_shape = left_out, mask_shape
        self.holders: collections.Counter = collections.Counter()
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.left_out or (tensor.dtype == torch.bool
                                    and tuple(tensor.shape[-2:]) == self.mask_shape):
            return tensor
        return _Holder(self, tensor, key, storage.nbytes())

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Holder) else held


class _Holder:
    """One tensor autograd saved, counted until autograd lets it go."""

    def __init__(self, count: _HeldForBackward, tensor: torch.Tensor, key: int, nbytes: int):
        self.count, self.tensor, self.key = count, tensor, key
        if not count.holders[key]:
            count.sizes[key] = nbytes
            count.live += nbytes
            count.peak = max(count.peak, count.live)
        count.holders[key] += 1

    def __del__(self):
        count = self.count
        count.holders[self.key] -= 1
        if not count.holders[self.key]:
            del count.holders[self.key]
            count.live -= count.sizes.pop(self.key)


def _observe_activations(training) -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args

    from moe_launcher import activation_memory
    from moe_launcher.preflight import moe_pattern

    step = training.train_step

    @functools.wraps(step)
    def train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        path = os.path.join(os.environ["ACTIVATION_DIR"],
                            f"activation_rank{torch.distributed.get_rank()}.json")
        if os.path.exists(path):
            return step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        run = get_args()
        weights = {p.untyped_storage().data_ptr() for chunk in model for p in chunk.parameters()}
        count = _HeldForBackward(weights, (run.seq_length, run.seq_length))
        with torch.autograd.graph.saved_tensors_hooks(count.pack, count.unpack):
            result = step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        config = get_attr_wrapped_model(model[0], "config")
        ranks = activation_memory.rank_activations(run, config, moe_pattern(run),
                                                   run.padded_vocab_size,
                                                   get_num_microbatches(), "local")
        mine = ranks[parallel_state.get_pipeline_model_parallel_rank()]
        with open(path, "w") as out:
            json.dump({"peak": count.peak,
                       "planned": mine.saved,
                       "parts": dataclasses.asdict(mine)}, out)
        return result

    training.train_step = train_step


class _LiveBuckets:
    """Megatron-FSDP's temporary buckets alive now (allocator, bucket id) -> (bytes, kind), and
    the most bytes alive at once with each kind's share then."""

    def __init__(self):
        self.live, self.peak, self.at_peak = {}, 0, {"weights": 0, "grads": 0}
        self.counting = False  # whether the peak is being measured

    def allocated(self, allocator, bucket_id, nbytes: int, kind: str) -> None:
        self.live[(id(allocator), bucket_id)] = (nbytes, kind)
        total = sum(n for n, _ in self.live.values())
        if self.counting and total > self.peak:
            self.peak, self.at_peak = total, {"weights": 0, "grads": 0}
            for n, k in self.live.values():
                self.at_peak[k] += n

    def freed(self, allocator, bucket_id) -> None:
        self.live.pop((id(allocator), bucket_id), None)


def _observe_fsdp_buckets(training) -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer

    live = _LiveBuckets()
    # (the weights' allocator is the StorageResizeBased subclass; each gradient buffer has its
    # own plain TemporaryBucketAllocator)
    for cls, kind in ((param_and_grad_buffer.TemporaryBucketAllocator, "grads"),
                      (param_and_grad_buffer.StorageResizeBasedBucketAllocator, "weights")):
        def allocate(self, bucket_id, size, dtype, *args, own=cls.allocate, kind=kind, **kwargs):
            bucket = own(self, bucket_id, size, dtype, *args, **kwargs)
            live.allocated(self, bucket_id, size * dtype.itemsize, kind)
            return bucket

        def free(self, bucket_id, own=cls.free):
            own(self, bucket_id)
            live.freed(self, bucket_id)

        cls.allocate, cls.free = allocate, free

    step = training.train_step

    @functools.wraps(step)
    def train_step(*args, **kwargs):
        path = os.path.join(os.environ["FSDP_BUCKET_DIR"],
                            f"fsdp_buckets_rank{torch.distributed.get_rank()}.json")
        if os.path.exists(path):
            return step(*args, **kwargs)
        live.counting = True
        result = step(*args, **kwargs)
        live.counting = False
        with open(path, "w") as out:
            json.dump({"peak": live.peak, **live.at_peak}, out)
        return result

    training.train_step = train_step


if __name__ == "__main__":
    if not torch.cuda.is_available():
        from moe_launcher import cpu_backend

        cpu_backend.activate()
    from megatron.training import training

    if os.environ.get("SNAPSHOT_DIR"):
        _observe_checkpoints(training)
    if os.environ.get("GRAD_DIR"):
        _observe_grads(training)
    if os.environ.get("MEMORY_DIR"):
        _observe_memory(training)
    if os.environ.get("FLOP_COUNT_FILE"):
        _observe_flops(training)
    if os.environ.get("ROUTER_COUNT_DIR"):
        _observe_router_counts(training)
    if os.environ.get("ACTIVATION_DIR"):
        _observe_activations(training)
    if os.environ.get("FSDP_BUCKET_DIR"):
        _observe_fsdp_buckets(training)
    if os.environ.get("CHUNK_DIR"):
        from megatron.training import checkpointing

        _observe_chunks(checkpointing)
    pretrain_moe.main(sys.argv[1:])
