"""Makes and checks tests/hf/data/chat_export (torch, transformers, peft; run offline).

    python make_chat_export.py reference        # (torch) adapter/ and expected.json
    python tools/convert_hf.py ...              # (spmdtask) the exports (see README.md)
    python make_chat_export.py check BASE_OUT MERGED_OUT   # (torch) transformers loads them

`reference`: a random PEFT LoRA adapter of examples/tiny_chat/model (rank 4, alpha 8, every
Linear, A and B random so that it changes the greedy tokens) in adapter/, and
expected.json: for each prompt of examples/tiny_chat/prompts.jsonl, the ids
`apply_chat_template(..., add_generation_prompt=True)` gives and the greedy tokens
transformers generates (eos: the end-of-turn token) from the base model and from the base
with the adapter merged (PEFT's merge_and_unload), with the smallest top-2 logit margin.
`check`: loads each export with AutoModelForCausalLM / AutoTokenizer from its dir alone,
renders the prompts with its chat template and generates with its generation_config.json;
the tokens must equal expected.json's.
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
MODEL = os.path.join(REPO, "examples", "tiny_chat", "model")
PROMPTS = os.path.join(REPO, "examples", "tiny_chat", "prompts.jsonl")
NEW_TOKENS = 24


def prompts():
  with open(PROMPTS) as f:
    return [json.loads(line)["messages"] for line in f]


def greedy(model, tok, generation_config=None):
  out = []
  for messages in prompts():
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         generation_config=generation_config)
    new = gen.sequences[0, len(ids):].tolist()
    margin = min(float((s[0].topk(2).values[0] - s[0].topk(2).values[1])) for s in gen.scores)
    out.append({"prompt_ids": ids, "output_ids": new, "min_margin": margin})
  return out


def reference():
  from peft import LoraConfig, get_peft_model  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  tok = AutoTokenizer.from_pretrained(MODEL)
  base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
  eot = tok.convert_tokens_to_ids("<|eot_id|>")
  base.generation_config.eos_token_id = eot
  want = {"base": greedy(base, tok)}
  peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                               lora_dropout=0.0))
  with torch.no_grad():
    for name, p in peft_model.named_parameters():
      if "lora_" in name:
        p.copy_(torch.randn_like(p) * 0.5)
  out = os.path.join(HERE, "adapter")
  peft_model.save_pretrained(out)
  # PEFT lists "all-linear" as every module's path: the same adapter by module names, as
  # users' adapters name them; its base as this repo's path; no README.md; ordinary modes.
  with open(os.path.join(out, "adapter_config.json")) as f:
    cfg = json.load(f)
  cfg["target_modules"] = sorted({m.split(".")[-1] for m in cfg["target_modules"]})
  cfg["base_model_name_or_path"] = "examples/tiny_chat/model"
  with open(os.path.join(out, "adapter_config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
  os.remove(os.path.join(out, "README.md"))
  for name in os.listdir(out):
    os.chmod(os.path.join(out, name), 0o644)
  merged = peft_model.merge_and_unload().eval()
  want["merged"] = greedy(merged, tok)
  with open(os.path.join(HERE, "expected.json"), "w") as f:
    json.dump(want, f, indent=1)
  for k, rows in want.items():
    print(k, [r["output_ids"] for r in rows], min(r["min_margin"] for r in rows))


def check(base_out, merged_out):
  with open(os.path.join(HERE, "expected.json")) as f:
    want = json.load(f)
  for name, out in (("base", base_out), ("merged", merged_out)):
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    got = greedy(model, tok)
    for g, w in zip(got, want[name]):
      assert g["prompt_ids"] == w["prompt_ids"], (name, g, w)
      assert g["output_ids"] == w["output_ids"], (name, g, w)
    print(f"{name}: {out} loads, renders and generates expected.json's tokens "
          f"({sum(len(g['output_ids']) for g in got)} tokens, eos "
          f"{model.generation_config.eos_token_id})")


if __name__ == "__main__":
  if sys.argv[1] == "reference":
    reference()
  else:
    check(*sys.argv[2:4])
