"""Makes tests/harness/data/lm_eval (torch, transformers, lm-eval[hf]; run offline, from anywhere).

    /work/torchenv/bin/python tests/harness/data/lm_eval/make_lm_eval.py model   # model/
    /work/torchenv/bin/python tests/harness/data/lm_eval/make_lm_eval.py tasks   # tasks/*.jsonl
    /work/torchenv/bin/python tests/harness/data/lm_eval/make_lm_eval.py reference

`model`: a tiny random LlamaForCausalLM (2 layers, d_model 32, 4 heads / 2 KV heads of 8,
SwiGLU 64, vocab 300, 128 positions, float32; weights N(0, 0.15²), norms 1 + N(0, 0.2²) so
that greedy margins are not tiny) with examples/tiny_chat/model's tokenizer and chat template.
`reference`: lm-eval's own `hf` backend (batch size 1, float32, CPU) on model/ and the local
tasks of tasks/ (multiple choice, rolling perplexity, generation; the generation task's
stop string, "\\f", was chosen as one its greedy outputs hold), written to expected.json: per task
its metrics and, per document, the responses (log-likelihoods with is_greedy, rolling
log-likelihoods, generated strings); `chat` runs the generation task with the chat template.
"""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
MODEL = os.path.join(HERE, "model")
TASKS = os.path.join(HERE, "tasks")
TOKENIZER = os.path.join(REPO, "examples", "tiny_chat", "model")


def model():
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import LlamaConfig, LlamaForCausalLM  # pylint: disable=import-outside-toplevel
  cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=3, eos_token_id=6)
  torch.manual_seed(0)
  lm = LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for p in lm.parameters():
      p.normal_(0, 0.15 if p.ndim > 1 else 0.2).add_(1.0 if p.ndim == 1 else 0.0)
  lm.save_pretrained(MODEL)
  os.remove(os.path.join(MODEL, "generation_config.json"))
  for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(os.path.join(TOKENIZER, f), MODEL)


def tasks():
  """The tasks' JSONL files: 8 sums with 5 choices each, the fifth the model's greedy token
  after the prompt (the task's choices follow the prompt with no space: four of the sums are
  ones whose greedy token is text that tokenizes back to itself, so that those choices are
  greedy continuations: is_greedy True), 4 texts (one of 60 words: more than 128 tokens),
  6 prompts."""
  import random  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from transformers import AutoModelForCausalLM, AutoTokenizer
  lm = AutoModelForCausalLM.from_pretrained(MODEL).eval()
  tok = AutoTokenizer.from_pretrained(MODEL)

  def greedy(a, b):
    ids = tok(f"Question: What is {a} + {b}?\nAnswer:")["input_ids"]
    with torch.no_grad():
      g = int(lm(torch.tensor([ids])).logits[0, -1].argmax())
    text = tok.decode([g])
    again = tok(f"Question: What is {a} + {b}?\nAnswer:{text}")["input_ids"]
    return text, again == ids + [g] and "\ufffd" not in text

  rng = random.Random(0)
  sums = [(a, b) for a in range(10) for b in range(10)]
  clean = [ab for ab in sums if greedy(*ab)[1]][:4]
  picked = clean + rng.sample([ab for ab in sums if ab not in clean], 4)
  animals = ["cat", "dog", "bird", "fish", "horse", "cow", "sheep", "goat"]
  with open(os.path.join(TASKS, "tiny_mc.jsonl"), "w") as f:
    for i, (a, b) in enumerate(picked):
      choices = [str(a + b), str(a + b + 1), str(abs(a - b) + 2), animals[i], greedy(a, b)[0]]
      f.write(json.dumps({"question": f"What is {a} + {b}?", "choices": choices, "answer": 0})
              + "\n")
  texts = ["The cat sat on the mat and looked at the dog.",
           "One, two, three, four, five, six, seven, eight, nine, ten.",
           "A bird in the hand is worth two in the bush.",
           " ".join(f"{w} {n}" for n in range(30) for w in ["count", "step"])]
  with open(os.path.join(TASKS, "tiny_ppl.jsonl"), "w") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
  with open(os.path.join(TASKS, "tiny_gen.jsonl"), "w") as f:
    for a, b in ((1, 2), (3, 4), (5, 1), (2, 2), (7, 0), (4, 4)):
      f.write(json.dumps({"prompt": f"Q: What is {a} + {b}?\nA:", "answer": f" {a + b}"}) + "\n")


def evaluate(tasks, **kwargs):
  import lm_eval  # pylint: disable=import-outside-toplevel
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  out = lm_eval.simple_evaluate(
      model="hf", model_args=f"pretrained={MODEL},dtype=float32", tasks=tasks, batch_size=1,
      device="cpu", log_samples=True, task_manager=TaskManager(include_path=TASKS), **kwargs)
  return {t: {"metrics": {k: v for k, v in out["results"][t].items() if k != "alias"},
              "responses": [[list(r) if isinstance(r, (list, tuple)) else r for r in s["resps"]]
                            for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])]}
          for t in tasks}


def reference():
  os.chdir(TASKS)  # the task YAMLs name their jsonl files relative to it (lm-eval reads
  # them from the working dir; spmdtask's --mode=lm_eval from --lm_eval_include_path)
  want = evaluate(["tiny_mc", "tiny_ppl", "tiny_gen"])
  want["chat"] = evaluate(["tiny_gen"], apply_chat_template=True)["tiny_gen"]
  with open(os.path.join(HERE, "expected.json"), "w") as f:
    json.dump(want, f, indent=1)


if __name__ == "__main__":
  {"model": model, "tasks": tasks, "reference": reference}[sys.argv[1]]()
