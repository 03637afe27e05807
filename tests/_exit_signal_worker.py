"""Run by test_exit_signal_cpu.py on 4 ranks: megatron's exit-signal check as the training loop
calls it (`any(handler.signals_received())`), with the patches applied as pretrain_moe.py
applies them (MEGATRON_PATCHES_DISABLE honoured). Rank 2 alone has received the signal. Each
rank prints one JSON line: what the check answered, and how many tensor values it copied to the
host (`.item()` / `.tolist()`: on a GPU each is a device sync), counted by a TorchFunctionMode."""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from megatron_patches import registry  # noqa: E402

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist}


class CountHostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in HOST_READS
        return func(*args, **(kwargs or {}))


def main() -> None:
    registry.load_patches()
    status = {s.name: s for s in registry.apply_patches(registry.current_context(True))}
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    dist.init_process_group("gloo")
    with DistributedSignalHandler(signal.SIGTERM) as handler:
        if dist.get_rank() == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler records it
        dist.barrier()
        with CountHostReads() as reads:
            received = any(handler.signals_received())
    print("exit-signal " + json.dumps({
        "rank": dist.get_rank(), "received": received, "host_reads": reads.count,
        "patch": status["exit-signal-one-sync"].line()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
