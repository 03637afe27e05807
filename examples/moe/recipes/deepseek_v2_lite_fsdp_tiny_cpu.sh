# shellcheck shell=bash disable=SC2034
# Tiny CPU twin of deepseek_v2_lite_fsdp (see _cpu_twin.sh): its flags with tiny sizes, 4 CPU
# ranks on 1 node. The recipe's experts are EP4 x ETP2 (8 ranks per expert replica, expert-DP
# 2), more than 4 ranks hold: the twin keeps ETP2 and runs EP2 (expert-DP 1), under the same
# Megatron-FSDP optim_grads_params (over DP 4).
TWIN_OF=deepseek_v2_lite_fsdp
# shellcheck source=/dev/null
source "$RECIPE_DIR/_cpu_twin.sh"
NODES=1
# One more CPU-only difference: standard attention instead of multi-latent attention. On
# megatron's local spec (the only one without Transformer Engine) MLA builds an attention without
# k_channels and fails (pretrain_moe.py refuses it before megatron starts). So the twin checks
# the recipe's layout with its dense first layer, shared experts, pre-softmax top-6 routing and
# sequence aux loss, but not MLA under Megatron-FSDP; the MLA sizes stay, unused.
twin_drop MODEL_ARGS --multi-latent-attention
