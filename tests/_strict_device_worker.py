"""Which collectives refuse which tensors, one verdict line per case on rank 0, run under
torchrun: by test_strict_device_cpu.py on the CPU backend in strict device mode (2 ranks), and by
bench/gpu_check.py on a GPU with NCCL (1 rank), whose verdicts must be strict mode's."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moe_launcher import cpu_backend  # noqa: E402

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    cpu_backend.activate()

import torch.distributed as dist  # noqa: E402


def verdict(case: str, collective) -> None:
    try:
        collective()
        outcome = "passed"
    except RuntimeError as error:
        outcome = f"refused: {error}"
    if dist.get_rank() == 0:
        print(f"case {case}: {outcome}", flush=True)


def main() -> None:
    if ON_GPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if ON_GPU else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(list(range(world)), backend="gloo")
    default_backend = dist.new_group(list(range(world)))
    # At world size 1 the peer is the rank itself: NCCL sends to itself, gloo cannot (its
    # "Pair is not connected" is then gloo's verdict, not strict mode's).
    peer = (rank + 1) % world

    verdict("host all_reduce on default group", lambda: dist.all_reduce(torch.ones(2)))
    verdict("host tensor from .cpu() on default group",
            lambda: dist.all_reduce(torch.ones(2, device="cuda").cpu()))
    verdict("host-derived tensor on default group",
            lambda: dist.all_reduce(torch.tensor([1.0, 2.0]) * 2))
    verdict("host all_reduce on new_group without backend",
            lambda: dist.all_reduce(torch.ones(2), group=default_backend))
    verdict("host all_gather_into_tensor on default group",
            lambda: dist.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2)))
    verdict("host broadcast on default group", lambda: dist.broadcast(torch.ones(2), src=0))
    verdict("host batch_isend_irecv on default group", lambda: [
        w.wait() for w in dist.batch_isend_irecv([
            dist.P2POp(dist.isend, torch.ones(2), peer),
            dist.P2POp(dist.irecv, torch.empty(2), peer)])])
    verdict("device all_reduce on default group",
            lambda: dist.all_reduce(torch.ones(2, device="cuda")))
    verdict("host made device by .cuda() on default group",
            lambda: dist.all_reduce(torch.ones(2).cuda()))
    verdict("device all_gather (uneven bridge) on default group", lambda: dist.all_gather(
        [torch.empty(1 + r, device="cuda") for r in range(world)],
        torch.ones(1 + rank, device="cuda")))
    verdict("device reduce_scatter (bridge) on default group", lambda: dist.reduce_scatter(
        torch.empty(2, device="cuda"), [torch.ones(2, device="cuda") for _ in range(world)]))
    verdict("device batch_isend_irecv on default group", lambda: [
        w.wait() for w in dist.batch_isend_irecv([
            dist.P2POp(dist.isend, torch.ones(2, device="cuda"), peer),
            dist.P2POp(dist.irecv, torch.empty(2, device="cuda"), peer)])])
    verdict("host all_reduce on gloo group", lambda: dist.all_reduce(torch.ones(2), group=gloo))
    verdict("all_gather_object on default group",
            lambda: dist.all_gather_object([None] * world, {"rank": rank}))
    verdict("broadcast_object_list on default group",
            lambda: dist.broadcast_object_list([{"rank": rank}], src=0))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    assert ON_GPU or os.environ.get(cpu_backend.STRICT_DEVICE_ENV) == "1", (
        f"on the CPU backend the verdicts are strict mode's: set {cpu_backend.STRICT_DEVICE_ENV}=1")
    main()
