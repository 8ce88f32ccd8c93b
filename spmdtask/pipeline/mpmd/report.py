"""What an MPMD program tells the console and the plan: per-stage facts and lowerings.

`describe(program)`: the strategy line, one line per stage (its submesh, its layers, its
cost relative to the slowest stage, its train state bytes per device), then the cuts with
each stage's compiled cost (`auto_cuts.CutCosts`; costs once measured: always with
layer_cuts="auto", after `stage_report` for hand-set cuts). `lowerings(program)`: every jitted
program of one step (each part's forward and backward, each stage's optimizer update) as
`layouts.Lowering`s built from ShapeDtypeStructs, so `--mode=plan` compiles them per stage
without running.
"""
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask import console
from spmdtask.core import layouts, memory
from spmdtask.pipeline.schedules import simulate
from spmdtask.core.train_state import StateLayout


def stage_layers(program) -> list[list[tuple[int, int]]]:
  """Per stage, the [start, end) layer ranges of the parts it runs."""
  pl = program.pipeline
  groups = program.plan.groups
  out = [[] for _ in pl.stages]
  for v, s in enumerate(pl.part_stage):
    out[s].append(groups[v])
  return out


def stage_state_rows(program, s: int) -> list[memory.ArrayRow]:
  """The rows (bytes per device on its submesh) of stage s's params and optimizer state."""
  shapes = program.shapes["stages"][s]
  prog = program.step_fn.programs[s]
  split = type(shapes)(prog.param_specs, prog.opt_specs)
  return memory.state_rows(StateLayout(shapes, shapes, split),
                           dict(program.pipeline.stages[s].mesh.shape))


def describe(program) -> list[str]:
  pl = program.pipeline
  costs = program.cut_costs(measure=False)  # measured with "auto"; hand-set: by the plan
  lines = [program.plan.summary()]
  for s, (spec, layers) in enumerate(zip(pl.stages, stage_layers(program))):
    mesh = " ".join(f"{a}={n}" for a, n in spec.mesh.shape.items())
    ids = [d.id for d in spec.mesh.devices.flat]
    first, last = s == pl.part_stage[0], s == pl.part_stage[-1]
    extra = " + embedding" * first + " + head and loss" * last
    t = memory.totals(stage_state_rows(program, s))
    lines.append(f"  stage {s}: submesh {mesh} (devices {min(ids)}-{max(ids)}), layers "
                 + ", ".join(f"{a}-{b - 1}" for a, b in layers) + extra
                 + (f", cost {costs.ratios[s]:.2f} of the slowest" if costs else "")
                 + "; train state "
                 + f"{console.human_bytes(t['state_bytes_per_device'])} per device")
  return lines + ([costs.line()] if costs else [])


def part_args(pl, part) -> tuple[tuple, tuple]:
  """(forward args, output cotangents) of `part` as ShapeDtypeStructs on its submesh: what
  its programs are lowered on (forward(*args); backward(residuals, cotangents, params))."""
  s, mesh = part.stage, pl.stages[part.stage].mesh
  spec = pl.stages[s]
  struct = lambda aval, sp: jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                                 sharding=NamedSharding(mesh, sp))
  shapes = dict(zip(pl.paths, pl.param_shapes))
  params = tuple(struct(shapes[k], pl.param_specs[s][pl.paths.index(k)])
                 for k in part.param_keys)
  batch = tuple(struct(pl.batch_avals[j], P(None, *pl.batch_specs[s][j]))
                for j in part.batch_leaves)
  m = struct(jax.ShapeDtypeStruct((), jnp.int32), P())
  vals = lambda ids: tuple(struct(pl.values[i].aval, spec.spec_for(pl.values[i].aval))
                           for i in ids)
  last = part.index == len(pl.parts) - 1
  cot = (struct(pl.loss_aval, P()),) if last else vals(part.float_out)
  return (params, batch, m, vals(part.float_in), vals(part.int_in)), cot


