# shellcheck shell=bash disable=SC2034
# Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B config.json): 235B parameters, 22B active.
# Qwen3-30B-A3B's architecture, larger: 94 layers, hidden 4096, 64 heads / 4 KV heads with head
# dim 128 (attention width 8192 != hidden), QK RMSNorm, 128 experts of 1536 top-8 with
# normalised top-k probabilities (= softmax over the top-k logits, megatron's default), no
# shared expert, RMSNorm 1e-6, RoPE theta 1e6, vocab 151936, untied embeddings. Trained here at
# sequence length 4096. The load-balancing coefficient is the published router_aux_loss_coef,
# in megatron's per-layer loss: 11.75x (layers / top-k) the balancing gradient of transformers'
# pooled one at it (README, import-hf).
VOCAB_SIZE=151936
# The published tokenizer, for the download hint: a run loads a local copy (TOKENIZER_MODEL).
TOKENIZER_HUB_ID=Qwen/Qwen3-235B-A22B
MODEL_ARGS=(
  --num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288
  --num-attention-heads 64 --group-query-attention --num-query-groups 4 --kv-channels 128
  --qk-layernorm
  --seq-length 4096 --max-position-embeddings 40960
  --position-embedding-type rope --rotary-base 1000000
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 1536
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
)
