"""GRPO's sampling phase vs decode mode: tokens/s of the same model, batch and decode params.

    python benchmarks/grpo_sampling.py [--prompts=8] [--generations=8] [--new_tokens=64]
                                       [--repeats=5]

The model is TinyLmGrpo's (TinyLm, byte vocabulary) on all local devices; params fresh.
The sampling phase (`run.rollout.Sampler.sample`: B prompts x G samples, temperature 1)
and decode mode's per-batch work (`run.decoding.decode_batch` on the same B·G rows, the
same DecodeParams) are each compiled, then timed `--repeats` times alternately; the medians'
tokens/s and their ratio are printed, with the decode programs' compile counts (1 each).
"""
import argparse
import statistics
import time

import common  # pylint: disable=unused-import  (the repository on sys.path; 8 CPU devices)
import jax
import numpy as np

from configs import grpo as grpo_configs  # pylint: disable=unused-import  (registers)
from spmdtask.core import program as program_lib
from spmdtask.inputs.answers import SumPrompts
from spmdtask.objectives.grpo import Grpo
from spmdtask.run import decoding, rollout


def bench(prompts: int, generations: int, new_tokens: int, repeats: int) -> dict:
  run = common.build("TinyLmGrpo", [f"datasets['train'].batch_size={prompts}",
                                    f"task.objective.num_generations={generations}",
                                    f"task.objective.max_new_tokens={new_tokens}"])
  obj: Grpo = run.task.objective
  inputs = run.datasets["train"]
  program = program_lib.setup(run.task, rollout.example(run))
  params = program.init().params
  sampler = rollout.Sampler(program, obj, prompts, inputs.local_batch_size, inputs.prompt_len)
  rows = rollout.repeat_prompts(inputs.batch_at(0), generations)
  n = prompts * generations

  def sample():
    out = sampler.sample(params, inputs.batch_at(0))
    return sum(len(s["output_ids"]) for s in out)

  def decode():
    out = decoding.decode_batch(sampler.decoder, params, rows, n)
    return sum(len(s["output_ids"]) for s in out)

  sample(), decode()  # compile
  times = {"sample": [], "decode": []}
  tokens = {}
  for _ in range(repeats):
    for name, fn in (("sample", sample), ("decode", decode)):
      t0 = time.perf_counter()
      tokens[name] = fn()
      times[name].append(time.perf_counter() - t0)
  rate = {k: tokens[k] / statistics.median(v) for k, v in times.items()}
  return {"rows": n, "tokens": tokens, "sample_tok_s": rate["sample"],
          "decode_tok_s": rate["decode"], "ratio": rate["sample"] / rate["decode"],
          "compiles": (sampler.decoder.prefill.jitted._cache_size(),  # pylint: disable=protected-access
                       sampler.decoder.step.jitted._cache_size())}  # pylint: disable=protected-access


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--generations", type=int, default=8)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  r = bench(args.prompts, args.generations, args.new_tokens, args.repeats)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; {r['rows']} rows "
        f"({args.prompts} prompts x {args.generations}), up to {args.new_tokens} new tokens")
  print(f"sampling phase {r['sample_tok_s']:9.1f} tok/s  decode {r['decode_tok_s']:9.1f} tok/s  "
        f"ratio {r['ratio']:.3f}  (prefill, step compiled {r['compiles']})")


if __name__ == "__main__":
  main()
