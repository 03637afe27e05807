# shellcheck shell=bash disable=SC2034
# GLM-4.5-Air, pipeline layout, 8 nodes x 8 H100 80GB (64 GPUs).
# TP1 x PP4 x DP16. 46 layers split 12/12/12/10: the first stage also holds the embedding and
# the dense layer 0, the last the MTP layer (a MoE layer) and the output layer, which the MTP
# layer runs a second time. Experts EP8 x ETP1, expert-DP 2. Every layer recomputed in the
# backward (full, uniform, one layer a block): under 1F1B the first stage keeps the activations
# of PP = 4 micro-batches in flight through its 12 layers (0.9 GiB a MoE layer at 4096 tokens,
# 41 GiB in all, 89 GiB a GPU: the dry run's count without recompute); recomputed, only each
# layer's input (32 MiB) is kept: 58.3 GiB on the busiest GPU.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_glm45_air.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=8
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 4
  --decoder-first-pipeline-num-layers 12 --decoder-last-pipeline-num-layers 10
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --ckpt-format torch_dist
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
