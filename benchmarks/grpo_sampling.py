"""GRPO's sampling phase: today's per-token sampler vs the on-device one, side by side.

    python benchmarks/grpo_sampling.py [--prompts=8] [--generations=8] [--new_tokens=128]
                                       [--slots=8,16] [--pages=16/128,16/64,64/128]
                                       [--page_size=16] [--repeats=3]

The model is TinyLmGrpo's (TinyLm, byte vocabulary) on all local devices (8 emulated CPU
devices); params fresh; temperature 1. Two length modes, each timed for every sampler in
one process, alternately, `--repeats` times (medians):

- `full`: no stop id: every sample runs to `--new_tokens`.
- `long_tail`: completion lengths like real RL's: geometric with mean new_tokens / 8, capped
  at new_tokens. The stop decision is seeded: after the token t fed at position p, the end
  byte (256) is forced (a logits bias, in this benchmark's model wrapper only) when a
  uniform drawn from (seed, p, t) is below 8 / new_tokens. A sample's tokens are the same in
  every sampler (draws from (seed, id, position)), so every sampler sees the same lengths.

Samplers: `today` (`rollout.TokenLoopSampler`: B·G rows, a jitted step per token from the
host, a stopped row idles until the batch is done), `device` (`rollout.Sampler` with one
slot per sample: shared prefill, one while_loop) and `pool S` (the same with S slots,
refilled as samples finish), and `paged S/P` (S slots whose completions' KV shares a pool of P
pages of `--page_size` tokens, the prompts' KV read where the prefill left it: `run.pages`;
a sample waits for a page or is preempted and re-run, `preempted` counts those). Printed:
useful tokens/s (completion tokens / the sampling call's seconds), the ratio to today's,
slot utilization (decode slot-steps that produced a token / all decode slot-steps run: the
on-device samplers' `Samples.slot_steps`, each loop's iterations x its slots summed over
the loops, a loop per data shard where the layout takes them (`sampling.per_shard_loops`;
TinyLmGrpo's data-parallel mesh does); today's: rows x the longest sample's steps) and the
sampling programs' peak memory per device (compiled memory_analysis, as the plan reads it).
"""
import argparse
import dataclasses
import statistics
import time

import common  # pylint: disable=unused-import  (the repository on sys.path; 8 CPU devices)
import jax
import jax.numpy as jnp

from configs import grpo as grpo_configs  # pylint: disable=unused-import  (registers)
from spmdtask.core import global_batch, program as program_lib
from spmdtask.plan import planner
from spmdtask.run import decoding, rollout

END = 256  # TinyLmGrpo's end byte


@dataclasses.dataclass(frozen=True)
class SeededStops:
  """The model, its next-token logits forced to END where the seeded draw says stop."""
  model: object
  stop_prob: float
  seed: int = 0

  def apply(self, variables, tokens, positions, cache=None, **kw):
    logits, cache = self.model.apply(variables, tokens, positions, cache, **kw)
    key = jax.random.key(self.seed)
    u = jax.vmap(jax.vmap(lambda p, t: jax.random.uniform(
        jax.random.fold_in(jax.random.fold_in(key, p), t))))(positions, tokens)
    force = jnp.where(jnp.arange(logits.shape[-1]) == END, 0.0, -1e9)
    return jnp.where((u < self.stop_prob)[..., None], force, logits), cache

  def __getattr__(self, name):
    return getattr(self.model, name)


class WithModel:
  """`program` with another model (the samplers read program.model)."""

  def __init__(self, program, model):
    self._program, self.model = program, model

  def __getattr__(self, name):
    return getattr(self._program, name)


def samplers(run, program, slots: list[int], stops, paged=(), page_size: int = 16) -> dict:
  """{name: sampler}: today's, the device's, a pool per `slots` and a paged pool per
  (slots, pages) of `paged`."""
  obj, inputs = run.task.objective, run.datasets["train"]
  args = (int(inputs.batch_size), int(inputs.local_batch_size), int(inputs.prompt_len), stops)
  out = {"today": rollout.TokenLoopSampler(program, obj, *args),
         "device": rollout.Sampler(program, obj, *args)}
  for s in slots:
    pooled = dataclasses.replace(obj, sampler_slots=s)
    out[f"pool {s}"] = rollout.Sampler(program, pooled, *args)
  for s, pages in paged:
    pooled = dataclasses.replace(obj, sampler_slots=s, sampler_kv_pages=pages,
                                 sampler_page_size=page_size)
    out[f"paged {s}/{pages}"] = rollout.Sampler(program, pooled, *args)
  return out


def utilization(name: str, sampler, samples, new_tokens: int) -> float:
  """Decode slot-steps that produced a useful token / all run (the on-device samplers':
  busy / slot_steps, summed over their loops). Today's rows run until the longest stops (a row with a shorter prompt may run past new_tokens: not useful)."""
  if name != "today":
    return sampler.utilization
  steps = max(len(s["output_ids"]) for s in samples) - 1
  useful = sum(min(len(s["output_ids"]), new_tokens) - 1 for s in samples)
  return useful / max(len(samples) * steps, 1)


