# shellcheck shell=bash disable=SC2034
# Mixtral-8x7B, pipeline layout, 4 nodes x 8 H100 80GB (32 GPUs).
# TP2 (sequence parallel) x PP4 (2 virtual stages per rank, 4 layers each) x DP4; experts EP8
# x ETP1, expert-DP 1. Distributed optimizer, torch_dist checkpoints.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_mixtral_8x7b.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=4
GPUS_PER_NODE=8
# Tensor parallelism without FSDP: megatron requires one hardware queue per GPU.
RUN_ENV=(CUDA_DEVICE_MAX_CONNECTIONS=1)
LAYOUT_ARGS=(
  --tensor-model-parallel-size 2 --sequence-parallel
  --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --ckpt-format torch_dist
)
