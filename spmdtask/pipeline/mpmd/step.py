"""The MPMD train step: run the schedule, clip by the global norm of all stages, update
every stage's params and optimizer state on its own submesh.

Clipping sits outside the optax chain: a per-stage `tx.update` would clip each stage by
its own norm. Instead each stage reduces the squared norm of the gradients it owns (a
tied leaf counted once, on its first stage), the scalars meet on the last stage, and the
global norm goes back to every stage's update program, which applies exactly
`optax.clip_by_global_norm`'s rule before `tx.update`. So with the same `tx` the update
equals the unpipelined `optax.chain(optax.clip_by_global_norm(max_norm), tx)`.

A loss summed over examples or tokens (not averaged) is normalised with `loss_weight`:
`loss_fn` returns microbatch m's loss *sum* (and its weight in the aux), the Pipeline runs
with weights 1, and the step divides the loss and the gradients by the summed weight
`loss_weight(aux)` before clipping: the update of the batch's mean loss, whatever the
microbatch split, without knowing the weights before the schedule starts.

  states = step.init(params)                 # per stage: StageState(params, opt_state)
  states, metrics = step(states, batch)      # loss, grad_norm, param_norm, peak_residuals
"""
import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.core import sharding, steps, train_state
from spmdtask.pipeline.mpmd.pipeline import Pipeline


class StageState(NamedTuple):
  """One stage's part of the train state: {path: param} and its optax state."""
  params: dict
  opt_state: Any


def clip_by_norm(grads, norm, max_norm: float):
  """`optax.clip_by_global_norm(max_norm)` with the norm given (here: of all stages)."""
  trigger = jnp.squeeze(norm < max_norm)
  return jax.tree.map(
      lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads)


@dataclasses.dataclass(frozen=True)
class StageProgram:
  """A stage's jitted optimizer programs."""
  init: steps.Partitioned  # params -> opt_state
  sq_norm: steps.Partitioned  # (grads, params) -> [2]: their sums of squares, of the leaves
                             # this stage owns (one array: one transfer to the last stage)
  update: steps.Partitioned  # (params, opt_state, grads, [norm, scale]) -> (params, opt_state)
  param_specs: dict  # {path: PartitionSpec} on the stage's submesh
  opt_specs: Any  # PartitionSpecs of the stage's optimizer state


