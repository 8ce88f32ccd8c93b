"""The roofline of a step that runs several programs on disjoint submeshes (an MPMD
pipeline's stages): per program, per stage, and for the step.

  program  one call, per device of its submesh (`measure`): XLA's FLOPs and HBM bytes of
           its optimized program, loop bodies counted per trip (`xla_cost.per_step`), plus
           the FLOPs of its Pallas kernels traced per call (`remat_cost.step_flops`: XLA
           counts none inside a kernel's custom call), the bytes it receives in its
           collectives, and its offloaded bytes over the host link;
  stage    the sum over its programs of each one's numbers times its calls per step,
           and the bytes it sends to other stages (activations forward, gradients back)
           spread over its chips: `roofline.estimate` of these is the stage's busy time
           per resource, the largest its busy time (`step_estimate`, pure);
  step     each stage runs its programs one after another on its own chips, so the step
           takes at least the busiest stage's busy time: the lower bound, and with it the
           tokens/s and MFU ceilings (model FLOPs / (bound x peak x all chips of the step)).
           The schedule's bubble (stages waiting on each other) is not in the bound;
           busy / (1 - bubble) per stage, with the simulator's bubble under equal F/B/W
           costs, is given beside it as an estimate, never as a bound.
"""
import dataclasses

import jax

from spmdtask.plan import hlo, overlap, remat_cost, roofline, xla_cost


@dataclasses.dataclass(frozen=True)
class ProgramCost:
  """One program's costs per call, per device of its submesh (FLOPs include `kernel_flops`,
  its Pallas kernels' traced FLOPs)."""
  name: str
  stage: int
  devices: int
  calls_per_step: int
  flops: float
  kernel_flops: float = 0.0
  flops_loop_bodies_once: float = 0.0  # XLA's own count: each loop body once, no kernels
  hbm_bytes: float = 0.0
  ici_bytes: float = 0.0
  dcn_bytes: float = 0.0
  host_bytes: float = 0.0
  collectives: dict = dataclasses.field(default_factory=dict)  # hlo.collectives of one call
  note: str | None = None  # what could not be read from the compiled program
  schedule: dict | None = None  # overlap.estimate of one call (with a chip's facts)


def measure(lowering, compiled, num_slices: int = 1, chip=None,
            host_of: tuple[int, ...] | None = None) -> ProgramCost:
  """`ProgramCost` of a compiled `layouts.Lowering`. Its Pallas kernels' FLOPs are traced
  (from the lowering's fn and args) where the compiled program calls kernels XLA cannot
  see into (XLA:TPU's custom calls; interpret-mode kernels are XLA ops it counts). With
  a `chip`, its schedule's estimate of one call too (`overlap.estimate`); `host_of`: the
  host of each device of its submesh (GPUs: collectives across hosts)."""
  n, note = lowering.mesh.devices.size, None
  once = compiled.cost_analysis()
  once = (once[0] if isinstance(once, list) else once) or {}
  try:
    text = compiled.as_text()
  except jax.errors.JaxRuntimeError as e:  # libtpu newer than jaxlib (planner.compiled_report)
    text = None
    note = (f"{lowering.name}: XLA's optimized program could not be read back "
            f"({str(e).splitlines()[0][:120]}): its FLOPs and HBM bytes count loop bodies "
            "once, its collectives and kernels are not counted.")
  if text is None:
    step, ops, kernels = {k: float(once.get(k, 0.0)) for k in xla_cost.KEYS}, [], 0.0
  else:
    step, ops = xla_cost.per_step(text), hlo.collective_ops(text, num_slices, host_of)
    kernels = (remat_cost.step_flops(lowering)[1] / n
               if hlo.kernel_calls(text) and lowering.fn is not None else 0.0)
  traffic = roofline.collective_traffic(ops)
  host = remat_cost.host_transfer_bytes(compiled.memory_analysis())
  schedule = None
  if chip is not None and text is not None:
    bound = roofline.estimate(chip, step["flops"] + kernels, step["bytes accessed"],
                              traffic["ici"], traffic["dcn"], 0.0, 1.0, host)
    schedule = overlap.estimate(text, chip, step["flops"] + kernels, step["bytes accessed"],
                                kernels, num_slices, bound["step_seconds_lower_bound"],
                                host_of=host_of)
  return ProgramCost(
      lowering.name, lowering.stage, n, lowering.calls_per_step, step["flops"] + kernels,
      kernels, float(once.get("flops", 0.0)), step["bytes accessed"], traffic["ici"],
      traffic["dcn"], host, hlo.by_kind(ops), note, schedule)


