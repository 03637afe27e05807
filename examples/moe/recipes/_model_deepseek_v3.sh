# shellcheck shell=bash disable=SC2034
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; DeepSeek-R1's states the same architecture):
# 671B parameters, 37B active, plus one multi-token-prediction (MTP) module.
# 61 layers, hidden 7168, 128 heads of multi-latent attention (q_lora_rank 1536, kv_lora_rank
# 512, qk nope head dim 128, qk rope head dim 64, v head dim 128; the compressed q's and kv's
# RMSNorms -> --qk-layernorm). Layers 0-2 are dense (SwiGLU 18432, first_k_dense_replace=3 ->
# --moe-layer-freq), the other 58 have 256 routed experts of 2048 top-8 plus one shared expert
# (2048, no gate). The router takes the sigmoid of its logits, chooses by score + a per-expert
# bias (e_score_correction_bias -> --moe-router-enable-expert-bias, moved after every step by the
# tokens each expert got, megatron's default rate 1e-3 as the paper's), within the 4 of 8 expert
# groups whose two best scores sum highest (n_group, topk_group), renormalises the chosen scores
# and scales them by 2.5 (routed_scaling_factor). RMSNorm 1e-6, vocab 129280, untied embeddings.
# What the recipe sets as DeepSeek-V3's pretraining did (arXiv 2412.19437), not stated by
# config.json (test_recipes RECIPE_OWN_ARGS):
# * sequence length 4096 before the YaRN extension to 163840 positions (a later stage), so
#   plain RoPE (theta 10000) at 4096 positions (megatron's fused RoPE for MLA needs YaRN, hence
#   --no-rope-fusion);
# * the complementary sequence-wise balance loss at alpha 1e-4;
# * the MTP module's loss weighted 0.3 (the paper's weight for its first 10T tokens, 0.1
#   after). The module itself (num_nextn_predict_layers 1, depth 1: layer 61 of the checkpoint)
#   is config.json's, and import-hf takes it.
VOCAB_SIZE=129280
# The published tokenizer, for the download hint: a run loads a local copy (TOKENIZER_MODEL).
TOKENIZER_HUB_ID=deepseek-ai/DeepSeek-V3
# A pipeline of 16 stages needs many micro-batches per step to keep its bubble small.
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-2048}
MODEL_ARGS=(
  --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432
  --num-attention-heads 128 --multi-latent-attention
  --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
  --v-head-dim 128 --qk-layernorm
  --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --rope-type rope --rotary-base 10000 --no-rope-fusion
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048
  --moe-shared-expert-intermediate-size 2048
  --moe-layer-freq '([0]*3+[1]*58)'
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.5
  --moe-router-num-groups 8 --moe-router-group-topk 4
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
  --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
)
