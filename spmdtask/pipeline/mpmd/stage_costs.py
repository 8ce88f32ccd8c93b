"""Per-stage costs of an MPMD pipeline on a chip, from its compiled part programs.

An MPMD program built on CPU devices is rebuilt on a TPU topology's compile-only devices
(`on_target`); each part's programs are lowered from ShapeDtypeStructs and compiled by
XLA:TPU ahead of time (nothing runs). Each program's time is its roofline lower bound on
the chip (`plan.stage_roofline.measure`: max of compute, HBM and ICI time from XLA's FLOPs
and bytes with loops counted per trip, its Pallas kernels' traced FLOPs, and its
collectives), and becomes one action's cost:

  F = forward    B = backward (unsplit)    I = input_grad    W = weight_grad

per microbatch through that part; a hop into a part costs the bytes one of its chips
receives (the part's incoming activations forward, or the cotangents of its outputs
backward, whichever is larger) over the chip's ICI ingress bandwidth (`chips.Chip`).
`part_costs` turns these into `simulate.Costs`, one per part, for `simulate.simulate`.
"""
import dataclasses
import math
import types

from jax.sharding import NamedSharding

from spmdtask.core import layouts, train_state
from spmdtask.plan import planner, roofline as plan_roofline, stage_roofline
from spmdtask.pipeline.mpmd import pipeline, parts, report, stages, step as mpmd_step
from spmdtask.pipeline.schedules import simulate


def on_target(program, task, devices) -> types.SimpleNamespace:
  """The MPMD `program`'s pipeline and per-stage optimizer programs rebuilt on the
  submeshes of `devices` (e.g. a TPU topology's): what `mpmd.report.lowerings` reads."""
  src = program.pipeline
  meshes = stages.submeshes(task.pipeline, task.mesh_axis_names, devices)
  specs = [dataclasses.replace(st, mesh=m) for st, m in zip(src.stages, meshes)]
  loss_fn, params, microbatch = src._split_args  # pylint: disable=protected-access
  # Compile-only devices: no stage is this process's, so nothing is placed on them.
  pl = pipeline.Pipeline(loss_fn, params, microbatch, specs, src.schedule, has_aux=True,
                     rows_are_sums=True, compile_only=True)
  step = mpmd_step.TrainStep(pl, program.base_tx, task.train.clip_grad_norm or None,
                             only_adapters=train_state.adapters_only(program.model))
  return types.SimpleNamespace(pipeline=pl, step_fn=step, shapes=program.shapes)


def split_lowerings(pl) -> list[layouts.Lowering]:
  """Each split part's input_grad (I) and weight_grad (W), lowered from shapes."""
  M, out = pl.schedule.num_microbatches, []
  for part in pl.parts:
    if part.input_grad is None:
      continue
    s, mesh = part.stage, pl.stages[part.stage].mesh
    args, cot = report.part_args(pl, part)
    res = part.fwd.jitted.eval_shape(*args)[1]
    stash = part.input_grad.jitted.eval_shape(res, cot)[1]
    kept = parts.kept_inputs(res, cot, part.kept)
    acc = tuple(pl.acc[s].structs[key] for key in part.param_keys)
    out.append(layouts.Lowering(f"stage {s} part {part.index} input_grad", s, mesh,
                                lambda p=part, r=res, c=cot: p.input_grad.lower(r, c), M,
                                part.input_grad.jitted, (res, cot)))
    out.append(layouts.Lowering(f"stage {s} part {part.index} weight_grad", s, mesh,
                                lambda p=part, k=kept, st=stash, a=acc:
                                p.weight_grad.lower(k, st, a), M, part.weight_grad.jitted,
                                (kept, stash, acc)))
  return out


def roofline(lowerings, target, progress=lambda name: None) -> dict[str, dict]:
  """Lowering name -> its compiled roofline on `target`'s chip: {'seconds' (the bound),
  'bound' (which term), 'terms', 'flops_per_device'} per call, its Pallas kernels' traced
  FLOPs included (`plan.stage_roofline.measure`); `progress(name)` before each."""
  out = {}
  for lw in lowerings:
    progress(lw.name)
    compiled, _ = planner.compile_lowering(lw)
    cost = stage_roofline.measure(lw, compiled, target.num_slices)
    est = plan_roofline.estimate(target.chip, cost.flops, cost.hbm_bytes, cost.ici_bytes,
                                 cost.dcn_bytes, 0.0, 1.0, cost.host_bytes)
    out[lw.name] = {"seconds": est["step_seconds_lower_bound"], "bound": est["bound"],
                    "terms": est["seconds"], "flops_per_device": cost.flops}
  return out


def _bytes_per_chip(pl, part, ids) -> int:
  """Bytes one chip of `part`'s submesh holds of values `ids` (in their layout there)."""
  spec, total = pl.stages[part.stage], 0
  for i in ids:
    aval = pl.values[i].aval
    shard = NamedSharding(spec.mesh, spec.spec_for(aval)).shard_shape(aval.shape)
    total += math.prod(shard) * aval.dtype.itemsize
  return total


def hop_seconds(pl, part, chip) -> float:
  """Time of the larger transfer into `part`: its inputs forward or its outputs'
  cotangents backward, as bytes per receiving chip / the chip's ICI ingress."""
  got = max(_bytes_per_chip(pl, part, part.float_in + part.int_in),
            _bytes_per_chip(pl, part, part.float_out))
  return got / chip.ici_ingress_bytes_per_s


def seconds(time: dict, term: str | None = None) -> float:
  """A program's time from `roofline`: its bound, or one term of it ('compute': FLOPs
  at peak only, the view where XLA's bytes-accessed count does not decide)."""
  return time["seconds"] if term is None else time["terms"][term]


def part_costs(pl, times: dict[str, dict], chip, split: bool, term: str | None = None,
               unit: float = 1e-6) -> list[simulate.Costs]:
  """One `simulate.Costs` per part in `unit` seconds (default microseconds, so the
  simulator's exact fractions keep the precision): F, and with `split` I and W (the
  part's compiled input_grad and weight_grad), else B (its compiled backward) with W = 0;
  each program's time is `seconds(time, term)`."""
  out = []
  for part in pl.parts:
    t = lambda kind: seconds(times[f"stage {part.stage} part {part.index} {kind}"], term) / unit
    out.append(simulate.Costs(
        forward=t("forward"), backward=t("input_grad") if split else t("backward"),
        weight=t("weight_grad") if split else 0.0, latency=hop_seconds(pl, part, chip) / unit))
  return out


def step(schedule, costs, update_seconds) -> dict:
  """The simulated step of a pipeline: the schedule under per-part `costs`, then each
  stage's optimizer update after its last action ('step' = the latest; all in the costs'
  unit). Bubble per stage: 1 - busy / makespan (the schedule alone, updates left out)."""
  sim = simulate.simulate(schedule, costs)
  ends = [float(row[-1].end) if row else 0.0 for row in sim.timeline]
  return {"makespan": float(sim.makespan),
          "step": max(e + u for e, u in zip(ends, update_seconds)),
          "busy": [float(b) for b in sim.busy],
          "bubbles": [float(b) for b in sim.bubble_fractions],
          "bubble": float(sim.bubble_fraction), "simulation": sim}