def stage_sums(costs: list[ProgramCost], num_stages: int) -> list[dict]:
  """Per stage, per device per step: the sums over its programs of each one's numbers
  times its calls per step, its devices, and its collectives by kind. Pure."""
  out = []
  for s in range(num_stages):
    mine = [c for c in costs if c.stage == s]
    total = lambda key: sum(getattr(c, key) * c.calls_per_step for c in mine)
    colls: dict[str, dict[str, int]] = {}
    for c in mine:
      for kind, row in c.collectives.items():
        acc = colls.setdefault(kind, {"count": 0, "bytes": 0})
        acc["count"] += row["count"] * c.calls_per_step
        acc["bytes"] += row["bytes"] * c.calls_per_step
    out.append({"devices": max((c.devices for c in mine), default=0),
                **{k: total(k) for k in ("flops", "kernel_flops", "flops_loop_bodies_once",
                                         "hbm_bytes", "ici_bytes", "dcn_bytes", "host_bytes")},
                "collectives": colls})
  return out


def step_estimate(sums: list[dict], sent_bytes: list[float], bubbles: list[float], chip,
                  model_flops: float, tokens: float, num_devices: int) -> tuple[list, dict]:
  """(per stage `roofline.estimate`s, the step's estimate) from `stage_sums`. Pure.

  `sent_bytes` per stage: the bytes it sends to other stages per step (over its chips);
  `bubbles` per stage: the simulator's bubble fraction; `model_flops` and `tokens`: the
  whole step's; `num_devices`: every chip of the step. The step's estimate is the busiest
  stage's (`seconds`, `bound`, `step_seconds_lower_bound`, the ceilings), with `stage`
  naming it and `step_seconds_with_bubble_estimate` = max over stages of
  busy / (1 - bubble).
  """
  stages = [roofline.estimate(chip, st["flops"], st["hbm_bytes"], st["ici_bytes"],
                              st["dcn_bytes"], model_flops / num_devices, tokens,
                              st["host_bytes"], sent / max(st["devices"], 1))
            for st, sent in zip(sums, sent_bytes)]
  busy = [e["step_seconds_lower_bound"] for e in stages]
  s = max(range(len(stages)), key=busy.__getitem__)
  with_bubble = max(b / (1.0 - f) if f < 1.0 else float("inf") for b, f in zip(busy, bubbles))
  notes = list(dict.fromkeys(n for e in stages for n in e["notes"]))
  step = {**stages[s], "stage": s, "notes": notes,
          "step_seconds_with_bubble_estimate": with_bubble,
          "mfu_with_bubble_estimate": (model_flops / (with_bubble * chip.peak_bf16_flops_per_s
                                                      * num_devices) if with_bubble else None),
          "basis": (f"the busiest stage's busy time (stage {s}): each stage runs its programs "
                    "one after another on its own chips; the schedule's bubble is not in "
                    "this bound. Transfers between stages are charged at the chip's one-way "
                    "ICI bandwidth, spread over the sending stage's chips.")}
  return stages, step


