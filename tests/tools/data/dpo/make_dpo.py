import json, os, sys
import numpy as np, torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

data = sys.argv[1]  # tests/tools/data
policy_dir, out = os.path.join(data, "llama"), os.path.join(data, "dpo")
os.makedirs(out, exist_ok=True)
policy = LlamaForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
# The reference: the same architecture, other random weights.
torch.manual_seed(5)
ref = LlamaForCausalLM(policy.config).eval()
with torch.no_grad():
  for p in ref.parameters():
    p.normal_(0, 0.15 if p.ndim > 1 else 0.2).add_(1.0 if p.ndim == 1 else 0.0)
ref.save_pretrained(os.path.join(out, "reference"))
os.remove(os.path.join(out, "reference", "generation_config.json"))
# A word-level tokenizer "t0".."t127" (pad t0): TRL needs a processing class.
vocab = {f"t{i}": i for i in range(128)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t127")
rng = np.random.default_rng(7)
pairs = []
for p_len, c_len, r_len in [(5, 4, 6), (3, 7, 2), (8, 3, 3), (4, 5, 9)]:
  pairs.append({k: [int(t) for t in rng.integers(2, 127, n)]
                for k, n in (("prompt_ids", p_len), ("chosen_ids", c_len),
                             ("rejected_ids", r_len))})
words = lambda ids: " ".join(f"t{i}" for i in ids)
train = Dataset.from_list([{"prompt": words(p["prompt_ids"]), "chosen": words(p["chosen_ids"]),
                            "rejected": words(p["rejected_ids"])} for p in pairs])
args = DPOConfig(output_dir="/tmp/dpo_trl", beta=0.1, loss_type=["sigmoid"], bf16=False,
                 fp16=False, report_to=[], per_device_train_batch_size=4, use_cpu=True)
trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=train,
                     processing_class=tokenizer)
model = trainer.model.eval()


def trl_loss(examples):
  inputs = trainer.data_collator([dict(e) for e in examples])
  trainer._metrics["eval"].clear()
  model.train(False)
  with torch.no_grad():
    loss = trainer._compute_loss(model, inputs, False)
  return float(loss), {k: v[-1] for k, v in trainer._metrics["eval"].items()}

batch_loss, batch_metrics = trl_loss(pairs)
one = [trl_loss([p])[1] for p in pairs]  # TRL logs batch means: one pair at a time
rewards = [[m["rewards/chosen"], m["rewards/rejected"]] for m in one]
np.save(os.path.join(out, "trl_rewards.npy"), np.asarray(rewards, np.float64))
with open(os.path.join(out, "pairs.json"), "w") as f:
  json.dump({"pairs": pairs, "trl_loss": batch_loss,
             "trl_metrics": {k: batch_metrics[k] for k in sorted(batch_metrics)
                             if k.startswith("rewards/")}}, f, indent=1)
print(batch_loss, batch_metrics, rewards)
