# shellcheck shell=bash disable=SC2034
# Shared by the GPU recipes (sourced after a _model_*.sh file): TE grouped-GEMM experts, bf16,
# all-to-all token dispatch, and a plain pretraining schedule. Not a recipe itself (leading _).
# A log line every 10 iterations: for each line megatron gathers its timers from every rank.
RECIPE_LOG_INTERVAL=10
IMPL_ARGS=(
  --transformer-impl transformer_engine
  --moe-grouped-gemm
  --moe-token-dispatcher-type alltoall
  --moe-router-dtype fp32
  --bf16
)
TRAIN_ARGS=(
  --micro-batch-size 1
  --global-batch-size "${GLOBAL_BATCH_SIZE:-256}"
  --train-iters "${TRAIN_ITERS:-100000}"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0
  --save-interval "${SAVE_INTERVAL:-1000}" --eval-interval 1000 --eval-iters 10
)
# The Megatron-FSDP part of every FSDP+ETP layout: fully sharded params, grads and optimizer
# state; megatron-core 0.19.2 saves Megatron-FSDP models only in the fsdp_dtensor format.
FSDP_ARGS=(
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
  --use-distributed-optimizer --ckpt-format fsdp_dtensor
)
