# shellcheck shell=bash disable=SC2034
# Kimi K2 (moonshotai/Kimi-K2-Instruct config.json): 1.03T parameters, 32B active, the
# DeepSeek-V3 architecture (DeepseekV3ForCausalLM) with more experts and fewer heads.
# 61 layers, hidden 7168, 64 heads of multi-latent attention (q_lora_rank 1536, kv_lora_rank
# 512, qk nope head dim 128, qk rope head dim 64, v head dim 128; the compressed q's and kv's
# RMSNorms -> --qk-layernorm). Layer 0 is dense (SwiGLU 18432, first_k_dense_replace=1 ->
# --moe-layer-freq), the other 60 have 384 routed experts of 2048 top-8 plus one shared expert
# (2048, no gate). The router takes the sigmoid of its logits, chooses by score + a per-expert
# bias (e_score_correction_bias -> --moe-router-enable-expert-bias), in one group (n_group 1:
# megatron's default), renormalises the chosen scores and scales them by 2.827
# (routed_scaling_factor); DeepSeek's complementary sequence-wise balance loss at the published
# aux_loss_alpha 1e-3 (seq_aux). RMSNorm 1e-6, rope theta 50000, vocab 163840, untied
# embeddings, no multi-token-prediction layer (num_nextn_predict_layers 0).
# What the recipe sets otherwise, not stated by config.json (test_recipes RECIPE_OWN_ARGS):
# sequence length 4096 with plain RoPE before the YaRN extension (config.json's yarn: factor 32
# over 4096 positions, beta_fast 1, which import-hf maps and patch mla-yarn-flags makes MLA
# take), hence --no-rope-fusion. Kimi K2 was trained with MuonClip (Muon with QK-clip at
# threshold 100); the recipe keeps the GPU recipes' AdamW. EXTRA_ARGS="--optimizer muon
# --qk-clip --qk-clip-threshold 100" runs megatron's MuonClip (with the recipe's
# --use-distributed-optimizer megatron's layer-wise distributed Muon; QK-clip needs Transformer
# Engine >= 2.9, as in the cluster image); "--qk-clip ..." alone clips under AdamW's distributed
# optimizer through patch qk-clip-distributed-optimizer. Their clip is judged on CPU
# (test_qk_clip_cpu.py); no run of them here (no GPU).
VOCAB_SIZE=163840
# The published tokenizer, for the download hint: a run loads a local copy (TOKENIZER_MODEL).
# It is tiktoken behind code of its own (tokenization_kimi.TikTokenTokenizer), which runs only
# when asked: prepare_data's and the run's --trust-remote-code (tiktoken is in the lock).
TOKENIZER_HUB_ID=moonshotai/Kimi-K2-Instruct
TOKENIZER_HUB_FILES="'tokenizer*' tiktoken.model tokenization_kimi.py"
TOKENIZER_HUB_NOTE="its tokenizer is code of its own: pass --trust-remote-code to prepare_data and EXTRA_ARGS=--trust-remote-code to the run"
# A pipeline of 16 stages needs many micro-batches per step to keep its bubble small.
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-2048}
MODEL_ARGS=(
  --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432
  --num-attention-heads 64 --multi-latent-attention
  --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
  --v-head-dim 128 --qk-layernorm
  --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --rope-type rope --rotary-base 50000 --no-rope-fusion
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --num-experts 384 --moe-router-topk 8 --moe-ffn-hidden-size 2048
  --moe-shared-expert-intermediate-size 2048
  --moe-layer-freq '([0]*1+[1]*60)'
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.827
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3
)
