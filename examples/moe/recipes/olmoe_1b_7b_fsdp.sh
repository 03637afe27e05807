# shellcheck shell=bash disable=SC2034
# OLMoE-1B-7B, Megatron-FSDP + expert tensor parallel, 1 node x 8 H100 80GB.
# TP1 PP1, DP8 for the dense part (optim_grads_params); experts EP4 x ETP2, expert-DP 1.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_olmoe_1b_7b.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=1
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --expert-model-parallel-size 4 --expert-tensor-parallel-size 2
  "${FSDP_ARGS[@]}"
)
