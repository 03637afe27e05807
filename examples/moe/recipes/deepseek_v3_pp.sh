# shellcheck shell=bash disable=SC2034
# DeepSeek-V3, pipeline layout, 64 nodes x 8 H100 80GB (512 GPUs), as DeepSeek trained it
# (16 pipeline stages, experts spread over the data-parallel ranks, no tensor parallelism).
# TP1 x PP16 x DP32. 61 layers split 3 + 14 x 4 + 2: the first stage holds the embedding and the
# 3 dense layers, the last 2 layers, the MTP module and the output layer. Experts EP32 x ETP1
# (8 experts a GPU), expert-DP 1. Every layer recomputed in the backward (full, uniform, one
# layer a block; DeepSeek recomputed parts of each layer): under 1F1B the second stage keeps the
# activations of 15 micro-batches in flight through its 4 layers (1.8 GiB a MoE layer at 4096
# tokens, 105 GiB in all, 134 GiB a GPU: the dry run's count without recompute); recomputed,
# only each layer's input (56 MiB) is kept: 39.8 GiB on the busiest GPU (the last stage).
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_deepseek_v3.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=64
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 16
  --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2
  --expert-model-parallel-size 32 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --ckpt-format torch_dist
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