class TrainStep:
  """`(states, batch) -> (states, metrics)` for a Pipeline; `tx` must not clip (module doc)."""

  def __init__(self, pipeline: Pipeline, tx: optax.GradientTransformation,
               max_grad_norm: float | None = None,
               loss_weight: Callable[[tuple], jax.Array] | None = None,
               only_adapters: bool = False):
    # only_adapters (LoRA; `tx` from train_state.optimizer): frozen params kept bitwise.
    self.pipeline, self.tx, self.max_grad_norm = pipeline, tx, max_grad_norm
    self.only_adapters = only_adapters
    pl = pipeline
    shapes = dict(zip(pl.paths, pl.param_shapes))
    owner = {k: where[0] for k, where in pl.tied.items()}
    self.programs = tuple(self._stage_program(s, {k: shapes[k] for k in keys},
                                              [k for k in keys if owner.get(k, s) == s])
                          for s, keys in enumerate(pl.stage_keys))
    last = pl.part_stage[-1]
    self._norm_mesh = pl.stages[last].mesh
    M = pl.schedule.num_microbatches
    self._ones = jax.device_put(jnp.ones((M,), jnp.float32), NamedSharding(
        self._norm_mesh, P())) if pl.cross.local[last] else None

    def norms(sq, loss, aux):
      """(loss, grad norm, param norm, [grad norm, grad scale]) of the normalised step."""
      scale = jnp.ones((), jnp.float32)
      if loss_weight is not None:
        scale = 1.0 / jnp.maximum(loss_weight(aux), jnp.finfo(jnp.float32).tiny)
      total = sum(sq)
      norm = jnp.sqrt(total[0]) * scale
      return loss * scale.astype(loss.dtype), norm, jnp.sqrt(total[1]), jnp.stack([norm, scale])

    self.loss_weight = loss_weight
    self._norms = steps.partition(norms, self._norm_mesh, (P(), P(), P()), P())

  def _stage_program(self, s: int, shapes: dict, owned: Sequence[str]) -> StageProgram:
    pl = self.pipeline
    mesh = pl.stages[s].mesh
    pspecs = {k: pl.param_specs[s][pl.paths.index(k)] for k in shapes}
    opt_shapes = jax.eval_shape(self.tx.init, shapes)
    ospecs, _ = sharding.opt_state_split_dims(self.tx, opt_shapes, shapes, pspecs)
    init = steps.partition(self.tx.init, mesh, (pspecs,), ospecs)
    def sq(tree):
      return sum((jnp.sum(jnp.square(tree[k].astype(jnp.float32))) for k in owned),
                 jnp.zeros((), jnp.float32))

    sq_norm = steps.partition(lambda g, p: jnp.stack([sq(g), sq(p)]), mesh, (pspecs, pspecs),
                              P())
    max_norm = self.max_grad_norm

    def update(params, opt_state, grads, norm_scale):
      norm, scale = norm_scale[0], norm_scale[1]
      grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
      if max_norm is not None:
        grads = clip_by_norm(grads, norm, max_norm)
      updates, opt_state = self.tx.update(grads, opt_state, params)
      return train_state.apply_updates(params, updates, self.only_adapters), opt_state

    update_p = steps.partition(update, mesh, (pspecs, ospecs, pspecs, P()),
                               (pspecs, ospecs), donate_argnums=(0, 1))
    return StageProgram(init, sq_norm, update_p, pspecs, ospecs)

  def init(self, params) -> tuple[StageState, ...]:
    """Full params tree -> per-stage states (params placed, optimizer state initialised)."""
    placed = self.pipeline.place(params)
    return tuple(StageState(p, prog.init(p)) if p is not None else None
                 for p, prog in zip(placed, self.programs))

  def __call__(self, states: Sequence[StageState], batch, weights=None):
    """One step. Metrics: loss, grad_norm and param_norm (of the params the step started
    from; scalars on the last stage) and peak_residuals (host ints per stage). `weights`
    as in Pipeline.run (with `loss_weight`: ones unless given).

    With several processes a stage this process does not own has state None and stays
    None; the norm's parts reach the last stage and the norm goes back by collectives
    (pipeline.cross), and the scalar metrics are None unless the last stage is local."""
    pl = self.pipeline
    local, put = pl.cross.local, pl.cross.put
    last = pl.part_stage[-1]
    if weights is None and self.loss_weight is not None and local[last]:
      weights = self._ones
    result = pl.run([st.params if st else None for st in states], batch, weights)
    pair = jax.ShapeDtypeStruct((2,), jnp.float32)
    # The last stage's own scalars stay where they are; the others' cross once each way.
    move = lambda x, a, b: x if a == b else put(x, pair, a, b)
    sq = tuple(move(prog.sq_norm(g, st.params) if local[s] else None, s, last)
               for s, (prog, g, st) in enumerate(zip(self.programs, result.grads, states)))
    loss = norm = param_norm = norm_scale = None
    if local[last]:
      loss, norm, param_norm, norm_scale = self._norms(sq, result.loss, result.aux)
    new = []
    for s, (st, prog, g) in enumerate(zip(states, self.programs, result.grads)):
      ns = move(norm_scale, last, s)
      new.append(StageState(*prog.update(st.params, st.opt_state, g, ns)) if local[s]
                 else None)
    metrics = {"loss": loss, "grad_norm": norm, "param_norm": param_norm,
               "peak_residuals": result.peak_residuals}
    if pl.has_aux:
      metrics["aux"] = result.aux
    return tuple(new), metrics
