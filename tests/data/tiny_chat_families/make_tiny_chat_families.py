"""Writes tests/data/tiny_chat_families/{qwen3,qwen3_moe}: tiny random Qwen3 and Qwen3-MoE
chat models in Hugging Face's layout, with examples/tiny_chat/model's tokenizer and chat
template (vocab 300, float32): the other families of tests/test_recipe.py's chain. Run
with transformers 5 and torch (CPU), from the repository root:
  python tests/data/tiny_chat_families/make_tiny_chat_families.py"""
import os, shutil
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
CHAT = os.path.join(HERE, "..", "..", "..", "examples", "tiny_chat", "model")
COMMON = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=3, eos_token_id=6)
for name, make in (
    ("qwen3", lambda: Qwen3ForCausalLM(Qwen3Config(intermediate_size=64,
                                                   tie_word_embeddings=True, **COMMON))),
    ("qwen3_moe", lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=False, **COMMON)))):
  torch.manual_seed(0)
  out = os.path.join(HERE, name)
  make().save_pretrained(out)
  os.remove(os.path.join(out, "generation_config.json"))
  for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(os.path.join(CHAT, f), out)
  print(name, sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)), "bytes")
