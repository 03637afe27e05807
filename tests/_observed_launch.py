"""pretrain_moe.py with observers. Run under torchrun like pretrain_moe.py; each observer is on
when its environment variable names a directory:

* $SNAPSHOT_DIR: after megatron saves or loads a checkpoint, each rank writes a snapshot of its
  optimizer state (every torch optimizer state tensor and main parameter) to
  {save,load}_rank{R}.pt, and its CUDA RNG tracker states to rng_{save,load}_rank{R}.pt;
* $GRAD_DIR: after megatron finalizes an iteration's gradients (DP reduction included), each
  rank writes its routers' weight gradients (name -> main_grad) to grads_rank{R}.pt.
"""

import functools
import os
import sys

import torch

import pretrain_moe


def _optimizer_snapshot(optimizer) -> dict:
    snapshot = {}
    for index, chained in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = chained.optimizer
        for g, group in enumerate(inner.param_groups):
            for p, param in enumerate(group["params"]):
                key = f"{index}.{g}.{p}"
                snapshot[f"{key}.param"] = param.detach().clone()
                for name, value in inner.state[param].items():
                    snapshot[f"{key}.{name}"] = value.detach().clone()
    return snapshot


def _dump(kind: str, optimizer) -> None:
    from megatron.core import tensor_parallel

    directory, rank = os.environ["SNAPSHOT_DIR"], torch.distributed.get_rank()
    torch.save(_optimizer_snapshot(optimizer), os.path.join(directory, f"{kind}_rank{rank}.pt"))
    rng = {name: state.clone() for name, state
           in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    torch.save(rng, os.path.join(directory, f"rng_{kind}_rank{rank}.pt"))


def _observe_checkpoints(training) -> None:
    save, load = training.save_checkpoint, training.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(iteration, model, optimizer, *args, **kwargs):
        result = save(iteration, model, optimizer, *args, **kwargs)
        _dump("save", optimizer)
        return result

    @functools.wraps(load)
    def load_checkpoint(model, optimizer, *args, **kwargs):
        result = load(model, optimizer, *args, **kwargs)
        _dump("load", optimizer)
        return result

    training.save_checkpoint, training.load_checkpoint = save_checkpoint, load_checkpoint


def _observe_router_grads(training) -> None:
    finalize = training.finalize_model_grads

    @functools.wraps(finalize)
    def finalize_model_grads(model, *args, **kwargs):
        result = finalize(model, *args, **kwargs)
        grads = {name: param.main_grad.detach().clone()
                 for chunk in model for name, param in chunk.named_parameters()
                 if "router.weight" in name}
        path = os.path.join(os.environ["GRAD_DIR"], f"grads_rank{torch.distributed.get_rank()}.pt")
        torch.save(grads, path)
        return result

    training.finalize_model_grads = finalize_model_grads


if __name__ == "__main__":
    if not torch.cuda.is_available():
        from megatron_patches import cpu_backend

        cpu_backend.activate()
    from megatron.training import training

    if os.environ.get("SNAPSHOT_DIR"):
        _observe_checkpoints(training)
    if os.environ.get("GRAD_DIR"):
        _observe_router_grads(training)
    pretrain_moe.main(sys.argv[1:])
