# shellcheck shell=bash disable=SC2034
# OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924 config.json): 6.9B parameters, 1.3B active.
# 16 layers, hidden 2048, 16 heads (full multi-head attention), QK norm, 64 experts of 1024
# top-8 (softmax before top-k, no renormalisation -> --moe-router-pre-softmax), load-balancing
# loss 0.01 and router z-loss 0.001, RMSNorm 1e-5, RoPE theta 10000, vocab 50304, untied
# embeddings, sequence length 4096. Difference: OLMoE normalises q/k over the full projection,
# megatron's --qk-layernorm per head.
VOCAB_SIZE=50304
# The published tokenizer, for the download hint: a run loads a local copy (TOKENIZER_MODEL).
TOKENIZER_HUB_ID=allenai/OLMoE-1B-7B-0924
MODEL_ARGS=(
  --num-layers 16 --hidden-size 2048 --ffn-hidden-size 1024
  --num-attention-heads 16 --qk-layernorm
  --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --rotary-base 10000
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1024
  --moe-router-pre-softmax
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3
)
