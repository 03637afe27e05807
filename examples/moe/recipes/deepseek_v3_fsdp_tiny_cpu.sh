# shellcheck shell=bash disable=SC2034
# Tiny CPU twin of deepseek_v3_fsdp (see _cpu_twin.sh): its flags with tiny sizes, 4 CPU ranks on
# 1 node. The recipe's experts are EP4 x ETP2 (8 ranks per expert replica, expert-DP 64), more
# than 4 ranks hold: the twin keeps ETP2 and runs EP2 (expert-DP 1), under the same Megatron-FSDP
# optim_grads_params (over DP 4) and full recompute of every layer: multi-latent
# attention with q through its rank, the sigmoid router with its expert bias choosing in 4 of 8
# groups, the shared expert, the dense first layer, the sequence-wise balance loss and the MTP
# module, sharded as on the GPUs.
TWIN_OF=deepseek_v3_fsdp
# shellcheck source=/dev/null
source "$RECIPE_DIR/_cpu_twin.sh"
NODES=1
