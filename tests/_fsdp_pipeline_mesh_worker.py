"""megatron-core's own Megatron-FSDP device mesh at pipeline parallel size 2, on 2 gloo ranks
(test_preflight.py only): what the megatron-fsdp-pipeline-parallel check refuses, shown on
megatron's function (mcore_fsdp_adapter._get_dp_tp_mesh, which its adapter calls when it wraps
the model). Each rank prints one line: "mesh: <ranks>" or "mesh failed: <error>"."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed.fsdp import mcore_fsdp_adapter  # noqa: E402

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
try:
    mesh = mcore_fsdp_adapter._get_dp_tp_mesh(
        parallel_state.get_data_parallel_group(with_context_parallel=True),
        parallel_state.get_tensor_model_parallel_group())
    print(f"rank {dist.get_rank()} mesh: {mesh.tolist()}", flush=True)
except Exception as error:  # noqa: BLE001 - the failure is what is reported
    first = " ".join(str(error).split())
    print(f"rank {dist.get_rank()} mesh failed: {type(error).__name__}: {first}", flush=True)
dist.barrier()  # no rank tears its gloo pairs down while the other still uses them
dist.destroy_process_group()
