# shellcheck shell=bash disable=SC2034
# Moonlight-16B-A3B, Megatron-FSDP + expert tensor parallel, 2 nodes x 8 H100 80GB (16 GPUs).
# TP1 PP1, DP16 for the dense part (optim_grads_params); experts EP4 x ETP2 (one node),
# expert-DP 2 across nodes.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_moonlight_16b_a3b.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=2
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --expert-model-parallel-size 4 --expert-tensor-parallel-size 2
  "${FSDP_ARGS[@]}"
)
