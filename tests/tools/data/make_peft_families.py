"""PEFT LoRA adapters (rank 4, alpha 8, random nonzero A and B of std 0.2) of each tiny
family model beside this script, on every Linear module PEFT can target in it, with PEFT's
logits of the family's tokens.npy and those of merge_and_unload()'s merged model. Run with
the torch venv:
  python make_peft_families.py tests/tools/data    (writes peft_<family>/ for each family)
"""
import os, sys
import numpy as np, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# transformers 5 fuses an MoE's routed experts into one module (not a Linear), and PEFT 0.21
# maps any gate_proj / up_proj / down_proj target of an MoE model (DeepSeek's dense layers
# and shared experts too, by any name) onto those fused experts (target_parameters,
# gate_up_proj at rank 2r), which spmdtask refuses: MoE families' adapters here are their
# attention's (DeepSeek: MLA's projections).
TARGETS = {"qwen3": LLAMA, "gemma3": LLAMA,
           "mixtral": LLAMA[:4], "qwen3_moe": LLAMA[:4],
           "deepseek_v2": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
           "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                           "o_proj"]}
for family, targets in TARGETS.items():
  base_dir, out = (os.path.join(sys.argv[1], family),
                   os.path.join(sys.argv[1], f"peft_{family}"))
  load = lambda: AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
  model = load()
  model.name_or_path = f"tiny-{family}"  # what adapter_config.json names as its base
  peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                task_type="CAUSAL_LM",
                                                target_modules=targets)).eval()
  torch.manual_seed(1)
  with torch.no_grad():  # PEFT starts B at 0 (a no-op adapter): random A and B instead
    for name, p in peft_model.named_parameters():
      if "lora_" in name:
        p.normal_(0, 0.2)
  peft_model.save_pretrained(out)
  os.remove(os.path.join(out, "README.md"))  # PEFT's model card
  ids = torch.tensor(np.load(os.path.join(base_dir, "tokens.npy")), dtype=torch.long)
  with torch.no_grad():
    logits = peft_model(ids).logits.numpy()
    merged = peft_model.merge_and_unload()(ids).logits.numpy()
    plain = load()(ids).logits.numpy()
  np.save(os.path.join(out, "logits.npy"), logits.astype(np.float32))
  np.save(os.path.join(out, "merged_logits.npy"), merged.astype(np.float32))
  print(family, "adapter changes logits by", np.abs(logits - plain).max(),
        "merged vs unmerged", np.abs(logits - merged).max(), "max |logit|", np.abs(logits).max())
