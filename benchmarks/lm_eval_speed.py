"""lm-eval requests per second: spmdtask's backend on 8 emulated devices vs lm-eval's own `hf`
backend (torch, CPU) on the same tiny HF Llama (tests/harness/data/lm_eval/model), side by side.

    python benchmarks/lm_eval_speed.py [--docs=64] [--batch_size=8] \
        [--torch_python=/work/torchenv/bin/python]

Writes three local tasks of `--docs` documents each (multiple choice: 4 loglikelihood
requests a document; rolling perplexity: a 40-200-token text; generation: 10 greedy tokens)
into a temp dir, imports the model into a temp job dir and runs lm-eval on both backends
with the same tasks and batch size. spmdtask's side runs twice in one process: the first pass
compiles its programs (a few row lengths), the second is warm. The hf side runs in a
subprocess of a Python that has torch and `lm-eval[hf]` (no torch here). Prints, per side,
the seconds of `simple_evaluate` and requests/s, and checks both gave the same metrics.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import common  # pylint: disable=unused-import  # 8 emulated devices, the repo on sys.path

from spmdtask.harness import command, tasks
from spmdtask.hf import model_overrides
from spmdtask.hf.jobs import imports
from spmdtask.run import rollout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "harness", "data", "lm_eval")
NAMES = ("tiny_mc", "tiny_ppl", "tiny_gen")

HF_SIDE = """
import json, sys, time
import lm_eval
from lm_eval.tasks import TaskManager
model, task_dir, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
manager = TaskManager(include_path=task_dir, include_defaults=False)
t0 = time.perf_counter()
out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32",
                              tasks=%s, batch_size=batch, device="cpu", task_manager=manager)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "results": out["results"]}))
""" % (list(NAMES),)


def write_tasks(directory: str, docs: int) -> int:
  """The fixture tasks' YAMLs over `docs` documents each; returns the requests they make."""
  rng = random.Random(0)
  words = ["cat", "dog", "sat", "on", "the", "mat", "one", "two", "three", "bird", "hand"]
  rows = {
      "tiny_mc": [{"question": f"What is {a} + {b}?", "answer": 0,
                   "choices": [str(a + b), str(a + b + 1), str(a * b), rng.choice(words)]}
                  for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(docs))],
      "tiny_ppl": [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(10, 60)))}
                   for _ in range(docs)],
      "tiny_gen": [{"prompt": f"Q: What is {a} + {b}?\nA:", "answer": f" {a + b}"}
                   for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(docs))],
  }
  for name, docs_of in rows.items():
    shutil.copy(os.path.join(FIXTURES, "tasks", f"{name}.yaml"), directory)
    with open(os.path.join(directory, f"{name}.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in docs_of)
  return 4 * docs + docs + docs  # (a rolling text of <= 128 tokens is one window)


def spmdtask_side(job: str, task_dir: str, batch_size: int):
  """[(seconds, results)] of two passes of lm-eval on spmdtask's backend."""
  imports.from_hf(os.path.join(FIXTURES, "model"), job)
  with open(os.path.join(job, model_overrides.OVERRIDES_FILE)) as f:
    lines = [l.strip().split("=", 1)[1] for l in f if l.startswith("--fdl_set=")]
  run = common.build("llama.LlamaImport", lines)
  lm, _ = tasks.backend(run, command.text_of(run, False), batch_size, job, None,
                        rollout.example(run))
  manager = tasks.find_tasks(NAMES, task_dir)
  passes = []
  for _ in range(2):
    t0 = time.perf_counter()
    results = tasks.evaluate(lm, tasks.Options(NAMES, task_dir), manager)
    passes.append((time.perf_counter() - t0, results["results"]))
  return passes


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--docs", type=int, default=64)
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--torch_python", default="/work/torchenv/bin/python")
  args = parser.parse_args()
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  with tempfile.TemporaryDirectory() as tmp:
    task_dir = os.path.join(tmp, "tasks")
    os.makedirs(task_dir)
    requests = write_tasks(task_dir, args.docs)
    ours = spmdtask_side(os.path.join(tmp, "job"), task_dir, args.batch_size)
    hf = subprocess.run([args.torch_python, "-c", HF_SIDE, os.path.join(FIXTURES, "model"),
                         task_dir, str(args.batch_size)], check=True, capture_output=True,
                        text=True, cwd=task_dir,  # lm-eval reads data_files from the cwd
                        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    theirs = json.loads(hf.stdout.strip().splitlines()[-1])
  print(f"lm-eval on {requests} requests ({args.docs} documents of each of {', '.join(NAMES)}), "
        f"batch size {args.batch_size}:")
  rows = [("spmdtask, 8 emulated devices, first pass (compiles)", ours[0][0]),
          ("spmdtask, 8 emulated devices, warm", ours[1][0]),
          ("lm-eval hf backend (torch CPU)", theirs["seconds"])]
  for what, seconds in rows:
    print(f"  {what:55s} {seconds:7.2f} s  {requests / seconds:8.1f} requests/s")
  for task in NAMES:
    a, b = ours[1][1][task], theirs["results"][task]
    same = all(abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])) for k in b
               if "," in k and isinstance(b[k], float))
    print(f"  {task}: metrics {'equal' if same else 'DIFFER'} "
          f"({', '.join(f'{k} {b[k]:.4g}' for k in b if ',' in k and isinstance(b[k], float))})")


if __name__ == "__main__":
  main()
