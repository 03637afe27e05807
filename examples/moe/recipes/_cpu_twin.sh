# shellcheck shell=bash disable=SC2034
# The tiny CPU twin of a GPU recipe, sourced by <recipe>_tiny_cpu.sh after it sets TWIN_OF. Not
# a recipe itself (leading _). The twin is the GPU recipe itself, sourced here: its layout and
# Megatron-FSDP flags, its model's features and its schedule, with only these changes:
# * sizes: each size flag the recipe sets takes the tiny value below (a flag it does not set
#   stays unset, so no feature is added), and the mock-data vocabulary is 512; the warmup
#   shrinks with the run (megatron needs it shorter than the decay, here --train-iters), and
#   evaluation takes one batch;
# * 4 CPU ranks (on 1 node: the twin says NODES=1), with expert parallelism fitted into them:
#   the recipe's EP, or where that needs more ranks, the most that 4 hold with its ETP and PP;
# * --transformer-impl local: Transformer Engine needs CUDA;
# * no --moe-grouped-gemm: grouped-GEMM experts are CUDA kernels (Transformer Engine's, or the
#   grouped_gemm package's); the local spec runs the experts one after another (SequentialMLP);
# * global batch 8 (micro-batch 1 x DP 4 x 2 accumulation steps) and 4 iterations, unless
#   GLOBAL_BATCH_SIZE / TRAIN_ITERS say otherwise.
# * --log-interval 1 (the GPU recipes log every 10 iterations).
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-8}
TRAIN_ITERS=${TRAIN_ITERS:-4}
# shellcheck source=/dev/null
source "$RECIPE_DIR/$TWIN_OF.sh"
TWIN_RANKS=4
GPUS_PER_NODE=$TWIN_RANKS
VOCAB_SIZE=512
RECIPE_LOG_INTERVAL=1  # a few CPU iterations: every one logged

declare -A TINY_SIZES=(
  [--num-layers]=2 [--hidden-size]=64 [--ffn-hidden-size]=128
  [--num-attention-heads]=4 [--num-query-groups]=2 [--kv-channels]=16
  [--q-lora-rank]=32 [--kv-lora-rank]=32 [--qk-head-dim]=16 [--qk-pos-emb-head-dim]=8
  [--v-head-dim]=16
  [--seq-length]=64 [--max-position-embeddings]=64
  [--num-experts]=16 [--moe-ffn-hidden-size]=32 [--moe-shared-expert-intermediate-size]=64
  # DeepSeek's first layer dense, the rest MoE, at 2 layers
  [--moe-layer-freq]='([0]*1+[1]*1)'
  [--lr-warmup-iters]=1 [--eval-iters]=1
)

# Sets the value of flag $2 to $3 in the array named $1, where the array has the flag.
twin_set() {
  local -n twin_args=$1
  local i
  for ((i = 0; i + 1 < ${#twin_args[@]}; i++)); do
    if [[ ${twin_args[i]} == "$2" ]]; then twin_args[i + 1]=$3; fi
  done
}

# The value of flag $2 in the array named $1 (its last occurrence), else $3.
twin_value() {
  local -n twin_from=$1
  local i value=$3
  for ((i = 0; i + 1 < ${#twin_from[@]}; i++)); do
    if [[ ${twin_from[i]} == "$2" ]]; then value=${twin_from[i + 1]}; fi
  done
  echo "$value"
}

for flag in "${!TINY_SIZES[@]}"; do
  twin_set MODEL_ARGS "$flag" "${TINY_SIZES[$flag]}"
  twin_set TRAIN_ARGS "$flag" "${TINY_SIZES[$flag]}"
done

twin_ep=$(twin_value LAYOUT_ARGS --expert-model-parallel-size 1)
twin_fit=$((TWIN_RANKS / ($(twin_value LAYOUT_ARGS --expert-tensor-parallel-size 1)
                          * $(twin_value LAYOUT_ARGS --pipeline-model-parallel-size 1))))
twin_set LAYOUT_ARGS --expert-model-parallel-size $((twin_ep < twin_fit ? twin_ep : twin_fit))

# Removes the switch $2 (a flag without a value) from the array named $1.
twin_drop() {
  local -n twin_in=$1
  local kept=() arg
  for arg in "${twin_in[@]}"; do
    if [[ $arg != "$2" ]]; then kept+=("$arg"); fi
  done
  twin_in=("${kept[@]}")
}

twin_drop IMPL_ARGS --moe-grouped-gemm
twin_set IMPL_ARGS --transformer-impl local