def peak_mib(name: str, sampler, params, local) -> float:
  """The sampler's compiled programs' peak per device (memory_analysis, as the plan reads
  it; today's: the larger of its prefill and per-token step), MiB."""
  if name == "today":
    dec = sampler.decoder
    rows = decoding.pad_prompts(rollout.repeat_prompts(local, sampler.group), sampler.local_rows)
    g = global_batch.to_global(rows, {"prompts": dec.specs.tokens, "prompt_lens": dec.specs.pos,
                                      "ids": dec.specs.ids}, dec.mesh)
    args = (params, g["prompts"], g["prompt_lens"], g["ids"])
    state = dec.prefill(*args)[0]
    compiled = [dec.prefill.lower(*args).compile(), dec.step.lower(params, state).compile()]
  else:
    compiled = [sampler.generate.program.lower(
        params, *sampler.generate.global_prompts(local)).compile()]
  return max(planner.compiled_memory(c)["peak_estimate_bytes"] for c in compiled) / 2**20


def bench(run, program, params, mode: str, slots: list[int], repeats: int,
          others=None, paged=(), page_size: int = 16) -> dict:
  """Every sampler's rows (useful tokens/s, ratio to today's, utilization, peak). `others`:
  `f(lengths) -> {name: call}` given the samples' lengths (prompt-major), each call timing
  one sampling of another library's and returning its seconds: timed in turn with ours
  (benchmarks/grpo_sampling_tunix.py), their tokens/s in the result's `others`."""
  new_tokens = run.task.objective.max_new_tokens
  if mode == "long_tail":
    program = WithModel(program, SeededStops(program.model, 8 / new_tokens))
  found = samplers(run, program, slots, (END,) if mode == "long_tail" else (), paged, page_size)
  local = run.datasets["train"].batch_at(0)
  outputs = {name: s.sample(params, local) for name, s in found.items()}  # compiles
  lengths = [len(o["output_ids"][:new_tokens]) for o in outputs["today"]]
  others = others(lengths) if others else {}
  times = {name: [] for name in [*found, *others]}
  for _ in range(repeats):  # in turn, so a change in the shared machine's load hits all
    for name, s in found.items():
      t0 = time.perf_counter()
      outputs[name] = s.sample(params, local)
      times[name].append(time.perf_counter() - t0)
    for name, call in others.items():
      times[name].append(call())
  useful = {name: [o["output_ids"][:new_tokens] for o in out] for name, out in outputs.items()}
  same = {name: out == useful["today"] for name, out in useful.items()}
  tokens = sum(map(len, useful["today"]))
  rows = {}
  for name, s in found.items():
    rate = tokens / statistics.median(times[name])
    rows[name] = {"tok_s": rate, "util": utilization(name, s, outputs[name], new_tokens),
                  "same": same[name], "peak": peak_mib(name, s, params, local),
                  "preempted": getattr(s, "preempted", 0)}
  base = rows["today"]["tok_s"]
  for r in rows.values():
    r["ratio"] = r["tok_s"] / base
  return {"tokens": tokens, "samples": len(outputs["today"]), "rows": rows,
          "others": {name: tokens / statistics.median(times[name]) for name in others}}


def arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """The batch's and the samplers' flags (this benchmark's and grpo_sampling_tunix.py's)."""
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--generations", type=int, default=8)
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--slots", default="8,16", help="pool sizes, comma-separated")
  parser.add_argument("--pages", default="16/128,16/64,64/128",
                      help="paged pools, SLOTS/PAGES comma-separated ('' for none)")
  parser.add_argument("--page_size", type=int, default=16, help="tokens of a KV page")
  parser.add_argument("--modes", default="long_tail,full")
  parser.add_argument("--repeats", type=int, default=3)
  return parser


def setup(args) -> tuple:
  """(run, program, fresh params, pool sizes) of TinyLmGrpo at the flags' batch."""
  run = common.build("TinyLmGrpo", [f"datasets['train'].batch_size={args.prompts}",
                                    f"task.objective.num_generations={args.generations}",
                                    f"task.objective.max_new_tokens={args.new_tokens}",
                                    "task.objective.temperature=1.0"])
  program = program_lib.setup(run.task, rollout.example(run))
  return run, program, program.init().params, [int(s) for s in args.slots.split(",") if s]


def paged_pools(args) -> list[tuple[int, int]]:
  """The --pages flag's (slots, pages) pairs."""
  return [tuple(int(x) for x in p.split("/")) for p in args.pages.split(",") if p]


def main():
  args = arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args()
  run, program, params, slots = setup(args)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; "
        f"{args.prompts} prompts x {args.generations} samples, up to {args.new_tokens} new tokens")
  for mode in args.modes.split(","):
    r = bench(run, program, params, mode, slots, args.repeats, paged=paged_pools(args),
              page_size=args.page_size)
    print(f"\n{mode}: {r['tokens']} completion tokens in {r['samples']} samples "
          f"(mean {r['tokens'] / r['samples']:.1f})")
    print(f"  {'sampler':<14} {'useful tok/s':>12} {'vs today':>9} {'slot util':>9} "
          f"{'peak MiB':>9} {'preempted':>9}  same samples")
    for name, row in r["rows"].items():
      print(f"  {name:<14} {row['tok_s']:12.1f} {row['ratio']:8.2f}x {row['util']:9.2f} "
            f"{row['peak']:9.2f} {row['preempted']:9d}  {row['same']}")


if __name__ == "__main__":
  main()
