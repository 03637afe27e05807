"""cpu-initialization-to-device: megatron-core 0.19.2's model builder leaves a model made with
`--use-cpu-initialization` (the CPU backend's default, for layout-independent weights) on the
host; on a GPU the first forward fails on every rank.

The judge is the CPU backend's strict-device mode (the suite's default), which keeps each
tensor's placement on a GPU and refuses a host tensor in a collective NCCL would run: Muon's
tensor-parallel Newton-Schulz all-gathers the momentum of each sharded matrix, made like its
parameter (in fp32). Patched, the parameters are on the device and the run trains
(tests/moe_launcher/test_muon_cpu.py judges what it trains); without the patch every rank stops
at the first update, the tensor named a host tensor."""

from __future__ import annotations

from _launch import TINY_MODEL, launch

NAME = "cpu-initialization-to-device"
# fp32: Muon's momentum is then made from the model's own parameters
RUN = [*[arg for arg in TINY_MODEL if arg != "--bf16"], "--optimizer", "muon",
       "--train-iters", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel"]


def test_a_cpu_initialised_model_is_on_the_device():
    patched = launch(2, RUN).check()
    assert f"[megatron_patches] {NAME}: applied" in patched.log
    unpatched = launch(2, RUN, env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert f"[megatron_patches] {NAME}: skipped (disabled" in unpatched.log
    assert unpatched.exit_codes == [1, 1], unpatched.log[-3000:]
    assert ("torch.distributed.all_gather got a host tensor on a process group created without "
            "backend='gloo'") in unpatched.log, unpatched.log[-3000:]
