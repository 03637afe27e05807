# shellcheck shell=bash disable=SC2034
# Mixtral-8x7B, Megatron-FSDP + expert tensor parallel, 4 nodes x 8 H100 80GB (32 GPUs).
# TP1 PP1, DP32 for the dense part (fully sharded: optim_grads_params); experts EP8 x ETP2,
# expert-DP 2. Weights+grads+Adam ~22 GiB/GPU before activations (bf16 Megatron-FSDP grads).
# shellcheck source=/dev/null
source "$RECIPE_DIR/_model_mixtral_8x7b.sh"
# shellcheck source=/dev/null
source "$RECIPE_DIR/_gpu_common.sh"
NODES=4
GPUS_PER_NODE=8
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 2
  "${FSDP_ARGS[@]}"
)
