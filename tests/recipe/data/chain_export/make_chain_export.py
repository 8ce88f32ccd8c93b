"""Makes tests/recipe/data/chain_export/expected.json (torch, transformers; run offline):

    /work/torchenv/bin/python tests/recipe/data/chain_export/make_chain_export.py

Runs the Llama chain of tests/recipe/test_runner.py (its recipe, `_chain` with
`LLAMA_STEPS`, uninterrupted: that test checks that the chain killed mid-DPO and rerun ends
with the uninterrupted run's params, bitwise) through spmdtask, with the repo's `python` in a
subprocess and the test suite's environment (tests/subproc.env: one CPU device, its XLA
flags). Then transformers loads the chain's merged export from its dir alone
(`AutoModelForCausalLM`, `AutoTokenizer`), renders each prompt of
examples/tiny_chat/prompts.jsonl with the export's chat template (generation prompt on) and
generates greedily with the export's generation_config.json (eos: the end-of-turn token).
expected.json: for each prompt, its ids (`prompt_ids`), the generated tokens (`output_ids`)
and the top-1 minus top-2 logit margin at each generated position (`margins`).
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
PROMPTS = os.path.join(REPO, "examples", "tiny_chat", "prompts.jsonl")
NEW_TOKENS = 8
CHAIN = """
import pathlib, subprocess, sys
from tests import subproc as h
from tests.recipe import test_runner as t
tmp = pathlib.Path(sys.argv[1])
recipe = t._chain(tmp, f"{t.EXAMPLE}/model", *t.LLAMA_STEPS)
subprocess.run([sys.executable, "-m", "spmdtask.recipe", f"--recipe={recipe}"], env=h.env(1),
               cwd=h.REPO, check=True)
"""


def greedy(export: str) -> list[dict]:
  model = AutoModelForCausalLM.from_pretrained(export).eval()
  tok = AutoTokenizer.from_pretrained(export)
  out = []
  with open(PROMPTS) as f:
    for line in f:
      ids = tok.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True,
                                    return_dict=False)
      ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
      gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           output_scores=True, return_dict_in_generate=True)
      top2 = [s[0].topk(2).values for s in gen.scores]
      out.append({"prompt_ids": ids, "output_ids": gen.sequences[0, len(ids):].tolist(),
                  "margins": [float(t[0] - t[1]) for t in top2]})
  return out


def main():
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run(["python", "-c", CHAIN, tmp], cwd=REPO, check=True,
                   env={**os.environ, "PYTHONPATH": REPO})
    rows = greedy(os.path.join(tmp, "export"))
  with open(os.path.join(HERE, "expected.json"), "w") as f:
    json.dump(rows, f, indent=1)
  for r in rows:
    print(r["output_ids"], f"smallest margin {min(r['margins']):.4f}")


if __name__ == "__main__":
  sys.exit(main())
