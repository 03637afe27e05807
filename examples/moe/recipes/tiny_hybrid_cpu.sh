# shellcheck shell=bash disable=SC2034
# Tiny MoE HybridModel for a CPU smoke run, 4 ranks on 1 node: tiny_cpu (layout, data, schedule) with the
# model spelled as a --hybrid-layer-pattern, one layer family per symbol (`*` attention, `E`
# MoE): the 8 layers `*E*E*E*E` are tiny_cpu's 4 attention + MoE decoder layers. On CPU the
# launcher builds HybridModel from megatron's local modules (moe_launcher/model/hybrid_spec.py); with
# Transformer Engine, megatron's own hybrid spec.
# shellcheck source=/dev/null
source "$RECIPE_DIR/tiny_cpu.sh"
NODES=1
GPUS_PER_NODE=4
# The pattern sets the layer count; the later --num-layers keeps megatron from warning that it
# ignores tiny_cpu's.
MODEL_ARGS+=(--num-layers 8 --hybrid-layer-pattern '*E*E*E*E')
