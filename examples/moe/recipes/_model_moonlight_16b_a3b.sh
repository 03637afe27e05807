# shellcheck shell=bash disable=SC2034
# Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B config.json): 16.0B parameters, 3B active, the
# DeepSeek-V3 architecture (DeepseekV3ForCausalLM) at DeepSeek-V2-Lite's size.
# 27 layers, hidden 2048, 16 heads of multi-latent attention (q_lora_rank none -> no
# --q-lora-rank, kv_lora_rank 512, qk nope head dim 128, qk rope head dim 64, v head dim 128;
# the compressed kv's RMSNorm, kv_a_layernorm -> --qk-layernorm, which for a q without rank adds
# no q norm with the patch mla-q-projection-without-norm).
# Layer 0 is dense (SwiGLU 11264, first_k_dense_replace=1 -> --moe-layer-freq), the other 26
# have 64 routed experts of 1408 top-6 plus 2 shared experts (2 x 1408 = 2816, no gate). The
# router takes the sigmoid of its logits, chooses by score + a per-expert bias
# (e_score_correction_bias -> --moe-router-enable-expert-bias, moved after every step by the
# tokens each expert got), renormalises the chosen scores (norm_topk_prob: megatron's sigmoid
# router with top-k > 1) and scales them by 2.446 (routed_scaling_factor); one group
# (n_group 1: megatron's default). DeepSeek's complementary sequence-wise balance loss at the
# published aux_loss_alpha 1e-3 (seq_aux). RMSNorm 1e-5, plain RoPE theta 50000 (no
# rope_scaling), 8192 positions, vocab 163840, untied embeddings; no multi-token-prediction
# layer (num_nextn_predict_layers 0). Trained here at sequence length 4096 (megatron's fused
# RoPE for MLA needs YaRN, hence --no-rope-fusion).
VOCAB_SIZE=163840
# The published tokenizer, for the download hint: a run loads a local copy (TOKENIZER_MODEL).
# It is tiktoken behind code of its own (tokenization_moonshot.TikTokenTokenizer), which runs
# only when asked: prepare_data's and the run's --trust-remote-code (tiktoken is in the lock).
TOKENIZER_HUB_ID=moonshotai/Moonlight-16B-A3B
TOKENIZER_HUB_FILES="'tokenizer*' tiktoken.model tokenization_moonshot.py"
TOKENIZER_HUB_NOTE="its tokenizer is code of its own: pass --trust-remote-code to prepare_data and EXTRA_ARGS=--trust-remote-code to the run"
MODEL_ARGS=(
  --num-layers 27 --hidden-size 2048 --ffn-hidden-size 11264
  --num-attention-heads 16 --multi-latent-attention
  --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm
  --seq-length 4096 --max-position-embeddings 8192
  --position-embedding-type rope --rope-type rope --rotary-base 50000 --no-rope-fusion
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408
  --moe-shared-expert-intermediate-size 2816
  --moe-layer-freq '([0]*1+[1]*26)'
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.446
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3
)
