# shellcheck shell=bash disable=SC2034
# Tiny CPU twin of mixtral_8x7b_fsdp (see _cpu_twin.sh): its flags with tiny sizes, 4 CPU
# ranks on 1 node. The recipe's experts are EP8 x ETP2 (16 ranks per expert replica, expert-DP
# 2), more than 4 ranks hold: the twin keeps ETP2 and runs EP2 (expert-DP 1), under the same
# Megatron-FSDP optim_grads_params (over DP 4).
TWIN_OF=mixtral_8x7b_fsdp
# shellcheck source=/dev/null
source "$RECIPE_DIR/_cpu_twin.sh"
NODES=1
