# shellcheck shell=bash disable=SC2034
# Tiny MoE GPT for a CPU smoke run (the default recipe): 4 ranks on 1 node (no GPU), about a minute
# on 2 cores. 4 layers, hidden 128, 8 experts top-2 with all-to-all dispatch, sequence 128,
# mock data, 20 iterations of global batch 16 (micro batch 2 x DP 4 x 2 accumulation steps),
# EP2 (expert-DP 2), loss and throughput logged every iteration, a torch_dist checkpoint at
# the end. On CPU pretrain_moe.py itself adds gloo, CPU init, fusions off and the local spec.
NODES=1
GPUS_PER_NODE=4
VOCAB_SIZE=1024
IMPL_ARGS=()
MODEL_ARGS=(
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4
  --seq-length 128 --max-position-embeddings 128
  --position-embedding-type rope --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256
  --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2
)
LAYOUT_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --expert-model-parallel-size 2
  --use-distributed-optimizer --ckpt-format torch_dist
)
TRAIN_ARGS=(
  --micro-batch-size 2 --global-batch-size 16 --train-iters "${TRAIN_ITERS:-20}"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2
  --weight-decay 0.1 --clip-grad 1.0 --seed 1234
  --save-interval "${SAVE_INTERVAL:-20}" --eval-iters 0 --eval-interval "${TRAIN_ITERS:-20}"
)
