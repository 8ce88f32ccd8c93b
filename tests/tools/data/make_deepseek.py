import os, sys
import numpy as np, torch
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=127,
              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                   original_max_position_embeddings=32, beta_fast=32.0,
                                   beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707))
MODELS = {
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
        **COMMON, q_lora_rank=32, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True)),
    "deepseek_v2": (DeepseekV2ForCausalLM, DeepseekV2Config(
        **COMMON, q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
        norm_topk_prob=False, routed_scaling_factor=1.5)),
}
for name, (cls, cfg) in MODELS.items():
  torch.manual_seed(0)
  model = cls(cfg).eval()
  with torch.no_grad():  # init leaves norms at 1 and weights tiny: random scales instead
    for p in model.parameters():
      p.normal_(0, 0.3 if p.ndim > 1 else 0.2).add_(1.0 if p.ndim == 1 else 0.0)
    for mod in model.modules():  # V3's balancing bias: a buffer, random too
      if hasattr(mod, "e_score_correction_bias"):
        mod.e_score_correction_bias.normal_(0, 0.1)
  out = os.path.join(sys.argv[1], name)
  model.save_pretrained(out)
  os.remove(os.path.join(out, "generation_config.json"))
  tokens = np.random.default_rng(1).integers(0, 128, (2, 24)).astype(np.int32)
  with torch.no_grad():
    logits = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.save(os.path.join(out, "tokens.npy"), tokens)
  np.save(os.path.join(out, "logits.npy"), logits.astype(np.float32))
