# shellcheck shell=bash disable=SC2034
# Kimi K2, pipeline layout, 128 nodes x 8 H100 80GB (1024 GPUs), DeepSeek-V3's pipeline at twice
# the experts: TP1 x PP16 x DP64. 61 layers split 3 + 14 x 4 + 2: the first stage holds the
# embedding, the dense layer 0 and two MoE layers, the last 2 layers and the output layer.
# Experts EP64 x ETP1 (6 experts a GPU), expert-DP 1. Every layer recomputed in the backward
# (full, uniform, one layer a block): under 1F1B the second stage keeps the activations of 15
# micro-batches in flight through its 4 layers (1.4 GiB a MoE layer at 4096 tokens, 87 GiB in
# all, 108 GiB a GPU: the dry run's count without recompute); recomputed, only each layer's
# input (56 MiB) is kept: 25.9 GiB on the busiest GPU.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_kimi_k2.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=128
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 16
  --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2
  --expert-model-parallel-size 64 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --ckpt-format torch_dist
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