def lowerings(program) -> list[layouts.Lowering]:
  """Each part's forward and backward (run M times a step; with their jitted functions and
  abstract args, for tracing), each stage's gradient reduction (once a step, with
  per-device accumulation) and its update."""
  pl = program.pipeline
  M = pl.schedule.num_microbatches
  out = []
  for part in pl.parts:
    s, mesh = part.stage, pl.stages[part.stage].mesh
    args, cot = part_args(pl, part)
    out.append(layouts.Lowering(f"stage {s} part {part.index} forward", s, mesh,
                                lambda p=part, a=args: p.fwd.lower(*a), M, part.fwd.jitted,
                                args))
    res = part.fwd.jitted.eval_shape(*args)[1]
    bwd_args = (res, cot, tuple(pl.acc[s].structs[k] for k in part.param_keys))
    out.append(layouts.Lowering(f"stage {s} part {part.index} backward", s, mesh,
                                lambda p=part, a=bwd_args: p.bwd.lower(*a), M, part.bwd.jitted,
                                bwd_args))
  for s, acc in enumerate(pl.acc):
    if acc.reduction is not None:  # per-device partial sums -> the step's gradients
      out.append(layouts.Lowering(
          f"stage {s} gradient reduction", s, pl.stages[s].mesh,
          lambda acc=acc: acc.reduction.lower(tuple(acc.structs.values())), 1))
  for s, prog in enumerate(program.step_fn.programs):
    mesh = pl.stages[s].mesh
    sh = program.shapes["stages"][s]
    put = lambda tree, specs, mesh=mesh: layouts.sharded_structs(mesh, tree, specs)
    params = put(sh.params, prog.param_specs)
    norm_scale = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(mesh, P()))
    out.append(layouts.Lowering(
        f"stage {s} optimizer update", s, mesh,
        lambda prog=prog, p=params, o=put(sh.opt_state, prog.opt_specs), c=norm_scale:
        prog.update.lower(p, o, p, c)))
  return out


def stage_report(program, compiled: list) -> list[dict]:
  """The per-stage plan, from each lowering's compiled program (`(Lowering, compiled)`s).

  Per stage: its submesh and layers; train state bytes per device; the largest compiled
  temporaries among its programs; one activation set's bytes per device (a part's forward
  outputs: residuals and what it sends); the live sets at the schedule's peak (the
  simulator's count) and their bytes (`simulate.peak_bytes` with those set sizes); bytes
  it sends per step (activations forward, gradients back); the simulated bubble (equal
  F/B/W costs); the estimated peak = state + live sets + temporaries; and
  its cost per microbatch (compiled train FLOPs per device of its layers, `CutCosts`) and
  that relative to the slowest stage. The plan adds each stage's FLOPs and roofline
  (`plan.stage_roofline.step_report`).
  """
  pl, sched = program.pipeline, program.pipeline.schedule
  M = sched.num_microbatches
  sim = simulate.simulate(sched)
  by_name = {lw.name: (lw, c) for lw, c in compiled}
  set_bytes = [by_name[f"stage {p.stage} part {p.index} forward"][1].memory_analysis()
               .output_size_in_bytes for p in pl.parts]
  live = simulate.peak_bytes(sched, set_bytes)
  nbytes = lambda ids: sum(pl.values[i].aval.size * pl.values[i].aval.dtype.itemsize
                           * len(pl.values[i].consumers) for i in ids)  # one send a consumer
  rows, costs = [], program.cut_costs()
  for s, (spec, layers) in enumerate(zip(pl.stages, stage_layers(program))):
    mine = [(lw, c) for lw, c in compiled if lw.stage == s]
    temp = max(c.memory_analysis().temp_size_in_bytes for _, c in mine)
    parts = [p for p in pl.parts if p.stage == s]
    sent = M * sum(nbytes(p.float_out + p.int_out) for p in parts)
    sent += M * sum(pl.values[i].aval.size * pl.values[i].aval.dtype.itemsize
                    for p in parts for i in p.float_in)  # gradients back to producers
    state = memory.totals(stage_state_rows(program, s))["state_bytes_per_device"]
    rows.append({
        "stage": s, "devices": spec.mesh.devices.size,
        "submesh": {a: int(n) for a, n in spec.mesh.shape.items()},
        "layers": [list(r) for r in layers], "state_bytes_per_device": state,
        "compiled_temp_bytes": int(temp),
        "activation_set_bytes": [set_bytes[p.index] for p in parts],
        "peak_activation_sets": float(sim.peak_activations[s]),
        "peak_activation_bytes": int(live[s]), "transfer_bytes_per_step": int(sent),
        "bubble": float(sim.bubble_fractions[s]),
        "peak_estimate_bytes": int(state + live[s] + temp),
        "cost_flops_per_microbatch": costs.loads[s], "cost_vs_slowest": costs.ratios[s],
        "layer_cuts_auto": costs.auto})
  return rows
