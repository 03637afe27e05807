# shellcheck shell=bash disable=SC2034
# Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 46.7B parameters, 12.9B active.
# 32 layers, hidden 4096, 32 heads / 8 KV heads (GQA, head dim 128), SwiGLU experts of 14336,
# 8 experts top-2 (softmax over the top-2 logits = megatron's default router), RMSNorm 1e-5,
# load-balancing loss 0.02 (router_aux_loss_coef), RoPE theta 1e6, vocab 32000, untied
# embeddings. Trained here at sequence length 4096. The load-balancing coefficient is the
# published number, in megatron's per-layer loss: 16x (layers / top-k) the balancing gradient of
# transformers' pooled one at it (README, import-hf).
VOCAB_SIZE=32000
# The published tokenizer, for the download hint: a run loads a local copy (TOKENIZER_MODEL).
TOKENIZER_HUB_ID=mistralai/Mixtral-8x7B-v0.1
MODEL_ARGS=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
  --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
  --seq-length 4096 --max-position-embeddings 32768
  --position-embedding-type rope --rotary-base 1000000
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 14336
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 2e-2
)
