# shellcheck shell=bash disable=SC2034
# DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite config.json): 15.7B parameters, 2.4B active.
# 27 layers, hidden 2048, 16 heads of multi-latent attention (q_lora_rank none -> no
# --q-lora-rank, kv_lora_rank 512, qk nope head dim 128, qk rope head dim 64, v head dim 128;
# the compressed kv's RMSNorm, kv_a_layernorm -> --qk-layernorm, which for a q without rank adds
# no q norm with the patch mla-q-projection-without-norm).
# Layer 0 is dense (SwiGLU 10944, first_k_dense_replace=1 -> --moe-layer-freq), the other 26
# have 64 routed experts of 1408 top-6 (softmax before top-k, no renormalisation ->
# --moe-router-pre-softmax) plus 2 shared experts (2 x 1408 = 2816), sequence-level aux loss
# 1e-3. RMSNorm 1e-6, RoPE theta 10000, vocab 102400, untied embeddings. Pretrained at 4096
# before YaRN extension, so plain RoPE at sequence length 4096 here (megatron's fused RoPE for
# MLA needs YaRN, hence --no-rope-fusion).
VOCAB_SIZE=102400
# The published tokenizer, for the download hint: a run loads a local copy (TOKENIZER_MODEL).
TOKENIZER_HUB_ID=deepseek-ai/DeepSeek-V2-Lite
MODEL_ARGS=(
  --num-layers 27 --hidden-size 2048 --ffn-hidden-size 10944
  --num-attention-heads 16 --multi-latent-attention
  --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm
  --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --rope-type rope --rotary-base 10000 --no-rope-fusion
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408
  --moe-shared-expert-intermediate-size 2816
  --moe-layer-freq '([0]*1+[1]*26)'
  --moe-router-pre-softmax
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3
)
