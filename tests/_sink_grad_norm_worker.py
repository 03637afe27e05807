"""One rank of test_attention_sink_tensor_parallel_cpu's grad-norm test (CPU, gloo, 2 ranks).

Applies the patches as pretrain_moe.py does (MEGATRON_PATCHES_DISABLE honoured), builds a tiny
GPT with learnable attention sinks at TP2, gives every sink offset a gradient of ones and asks
megatron which of them its grad-norm clip counts (the optimizer's selection:
`param_is_not_shared` and `param_is_not_tensor_parallel_duplicate`), and the norm it computes
of them (`get_grad_norm_fp32` over the model-parallel group). The reference is the offsets'
global shape that megatron itself declares in the model's sharded_state_dict: with a gradient
of ones the norm is the square root of its element count. Rank 0 prints one line.
"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32  # noqa: E402
from megatron.core.transformer.module import param_is_not_shared  # noqa: E402

import _megatron_cpu as cpu  # noqa: E402
from _unpatched import apply_all  # noqa: E402

TP = 2


def main() -> None:
    apply_all()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = cpu.tiny_config(softmax_type="learnable", tensor_model_parallel_size=TP,
                             sequence_parallel=True)
    model = cpu.build_gpt(config, seq_length=16)
    offsets = [p for name, p in model.named_parameters() if name.endswith("softmax_offset")]
    for offset in offsets:
        offset.grad = torch.ones_like(offset)
    counted = [p.grad for p in offsets
               if param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)]
    norm = get_grad_norm_fp32(counted,
                              grad_stats_parallel_group=parallel_state.get_model_parallel_group())
    declared = {sh.key: math.prod(sh.global_shape)
                for sh in model.sharded_state_dict().values()
                if getattr(sh, "key", "").endswith("softmax_offset")}
    elements = sum(declared.values())
    if dist.get_rank() == 0:
        print(f"sink offsets: {len(offsets)} per rank, declared global elements {elements} "
              f"({declared}); megatron's grad norm of ones {norm:.6f}, squared {norm ** 2:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
