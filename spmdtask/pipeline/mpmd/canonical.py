"""The MPMD train state's canonical conversion (`MpmdProgram.to_canonical` / `from_canonical`).

The live state is per stage: `{path: param}` and the optimizer's
state over those params. `to_canonical` gathers the params (a tied leaf from its first
stage) into the live tree (layer groups `block_<g>`), collects every optimizer statistic
that mirrors the params (optax identifies them: `tree_map_params`) the same way, moves
everything onto `mesh` and converts with the model's `layout_maps` (groups -> `[L, ...]`);
`from_canonical` does the reverse. The canonical optimizer state is that of
`task.train.make_optimizer()`: its clipping adds an empty state, so its leaves are the
stages' optimizer's leaves in the same order.
"""
import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.core import steps
from spmdtask.pipeline.mpmd.step import StageState
from spmdtask.core.train_state import TrainState


def _is_everything(_) -> bool:
  return True


def _masked(x) -> bool:  # optax.masked's frozen param (LoRA): a leaf here, to keep the paths
  return isinstance(x, optax.MaskedNode)


def _mirrors(tx, opt_state) -> tuple[list, list]:
  """(param-mirroring subtrees, other leaves) of an optax state, in tree order."""
  subs, others = [], []
  optax.tree_utils.tree_map_params(tx, subs.append, opt_state, is_leaf=_is_everything,
                                   transform_non_params=others.append)
  return subs, others


def _rebuild(tx, template, subs, others):
  """`template` (an optax state of `tx`) with its mirrors and other leaves replaced."""
  subs, others = iter(subs), iter(others)
  return optax.tree_utils.tree_map_params(tx, lambda _: next(subs), template,
                                          is_leaf=_is_everything,
                                          transform_non_params=lambda _: next(others))


def gather(program, step, stages) -> TrainState:
  """Per-stage states -> the live TrainState (layer groups) on `program.mesh`."""
  pl, cross = program.pipeline, program.pipeline.cross
  if cross.multiprocess:  # every stage's state on every device (mpmd.program doc)
    here = lambda t: jax.tree.map(lambda x: cross.localize(x, program.mesh), t)
    step = here(step)
    stages = tuple(here(cross.broadcast(st, s, program.shapes["stages"][s]))
                   for s, st in enumerate(stages))
  params = pl.gather([st.params for st in stages])
  per_stage = [_mirrors(program.base_tx, st.opt_state) for st in stages]
  subs = []
  for i in range(len(per_stage[0][0])):
    merged = {}
    for stage_subs, _ in per_stage:
      for k, x in stage_subs[i].items():
        merged.setdefault(k, x)  # a tied leaf's statistics from its first stage
    subs.append(jax.tree.unflatten(pl.params_tree, [merged[k] for k in pl.paths]))
  opt_state = _rebuild(program.base_tx, program.live.logical.opt_state, subs, per_stage[0][1])
  live = TrainState(step, params, opt_state)
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(program.mesh, s)), live,
                      program.live_split)


def scatter(program, live: TrainState) -> tuple:
  """The live TrainState on `program.mesh` -> (step, per-stage states); a stage another
  process owns is None."""
  pl, cross = program.pipeline, program.pipeline.cross
  if cross.multiprocess:  # replicated: each process takes its stages' leaves locally
    live = cross.replicate(live, program.mesh)
    here = lambda t, s: jax.tree.map(lambda x: cross.localize(x, pl.stages[s].mesh), t)
  else:
    here = lambda t, s: t
  flat = dict(zip(pl.paths, jax.tree.leaves(live.params)))
  subs, others = _mirrors(program.base_tx, live.opt_state)
  flat_subs = [dict(zip(pl.paths, jax.tree.leaves(sub, is_leaf=_masked))) for sub in subs]
  stages = []
  for s, (keys, prog, spec) in enumerate(zip(pl.stage_keys, program.step_fn.programs,
                                             pl.stages)):
    if not cross.local[s]:
      stages.append(None)
      continue
    params = {k: jax.device_put(here(flat[k], s), pl.sharding(s, k)) for k in keys}
    template = jax.eval_shape(program.base_tx.init, params)
    opt = _rebuild(program.base_tx, template, [{k: f[k] for k in keys} for f in flat_subs],
                   others)
    stages.append(StageState(params, jax.device_put(
        here(opt, s), steps.named_shardings(spec.mesh, prog.opt_specs))))
  if cross.multiprocess:
    return live.step, tuple(stages)
  last = pl.part_stage[-1]
  return jax.device_put(live.step, NamedSharding(pl.stages[last].mesh, P())), tuple(stages)
