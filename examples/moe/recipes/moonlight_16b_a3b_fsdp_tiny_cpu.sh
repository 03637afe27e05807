# shellcheck shell=bash disable=SC2034
# Tiny CPU twin of moonlight_16b_a3b_fsdp (see _cpu_twin.sh): its flags with tiny sizes, 4 CPU
# ranks on 1 node. The recipe's experts are EP4 x ETP2 (8 ranks per expert replica, expert-DP
# 2), more than 4 ranks hold: the twin keeps ETP2 and runs EP2 (expert-DP 1), under the same
# Megatron-FSDP optim_grads_params (over DP 4): the recipe's multi-latent attention on the local
# spec (patch local-mla-core-attention), with the sigmoid router, its expert bias and the
# sequence-wise balance loss, the shared experts and the dense first layer.
TWIN_OF=moonlight_16b_a3b_fsdp
# shellcheck source=/dev/null
source "$RECIPE_DIR/_cpu_twin.sh"
NODES=1
