"""One rank of test_qk_clip_cpu (CPU, gloo, 2 data-parallel ranks).

Applies the patches as pretrain_moe.py does (MEGATRON_PATCHES_DISABLE honoured), builds a tiny
bf16 GPT (multi-latent attention with argv[1] == "mla", else GQA; "mla-mtp": MLA and a
multi-token-prediction layer, DeepSeek-V3's) with megatron's QK-clip on,
wraps it as megatron's training does (Float16Module, DDP) and makes, for argv[2] == "adam",
megatron's distributed optimizer, which keeps each weight's fp32 master as a flat shard of
each rank's range, or for "muon" what `--optimizer muon --use-distributed-optimizer` makes
(MuonClip's optimizer: the layer-wise distributed optimizer, each weight's whole fp32 master on
one rank), or for "fsdp" megatron's Megatron-FSDP (optim_grads_params, the FSDP recipes')
with the distributed optimizer. It then sets each
layer's largest attention logits (what Transformer Engine's attention reports; the local spec
reports none) with some heads past --qk-clip-threshold and calls `clip_qk` as megatron's
train_step does after the optimizer step (its module's name, which the patches may replace).
Rank 0 prints the largest logit clip_qk returns (what megatron logs) and, per clipped weight,
the largest
difference between the whole fp32 master after the clip (the ranks' shards summed) and the
reference: the master before it scaled as the Kimi K2 report's QK-clip scales it (eta =
threshold / max logit for each head past the threshold, or query group for GQA, 1 for the
others; query rows by eta^alpha, MLA's rope query rows by eta, key rows by eta^(1 - alpha),
values and the shared rope key untouched). With argv[3] == "negative", a head (MLA) or a query
group (GQA) of the layer that clips has a negative largest logit.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel, DistributedDataParallelConfig)
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import (  # noqa: E402
    FullyShardedDataParallel)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.training import training  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

import _megatron_cpu as cpu  # noqa: E402
from _unpatched import apply_all  # noqa: E402

THRESHOLD, ALPHA = 3.0, 0.4
HEADS = 4
MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=12)
GQA = dict(num_query_groups=2, kv_channels=16)


def whole_masters(model, optimizer) -> dict[str, torch.Tensor]:
    """Each clipped weight's fp32 master as a whole: the shards the ranks own, summed over the
    data-parallel group (zeros elsewhere). Read through megatron's optimizer, not the patch."""
    masters = {}
    for name, param in model.named_parameters():
        if not name.endswith(("linear_q_up_proj.weight", "linear_kv_up_proj.weight",
                              "linear_qkv.weight")):
            continue
        whole = torch.zeros(param.numel(), dtype=torch.float32, device=torch.cuda.current_device())
        master = getattr(param, "main_param", None)
        if master is not None and master.shape == param.shape:  # the layer-wise optimizer's
            whole += master.view(-1)
        elif master is not None:  # a distributed-optimizer shard
            (owner,) = [opt for opt in optimizer.chained_optimizers
                        if param in opt.model_param_gbuf_map]
            start = owner._get_model_param_range_map(param)["param"].start
            whole[start:start + master.numel()] = master
        dist.all_reduce(whole)
        masters[name] = whole.view(param.shape)
    return masters


def _eta(logits: torch.Tensor) -> torch.Tensor:
    """The report's scale: only the heads (groups) past the threshold are clipped."""
    return torch.where(logits > THRESHOLD, THRESHOLD / logits, torch.ones_like(logits))


def reference(name: str, master: torch.Tensor, logits: torch.Tensor, config) -> torch.Tensor:
    """QK-clip's scaling of one weight, per the Kimi K2 report, row block by row block."""
    scaled = master.clone()
    if config.multi_latent_attention:
        eta = _eta(logits)
        nope, rope, value = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        if "linear_q_up_proj" in name:  # per head: [nope query | rope query]
            rows = scaled.view(HEADS, nope + rope, -1)
            rows[:, :nope] *= eta.pow(ALPHA).view(HEADS, 1, 1)
            rows[:, nope:] *= eta.view(HEADS, 1, 1)
        else:  # linear_kv_up_proj, per head: [nope key | value]
            rows = scaled.view(HEADS, nope + value, -1)
            rows[:, :nope] *= eta.pow(1 - ALPHA).view(HEADS, 1, 1)
        return scaled
    groups, dim = config.num_query_groups, config.kv_channels
    eta = _eta(logits.view(groups, -1).max(dim=1).values)
    per_group = HEADS // groups
    rows = scaled.view(groups, (per_group + 2) * dim, -1)  # per group: [its queries | k | v]
    rows[:, :per_group * dim] *= eta.pow(ALPHA).view(groups, 1, 1)
    rows[:, per_group * dim:(per_group + 1) * dim] *= eta.pow(1 - ALPHA).view(groups, 1, 1)
    return scaled


def main(attention: str, optimizer_name: str, logits_sign: str = "positive") -> None:
    apply_all()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = cpu.tiny_config(**(MLA if attention.startswith("mla") else GQA),
                             mtp_num_layers=1 if attention == "mla-mtp" else None,
                             num_attention_heads=HEADS, qk_clip=True,
                             qk_clip_threshold=THRESHOLD, qk_clip_alpha=ALPHA,
                             bf16=True, params_dtype=torch.bfloat16)
    # (megatron's argument checks turn --optimizer muon --use-distributed-optimizer into the
    # layer-wise optimizer over a DDP without the distributed optimizer's buffers)
    sharded = optimizer_name in ("adam", "fsdp")
    if optimizer_name == "fsdp":
        model = FullyShardedDataParallel(config, DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
            use_distributed_optimizer=True, grad_reduce_in_fp32=True),
            cpu.build_gpt(config, seq_length=16))
        optimizer_name = "adam"
    else:
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=sharded,
                                                  grad_reduce_in_fp32=True),
            Float16Module(config, cpu.build_gpt(config, seq_length=16)))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer=optimizer_name, lr=1e-3, bf16=True,
                        use_distributed_optimizer=sharded,
                        use_layer_wise_distributed_optimizer=not sharded),
        [model])
    # decoder layer 0: heads 0 and 2 past the threshold (with "negative", head 1's logits, or
    # GQA's second group's, all negative); layer 1: none (left as it is); the MTP layer's
    # attention: heads 1 and 3
    first = ([12.0, -0.5, 4.0, 1.5] if attention.startswith("mla") else [12.0, 0.5, -4.0, -1.5])
    logits = dict(zip([name for name, module in model.named_modules()
                       if hasattr(module, "core_attention")],
                      [torch.tensor(first if logits_sign == "negative"
                                    else [12.0, 0.5, 4.0, 1.5]),
                       torch.tensor([2.0, 1.0, 0.5, 2.5]), torch.tensor([0.5, 6.0, 1.0, 20.0])]))
    before = whole_masters(model, optimizer)
    for name, module in model.named_modules():
        if name in logits:  # (on the device, where TE's attention leaves them)
            module.core_attention.current_max_attn_logits = logits[name].to(
                torch.cuda.current_device())
    largest = training.clip_qk([model], log_max_only=False)
    after = whole_masters(model, optimizer)
    if dist.get_rank() == 0:
        print(f"qk-clip: largest logit {largest}", flush=True)
    for name, master in before.items():
        attention = name.rsplit(".", 2)[0]
        expected = reference(name, master, logits[attention], config)
        changed = (after[name] - master).abs().max().item()
        if dist.get_rank() == 0:
            print(f"qk-clip: {name}: largest difference from the reference "
                  f"{(after[name] - expected).abs().max().item():.3e}, changed by the clip "
                  f"{changed:.3e}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
