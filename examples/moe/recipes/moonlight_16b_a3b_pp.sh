# shellcheck shell=bash disable=SC2034
# Moonlight-16B-A3B, pipeline layout, 1 node x 8 H100 80GB.
# TP1 x PP4 x DP2. 27 layers split unevenly 6/7/7/7: the first stage also holds the embedding
# and the dense layer 0. Experts EP2 x ETP1, expert-DP 1.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_moonlight_16b_a3b.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=1
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 4
  --decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 7
  --expert-model-parallel-size 2 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --ckpt-format torch_dist
)
