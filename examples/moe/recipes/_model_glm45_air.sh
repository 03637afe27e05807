# shellcheck shell=bash disable=SC2034
# GLM-4.5-Air (zai-org/GLM-4.5-Air config.json): 106B parameters, 12B active.
# 46 layers, hidden 4096, 96 heads / 8 KV heads with head dim 128 (attention width 12288 !=
# hidden), biases on q, k and v (attention_bias: not on the output projection), rope on the first
# half of each head (partial_rotary_factor 0.5 -> --rotary-percent 0.5), theta 1e6. Layer 0 is
# dense (SwiGLU 10944, first_k_dense_replace=1 -> --moe-layer-freq), the other 45 have 128
# routed experts of 1408 top-8 and one shared expert of 1408 (no gate); the router takes the
# sigmoid of its logits, chooses by score + a per-expert bias (e_score_correction_bias ->
# --moe-router-enable-expert-bias, moved after every step by the tokens each expert got: the
# balance without a load-balancing loss) and renormalises the chosen scores (one group, scaling
# 1.0: megatron's defaults). RMSNorm 1e-5, vocab 151552, untied embeddings. One
# multi-token-prediction layer (num_nextn_predict_layers 1: layer 46 of its checkpoint, a MoE
# layer sharing the embedding and output head; import-hf takes it), its loss weighted at
# megatron's default 0.1 (config.json states no weight). Trained here at sequence length 4096.
VOCAB_SIZE=151552
# The published tokenizer, for the download hint: a run loads a local copy (TOKENIZER_MODEL).
TOKENIZER_HUB_ID=zai-org/GLM-4.5-Air
MODEL_ARGS=(
  --num-layers 46 --hidden-size 4096 --ffn-hidden-size 10944
  --num-attention-heads 96 --group-query-attention --num-query-groups 8 --kv-channels 128
  --add-qkv-bias
  --seq-length 4096 --max-position-embeddings 131072
  --position-embedding-type rope --rotary-base 1000000 --rotary-percent 0.5
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 1408
  --moe-shared-expert-intermediate-size 1408
  --moe-layer-freq '([0]*1+[1]*45)'
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-load-balancing-type none
  --mtp-num-layers 1
)
