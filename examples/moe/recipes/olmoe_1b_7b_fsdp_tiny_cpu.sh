# shellcheck shell=bash disable=SC2034
# Tiny CPU twin of olmoe_1b_7b_fsdp (see _cpu_twin.sh): its flags with tiny sizes, 4 CPU
# ranks on 1 node. The recipe's experts are EP4 x ETP2 (8 ranks per expert replica, expert-DP
# 1), more than 4 ranks hold: the twin keeps ETP2 and runs EP2 (expert-DP 1), under the same
# Megatron-FSDP optim_grads_params (over DP 4).
TWIN_OF=olmoe_1b_7b_fsdp
# shellcheck source=/dev/null
source "$RECIPE_DIR/_cpu_twin.sh"
NODES=1
