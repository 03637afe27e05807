# shellcheck shell=bash disable=SC2034
# OLMoE-1B-7B, pipeline layout, 1 node x 8 H100 80GB.
# TP1 x PP2 (8 layers per stage) x DP4; experts EP4 x ETP1, expert-DP 1.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_olmoe_1b_7b.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=1
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 2
  --expert-model-parallel-size 4 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --ckpt-format torch_dist
)
