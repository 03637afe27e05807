# shellcheck shell=bash disable=SC2034
# DeepSeek-V3, Megatron-FSDP + expert tensor parallel, 64 nodes x 8 H100 80GB (512 GPUs): no
# pipeline (the MTP module beside the 61 layers on every GPU), the dense part sharded over DP512
# (optim_grads_params); experts EP4 x ETP2 (one node: 64 experts a GPU, each split in two; the
# all-to-all stays on NVLink), expert-DP 64 across nodes. Every layer recomputed in the backward
# (full, uniform, one layer a block): without a pipeline one GPU keeps the activations of all 61
# layers and the MTP module (2.2 GiB a MoE layer at 4096 tokens with the ETP2 gather, 134 GiB in
# all, 160 GiB a GPU: the dry run's count without recompute); recomputed, only each layer's
# input (56 MiB) is kept: 51.8 GiB a GPU, 22.3 of them Megatron-FSDP's gathered layers and
# unsharded gradients (megatron's communication unit, twice a layer's 1.6B elements a GPU, sets
# its gather window and reduce-scatter queue; the embedding and output layer stay gathered;
# --suggested-communication-unit-size 200000000 in EXTRA_ARGS: 16.0 GiB, less prefetch).
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_deepseek_v3.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=64
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --expert-model-parallel-size 4 --expert-tensor-parallel-size 2
  "${FSDP_ARGS[@]}"
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
