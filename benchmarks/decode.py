"""Decode throughput: the KV-cache decoder vs rerunning the full forward pass per token.

    python benchmarks/decode.py [--new_tokens=64,256] [--batch=8] [--prompt_len=16]

The model is TinyLm's (d 128, 4 layers, 1.1M params) with max_seq_len raised to fit;
params are freshly initialized (speed does not depend on them). Both decoders are greedy,
run on all local devices (data parallel), are compiled before timing, and must produce
the same tokens. The baseline is the static-shape no-cache decoder: each token reruns
the forward pass over the fixed [batch, prompt_len + new_tokens] buffer.
Prints tokens/s of each and their ratio for every --new_tokens.
"""
import argparse
import dataclasses
import time

import common  # pylint: disable=unused-import  (the repository on sys.path; 8 CPU devices)
import fiddle as fdl
import jax

from configs import lm
from spmdtask.run import decoding
from spmdtask.core import program as program_lib
from spmdtask.inputs.prompts import SyntheticPromptInput
from spmdtask.task import DecodeParams
from tests import oracles  # the no-cache greedy decoder is the baseline


def bench(new_tokens: int, batch: int, prompt_len: int) -> dict:
  max_len = prompt_len + new_tokens
  exp = lm.TinyLm()
  task = fdl.build(exp.task())
  task.model = dataclasses.replace(task.model, max_seq_len=max_len)
  program = program_lib.setup(task, fdl.build(exp.datasets()["train"]).batch_at(0))
  params = program.init().params
  prompts = SyntheticPromptInput(batch_size=batch, prompt_len=prompt_len,
                                 min_prompt_len=prompt_len, num_examples=batch).batch_at(0)
  dp = DecodeParams(max_decode_len=max_len)
  decoder = decoding.build(program, dp, batch, prompt_len)
  fwd = oracles.build_full_forward(program)
  # Compile both (one full run of the cached decoder, two baseline steps).
  decoding.decode_batch(decoder, params, prompts, batch, check_every=1 << 30)
  oracles.greedy_without_cache(program, params, prompts["prompts"], prompts["prompt_lens"],
                                max_len, num_steps=2, fwd=fwd)

  t0 = time.perf_counter()
  out = decoding.decode_batch(decoder, params, prompts, batch, check_every=1 << 30)
  t_cache = time.perf_counter() - t0
  t0 = time.perf_counter()
  ref = oracles.greedy_without_cache(program, params, prompts["prompts"],
                                      prompts["prompt_lens"], max_len, fwd=fwd)
  t_full = time.perf_counter() - t0
  assert all(r["output_ids"] == ref[r["id"], prompt_len:].tolist() for r in out), "mismatch"
  tokens = batch * new_tokens
  return {"new_tokens": new_tokens, "cache_tok_s": tokens / t_cache,
          "full_forward_tok_s": tokens / t_full, "ratio": t_full / t_cache,
          "step_compiles": decoder.step.jitted._cache_size()}  # pylint: disable=protected-access


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--new_tokens", default="64,256")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt_len", type=int, default=16)
  args = parser.parse_args()
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; batch {args.batch}, "
        f"prompt {args.prompt_len}")
  for n in (int(x) for x in args.new_tokens.split(",")):
    r = bench(n, args.batch, args.prompt_len)
    print(f"new_tokens={n:4d}  kv-cache {r['cache_tok_s']:9.1f} tok/s  full-forward "
          f"{r['full_forward_tok_s']:8.1f} tok/s  ratio {r['ratio']:6.1f}x  "
          f"(per-token step compiled {r['step_compiles']}x)", flush=True)


if __name__ == "__main__":
  main()
