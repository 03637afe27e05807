# shellcheck shell=bash disable=SC2034
# Qwen3-235B-A22B, pipeline layout, 16 nodes x 8 H100 80GB (128 GPUs).
# TP1 x PP8 x DP16. 94 layers split 11 + 6 x 12 + 11: the first stage holds the embedding, the
# last the output layer. Experts EP16 x ETP1 (8 experts a GPU), expert-DP 1. Every layer
# recomputed in the backward (full, uniform, one layer a block): under 1F1B the first stage
# keeps the activations of PP = 8 micro-batches in flight through its 11 layers, about as many
# layer activations as the model has layers whatever the PP size (0.9 GiB a layer at 4096
# tokens, 76 GiB in all, 113 GiB a GPU: the dry run's count without recompute); recomputed, only
# each layer's input (32 MiB) is kept: 40.6 GiB on the busiest GPU.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_qwen3_235b_a22b.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=16
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 8
  --decoder-first-pipeline-num-layers 11 --decoder-last-pipeline-num-layers 11
  --expert-model-parallel-size 16 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --ckpt-format torch_dist
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
