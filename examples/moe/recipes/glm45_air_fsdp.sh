# shellcheck shell=bash disable=SC2034
# GLM-4.5-Air, Megatron-FSDP + expert tensor parallel, 8 nodes x 8 H100 80GB (64 GPUs).
# TP1 PP1, DP64 for the dense part (optim_grads_params); experts EP4 x ETP2 (one node),
# expert-DP 8 across nodes. The MoE part of each layer recomputed in the backward (selective,
# moe): its 46 layers keep 52.5 GiB of activations a micro-batch otherwise (the dry run's
# estimate; the ETP2 gather doubles the experts' tokens), 94 GiB a GPU in all (9.3 GiB of them
# Megatron-FSDP's buffers); 58 GiB with it.
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_glm45_air.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=8
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --expert-model-parallel-size 4 --expert-tensor-parallel-size 2
  "${FSDP_ARGS[@]}"
  --recompute-granularity selective --recompute-modules moe
)
