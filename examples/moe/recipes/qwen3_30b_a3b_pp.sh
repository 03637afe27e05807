# shellcheck shell=bash disable=SC2034
# Qwen3-30B-A3B, pipeline layout, 2 nodes x 8 H100 80GB (16 GPUs).
# TP1 x PP4 (12 layers per stage) x DP4; experts EP4 x ETP1, expert-DP 1.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_qwen3_30b_a3b.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=2
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 4
  --expert-model-parallel-size 4 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --ckpt-format torch_dist
)
