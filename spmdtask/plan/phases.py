"""A step's phases besides the train step (GRPO's sampling and scoring): their memory and,
on a chip, their time, and the RL step's time they make with the train step.

Each phase's program (a `Lowering` the task gives: `rollout_plan.sampling_lowerings`) is
compiled for the target and read as the train step is: XLA's FLOPs and HBM bytes per
device with loop bodies counted per trip (`xla_cost.per_step`) and the bytes each device
receives in collectives (`hlo.collective_ops`), each charged at the chip's rate; the
phase takes at least the largest (`roofline.estimate`).

A program with a data-dependent loop (the sampler's decode `while_loop`, which runs until
every sample has stopped) is read twice, that loop counted once and twice: the difference
is one trip (a decode iteration: every slot's next token), the rest what runs once (the
prompts' prefill, the cache's set-up, the output). Its time is then once + trips x one
trip, for the trips its `Lowering.loop` assumes (the sampler's worst case), each part
charged its FLOPs and collectives as XLA counts them and the HBM bytes it must read: the
weights (once for the prefill) and, each trip, the weights and the whole KV cache (slots or pool)
(memory-bound decoding). XLA's own HBM count is kept beside it: its cost analysis charges
an op on one layer's slice of a stacked array (a layer's weights sliced out for their
gather, the cache's in-place update) for the whole stack, in every layer.

The RL step's time (`rl_step`) is the sum of each phase's lower bound times its calls per
optimizer step: the phases run in turn, none overlapped with another.
"""
import jax

from spmdtask.plan import hlo, roofline, xla_cost
from spmdtask.plan.chips import Chip

COST_KEYS = ("flops", "hbm_bytes", "ici_bytes", "dcn_bytes")


def program_cost(text: str, num_slices: int = 1, unknown_trips: int = 1) -> dict[str, float]:
  """Per device per run of a compiled program (its optimized HLO `text`): FLOPs, HBM bytes
  and bytes received over ICI and DCN, a loop of unknown trips run `unknown_trips` times."""
  step = xla_cost.per_step(text, unknown_trips)
  traffic = roofline.collective_traffic(
      hlo.collective_ops(text, num_slices, unknown_trips=unknown_trips))
  return {"flops": step["flops"], "hbm_bytes": step["bytes accessed"],
          "ici_bytes": traffic["ici"], "dcn_bytes": traffic["dcn"]}


def loop_split(text: str, num_slices: int = 1) -> tuple[dict, dict]:
  """(what runs once, one trip of the loops of unknown trips) of a program's costs
  (`program_cost`'s keys): the program read with those loops run once and twice."""
  once, twice = program_cost(text, num_slices, 1), program_cost(text, num_slices, 2)
  trip = {k: twice[k] - once[k] for k in COST_KEYS}
  return {k: once[k] - trip[k] for k in COST_KEYS}, trip


def bound(chip: Chip, cost: dict) -> dict:
  """The roofline of `cost` (per device) on `chip`: each resource's seconds, the binding
  one and the lower bound."""
  est = roofline.estimate(chip, cost["flops"], cost["hbm_bytes"], cost["ici_bytes"],
                          cost["dcn_bytes"], 0.0, 0.0)
  return {"cost": cost, "seconds": est["seconds"], "bound": est["bound"],
          "seconds_lower_bound": est["step_seconds_lower_bound"], "notes": est["notes"]}


def estimate(chip: Chip, text: str, num_slices: int, loop=None) -> dict:
  """A phase's time on `chip`: its program's roofline; with `loop` (`layouts.Loop`: its
  data-dependent loop's assumed trips and the bytes it must read), what runs once + the
  trips x one trip, each charged for the HBM bytes it must read (`prefill_bytes` once,
  `weights_bytes` and `cache_bytes` a trip) beside XLA's FLOPs and collectives; XLA's own
  HBM count of each (`xla_hbm_bytes`: it charges an op on a layer's slice of a stacked array the whole
  stack, so it can run far above) gives `seconds_with_xla_hbm_bytes`."""
  if loop is None:
    return bound(chip, program_cost(text, num_slices))
  once, trip = loop_split(text, num_slices)
  prefill = loop.weights_bytes if loop.prefill_bytes is None else loop.prefill_bytes
  floors = (prefill, loop.weights_bytes + loop.cache_bytes)
  parts = [{**bound(chip, {**c, "hbm_bytes": floor}), "xla_hbm_bytes": c["hbm_bytes"],
            "xla_bound_seconds": bound(chip, c)["seconds_lower_bound"]}
           for c, floor in zip((once, trip), floors)]
  total = lambda key: parts[0][key] + loop.trips * parts[1][key]
  return {"once": parts[0], "trip": parts[1], "loop_trips": loop.trips,
          "loop_note": loop.note, "weights_bytes": loop.weights_bytes, "prefill_bytes": prefill,
          "cache_bytes": loop.cache_bytes,
          "unknown_loops": sum(l.trips is None for l in hlo.loops(text)),
          "seconds_lower_bound": total("seconds_lower_bound"),
          "seconds_with_xla_hbm_bytes": total("xla_bound_seconds")}


def report(lowerings, train_memory: dict, train_estimate: dict | None, chip: Chip | None,
           num_slices: int, compile_fn, memory_fn, refusal=()) -> list[dict]:
  """The plan's `phases`: the train step's first (its compiled memory `train_memory`, its
  roofline `train_estimate`), then each of `lowerings` compiled by `compile_fn(lowering)`:
  name, calls per optimizer step, compiled memory (`memory_fn(compiled)`) and, with a
  chip, its time (`estimate`); where the compiler refuses it (raises `refusal`, out of
  memory), its message's first line as `compiler_out_of_memory` instead."""
  out = [{"name": "training", "calls_per_step": 1, "compiled": train_memory}]
  if train_estimate is not None:
    out[0]["estimate"] = {"seconds_lower_bound": train_estimate["step_seconds_lower_bound"],
                          "bound": train_estimate["bound"]}
  for lw in lowerings:
    row = {"name": lw.name, "calls_per_step": lw.calls_per_step}
    try:
      compiled = compile_fn(lw)
    except refusal as e:
      out.append({**row, "compiler_out_of_memory": str(e).splitlines()[0]})
      continue
    row["compiled"] = memory_fn(compiled)
    if chip is not None:
      try:
        text = compiled.as_text()
      except jax.errors.JaxRuntimeError:  # libtpu newer than jaxlib: no estimate
        text = None
      if text is not None:
        row["estimate"] = estimate(chip, text, num_slices, lw.loop)
    out.append(row)
  return out


def rl_step(phases: list[dict]) -> dict | None:
  """The RL step's time per optimizer step: each phase's lower bound x its calls per step,
  summed (None unless every phase has an estimate)."""
  if not phases or any("estimate" not in p for p in phases):
    return None
  parts = {p["name"]: p["calls_per_step"] * p["estimate"]["seconds_lower_bound"]
           for p in phases}
  return {"seconds_lower_bound": sum(parts.values()), "parts": parts}
