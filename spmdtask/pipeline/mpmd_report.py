"""What an MPMD program tells the console and the plan: per-stage facts and lowerings.

`describe(program)`: the strategy line, then one line per stage: its submesh, its layers,
its train state bytes per device. `lowerings(program)`: every jitted program of one step
(each part's forward and backward, each stage's optimizer update) as `layouts.Lowering`s
built from ShapeDtypeStructs, so `--mode=plan` compiles them per stage without running.
"""
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask import console, layouts, memory
from spmdtask.pipeline import mpmd_stages
from spmdtask.train_state import StateLayout


def stage_layers(program) -> list[list[tuple[int, int]]]:
  """Per stage, the [start, end) layer ranges of the parts it runs."""
  pl = program.pipeline
  groups = mpmd_stages.layer_groups(program.config.layer_cuts, program.num_layers)
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
  lines = [program.config.summary()]
  for s, (spec, layers) in enumerate(zip(pl.stages, stage_layers(program))):
    mesh = " ".join(f"{a}={n}" for a, n in spec.mesh.shape.items())
    ids = [d.id for d in spec.mesh.devices.flat]
    first, last = s == pl.part_stage[0], s == pl.part_stage[-1]
    extra = " + embedding" * first + " + head and loss" * last
    t = memory.totals(stage_state_rows(program, s))
    lines.append(f"  stage {s}: submesh {mesh} (devices {min(ids)}-{max(ids)}), layers "
                 + ", ".join(f"{a}-{b - 1}" for a, b in layers) + extra
                 + f"; train state {console.human_bytes(t['state_bytes_per_device'])} per device")
  return lines


def lowerings(program) -> list[layouts.Lowering]:
  """Each part's forward and backward (run M times a step) and each stage's update."""
  pl = program.pipeline
  M = pl.schedule.num_microbatches
  out = []
  for part in pl.parts:
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
    args = (params, batch, m, vals(part.float_in), vals(part.int_in))
    out.append(layouts.Lowering(f"stage {s} part {part.index} forward", s, mesh,
                                lambda p=part, a=args: p.fwd.lower(*a), M))
    last = part.index == len(pl.parts) - 1
    cot = ((struct(pl.loss_aval, P()),) if last else vals(part.float_out))

    def lower_bwd(p=part, a=args, c=cot, acc=params):
      res = p.fwd.jitted.eval_shape(*a)[1]
      return p.bwd.lower(res, c, acc)
    out.append(layouts.Lowering(f"stage {s} part {part.index} backward", s, mesh, lower_bwd, M))
  for s, prog in enumerate(program.step_fn.programs):
    mesh = pl.stages[s].mesh
    sh = program.shapes["stages"][s]
    put = lambda tree, specs, mesh=mesh: layouts.sharded_structs(mesh, tree, specs)
    params = put(sh.params, prog.param_specs)
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
    out.append(layouts.Lowering(
        f"stage {s} optimizer update", s, mesh,
        lambda prog=prog, p=params, o=put(sh.opt_state, prog.opt_specs), c=scalar:
        prog.update.lower(p, o, p, c, c)))
  return out
