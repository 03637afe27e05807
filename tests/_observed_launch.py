"""pretrain_moe.py with observers: after megatron saves or loads a checkpoint, each rank writes
a snapshot of its optimizer state (every torch optimizer state tensor and main parameter) to
$SNAPSHOT_DIR/{save,load}_rank{R}.pt. Run under torchrun like pretrain_moe.py."""

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
    path = os.path.join(os.environ["SNAPSHOT_DIR"], f"{kind}_rank{torch.distributed.get_rank()}.pt")
    torch.save(_optimizer_snapshot(optimizer), path)


def _observe(training) -> None:
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


if __name__ == "__main__":
    if not torch.cuda.is_available():
        from megatron_patches import cpu_backend

        cpu_backend.activate()
    from megatron.training import training

    _observe(training)
    pretrain_moe.main(sys.argv[1:])