def step_report(costs: list[ProgramCost], stage_rows: list[dict], chip, model_flops: float,
                tokens: float, num_devices: int) -> tuple[dict, list[dict]]:
  """(the plan's step-level entries, `stage_rows` with each stage's costs added) for an
  MPMD step: FLOPs per step summed over every program (kernels included), the busiest
  stage's HBM bytes and collectives per device, and with the chip's facts the estimate
  (`step_estimate`). Pure. `stage_rows`: `Program.stage_report`'s rows (their
  `transfer_bytes_per_step` and `bubble` are read)."""
  sums = stage_sums(costs, len(stage_rows))
  rows = [{**row, "flops_per_step": st["flops"] * st["devices"],
           "kernel_flops_per_step": st["kernel_flops"] * st["devices"],
           "hbm_bytes_per_step_per_device": st["hbm_bytes"],
           "collective_bytes_received_per_device": {"ici": st["ici_bytes"],
                                                    "dcn": st["dcn_bytes"]}}
          for row, st in zip(stage_rows, sums)]
  estimate = None
  if chip is not None:
    stages, estimate = step_estimate(sums, [r["transfer_bytes_per_step"] for r in rows],
                                     [r["bubble"] for r in rows], chip, model_flops, tokens,
                                     num_devices)
    for row, e in zip(rows, stages):
      row.update(seconds=e["seconds"], bound=e["bound"],
                 busy_seconds=e["step_seconds_lower_bound"],
                 busy_with_bubble_seconds=(e["step_seconds_lower_bound"] / (1 - row["bubble"])
                                           if row["bubble"] < 1 else None))
    s = estimate["stage"]
  else:
    s = max(range(len(sums)), key=lambda i: sums[i]["flops"])
  every = lambda key: sum(getattr(c, key) * c.devices * c.calls_per_step for c in costs)
  out = {
      "flops_per_step": {
          "xla": every("flops"), "xla_per_device": sums[s]["flops"],
          "xla_loop_bodies_once": every("flops_loop_bodies_once"), "model": model_flops,
          "kernels": every("kernel_flops"), "kernels_per_device": sums[s]["kernel_flops"],
          "note": "Summed over every program of the step (each stage's part forwards and "
                  "backwards, gradient reductions, optimizer updates): XLA's cost analysis of "
                  "each optimized program per device x its devices x its calls per step, loop "
                  "bodies counted per trip, plus its Pallas kernels' traced FLOPs (forward, "
                  "backward, recompute). Per-device figures are stage "
                  f"{s}'s (the busiest); the model's is 6·N·T + 12·(heads·head_dim) per "
                  "(query, key) pair the mask leaves (causal: position i sees i + 1 keys, a "
                  "sliding-window layer's min(i + 1, window))."},
      "hbm_bytes_per_step_per_device": sums[s]["hbm_bytes"],
      "collectives": sums[s]["collectives"],
      "collective_bytes_received_per_device": {"ici": sums[s]["ici_bytes"],
                                               "dcn": sums[s]["dcn_bytes"]},
      "warnings": [c.note for c in costs if c.note] + _kernel_notes(costs)}
  if estimate is not None:
    out["estimate"] = estimate
    if all(c.schedule for c in costs):
      out["step_estimate"] = schedule_estimate(costs, len(rows), chip, model_flops / num_devices)
  return out, rows


_SUMMED = ("step_seconds", "compute_seconds", "hbm_seconds", "exposed_seconds",
           "collective_seconds")


def schedule_estimate(costs: list[ProgramCost], num_stages: int, chip,
                      model_flops_per_device: float) -> dict:
  """The schedules' estimate of an MPMD step (`overlap.estimate` of each program, times its
  calls, summed per stage): the busiest stage's, `stage` naming it, with its programs' most
  exposed collectives. Stages wait on each other too: the bubble is not in it. Pure."""
  per_stage = []
  for s in range(num_stages):
    mine = [c for c in costs if c.stage == s]
    row = {k: sum(c.schedule[k] * c.calls_per_step for c in mine) for k in _SUMMED}
    row["top_exposed"] = sorted(
        ({**r, "program": c.name, "runs": r["runs"] * c.calls_per_step,
          "exposed_seconds_per_step": r["exposed_seconds_per_step"] * c.calls_per_step,
          "link_seconds_per_step": r["link_seconds_per_step"] * c.calls_per_step}
         for c in mine for r in c.schedule["top_exposed"]),
        key=lambda r: -r["exposed_seconds_per_step"])[:overlap.TOP]
    per_stage.append(row)
  s = max(range(num_stages), key=lambda i: per_stage[i]["step_seconds"])
  out = {**per_stage[s], "stage": s}
  out["exposed_fraction"] = (out["exposed_seconds"] / out["collective_seconds"]
                             if out["collective_seconds"] else 0.0)
  out["mfu_estimate"] = (model_flops_per_device / (out["step_seconds"]
                                                   * chip.peak_bf16_flops_per_s)
                         if out["step_seconds"] else None)
  return out


def _kernel_notes(costs: list[ProgramCost]) -> list[str]:
  kernels = sum(c.kernel_flops * c.devices * c.calls_per_step for c in costs)
  flops = sum(c.flops * c.devices * c.calls_per_step for c in costs)
  if not kernels:
    return []
  return [roofline.kernel_note("Fused kernels (Pallas kernels, cuDNN attention)",
                               f"{kernels:.3g} a step over every stage", kernels, flops)]
