"""The MPMD executor's parts: stage specs, per-part programs, results, and the pure planning
around them (mesh checks, the global dispatch order, the zero-bubble backward split).

`mpmd.Pipeline` builds and runs these; see its module docstring for the algorithm.
"""
import dataclasses
from fractions import Fraction
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, PartitionSpec as P

from spmdtask.core import steps
from spmdtask.errors import ConfigError
from spmdtask.pipeline.mpmd import backward_split
from spmdtask.pipeline.schedules import schedule as schedule_lib
from spmdtask.pipeline.schedules.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class StageSpec:
  """Where a stage runs and how its arrays are split inside the stage.

  mesh: the stage's submesh (Auto axes); submeshes of different stages are disjoint.
  param_specs: PartitionSpec tree shaped like the params (None: all replicated).
  batch_specs: PartitionSpec tree shaped like the batch, per-example dim first (None:
    replicated); the microbatch dim is prepended unsplit.
  activation_spec: PartitionSpec for the values this stage receives, or a callable
    aval -> PartitionSpec. A PartitionSpec that does not fit a value (rank, divisibility)
    is dropped to replicated for that value.
  """
  mesh: Mesh
  param_specs: Any = None
  batch_specs: Any = None
  activation_spec: Any = P()

  def spec_for(self, aval) -> P:
    if callable(self.activation_spec):
      return self.activation_spec(aval)
    spec, shape = self.activation_spec, aval.shape
    sizes = dict(self.mesh.shape)
    if len(spec) > len(shape) or any(
        shape[d] % int(np.prod([sizes[a] for a in (e if isinstance(e, tuple) else (e,))]))
        for d, e in enumerate(spec) if e is not None):
      return P()
    return spec


def flat_specs(specs, tree, what: str) -> list[P]:
  n = len(jax.tree.leaves(tree))
  if specs is None:
    return [P()] * n
  flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  if len(flat) != n:
    raise ConfigError(f"StageSpec.{what} has {len(flat)} PartitionSpecs but the tree has {n} "
                      "leaves; give one PartitionSpec per leaf (or None for replicated).")
  return flat


@dataclasses.dataclass(frozen=True)
class Part:
  """One part (virtual stage) of the split loss and its jitted programs."""
  index: int
  stage: int  # physical stage that runs it
  param_keys: tuple[str, ...]
  batch_leaves: tuple[int, ...]
  float_in: tuple[int, ...]  # value ids with a cotangent
  int_in: tuple[int, ...]
  float_out: tuple[int, ...]
  int_out: tuple[int, ...]
  fwd: steps.Partitioned
  bwd: steps.Partitioned
  # The backward split for I/W actions (None unless the schedule splits this part):
  # input_grad(res, cot) -> (d_incoming, stash); weight_grad(kept, stash, acc) -> acc + d.
  input_grad: steps.Partitioned | None = None
  weight_grad: steps.Partitioned | None = None
  kept: tuple[int, ...] = ()  # what W reads of (residual leaves + cotangents), by index
  # The last part's F(m) and its backward as one program, where the schedule always runs
  # them back to back (`fused_part`); B: fused(params, batch, m, in_float, in_int, cot, acc)
  # -> (outgoing, other, acc + d_params, d_incoming), acc donated; I: fused(..., cot) ->
  # (outgoing, other, d_incoming, kept, stash).
  fused: steps.Partitioned | None = None


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What one pass of the schedule gives: all arrays stay on their stage's submesh."""
  loss: jax.Array  # scalar on the last stage
  grads: tuple[dict, ...]  # per stage {path: grad}, tied copies summed
  aux: tuple  # per microbatch, the loss_fn's aux (has_aux) on the last stage
  peak_residuals: tuple[int, ...]  # per stage, most (microbatch, chunk) activation sets alive
  peak_stash: tuple[int, ...]  # per stage, most (microbatch, chunk) W stashes alive (I to W)
  num_chunks: int = 1
  # Measured from the arrays held (their shards on this process's devices), per stage:
  peak_residual_bytes: tuple[int, ...] = ()
  peak_stash_bytes: tuple[int, ...] = ()
  residual_set_bytes: tuple[int | None, ...] = ()  # per part: one F's residual bytes

  @property
  def peak_activations(self) -> tuple[Fraction, ...]:
    """peak_residuals in `simulate`'s units (a chunk's set counts 1/v): equal to
    `simulate.simulate(schedule, costs).peak_activations` for the schedule that ran."""
    return tuple(Fraction(n, self.num_chunks) for n in self.peak_residuals)

  @property
  def peak_weight_grad_stash(self) -> tuple[Fraction, ...]:
    """peak_stash in `simulate`'s units, its `peak_weight_grad_stash`."""
    return tuple(Fraction(n, self.num_chunks) for n in self.peak_stash)


def is_float(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


def split_backward(fwd, bwd, args, constrain):
  """(input_grad, weight_grad, kept, num_res): `bwd` cut by `backward_split` so that W turns I's
  stashed per-layer cotangents (and the layer inputs it keeps from the residuals) into
  weight grads, with no recomputation: FLOPs(I) + FLOPs(W) = FLOPs(B). Plain functions
  (the caller jits them on the stage's submesh):
    input_grad(res, cot) -> (d_incoming, stash); weight_grad(kept, stash, acc) -> acc + d
  `kept`: what W reads of (residual leaves + cotangents), by index, and num_res: how
  many residual leaves come first."""
  res = jax.eval_shape(lambda *a: fwd(*a)[1], *args)
  res_avals, res_tree = jax.tree.flatten(res)
  n_res = len(res_avals)
  outs = jax.eval_shape(lambda *a: fwd(*a)[0], *args)
  num_params, num_in = len(args[0]), len(args[3])

  def flat_bwd(*flat):
    d_params, d_in = bwd(jax.tree.unflatten(res_tree, flat[:n_res]), tuple(flat[n_res:]))
    return [*d_params, *d_in]

  sb = backward_split.split(flat_bwd, *res_avals, *jax.tree.leaves(outs),
                            weight_outputs=[True] * num_params + [False] * num_in)
  run_i = jcore.jaxpr_as_fun(sb.input_grad)
  run_w = jcore.jaxpr_as_fun(sb.weight_grad)

  def input_grad(r, cot):
    outs = run_i(*jax.tree.leaves(r), *constrain(cot))
    return tuple(outs[:num_in]), tuple(outs[num_in:])

  def weight_grad(kept, stash, acc):
    return tuple(a + g for a, g in zip(acc, run_w(*kept, *stash)))

  return input_grad, weight_grad, sb.kept, n_res


def kept_inputs(res, cot, kept: Sequence[int]) -> tuple:
  """What W reads (`split_backward`'s `kept`, by index) of I's inputs: the residual leaves
  of `res`, then the cotangents `cot`."""
  inputs = jax.tree.leaves(res) + list(cot)
  return tuple(inputs[i] for i in kept)


def fused_part(schedule: Schedule) -> int | None:
  """The last part (the loss) if, on its stage, every F(m) of it is directly followed by its
  own backward (B or I of m), as in 1F1B and ZB-H1; else None. The runner then runs each
  such pair as one program: one dispatch instead of two, and the residuals never leave the
  program. Only the last part qualifies: any other part's backward needs its consumers'
  backward, which needs this part's forward to have been sent on."""
  v = schedule.num_stages * schedule.num_chunks - 1
  s, c = schedule.owner(v)
  row = schedule.actions[s]
  for k, a in enumerate(row):
    if a.kind == "F" and a.chunk == c and not (
        k + 1 < len(row) and row[k + 1].kind in ("B", "I") and
        (row[k + 1].microbatch, row[k + 1].chunk) == (a.microbatch, c)):
      return None
  return v


def check_meshes(stages: Sequence[StageSpec], num_stages: int) -> None:
  if len(stages) != num_stages:
    raise ConfigError(f"{len(stages)} stage specs (submeshes) for a schedule of {num_stages} "
                      "stages; give one StageSpec per schedule stage.")
  seen = {}
  for s, st in enumerate(stages):
    for d in st.mesh.devices.flat:
      if d.id in seen:
        raise ConfigError(f"Device {d.id} is in the submesh of stage {seen[d.id]} and of stage "
                          f"{s}; stage submeshes must use disjoint devices.")
      seen[d.id] = s


def execution_order(schedule: Schedule, parts: Sequence[Part], values) -> list:
  """One dispatch order for all stages (`schedule.execution_order` under the split's value
  dependencies): F(m) of a part needs F(m) of every part it receives from; B(m) or I(m)
  needs its own F(m) and the B(m) (or I(m)) of every part that receives a differentiable
  value from it; W(m) needs its own I(m). Raises ConfigError for a schedule that breaks a
  rule of `schedule.validate` or deadlocks.
  """
  schedule_lib.validate(schedule, "the pipeline's schedule")
  f_from = {p.index: {values[i].producer for i in p.float_in + p.int_in} for p in parts}
  b_from = {p.index: {c for i in p.float_out for c in values[i].consumers} for p in parts}

  def deps(sched, stage, a, backward):
    v, mb = sched.virtual_stage(stage, a.chunk), a.microbatch
    if a.kind == "W":
      return [(stage, schedule_lib.Action("I", mb, a.chunk))]
    on = lambda u, kind: (sched.owner(u)[0], schedule_lib.Action(kind, mb, sched.owner(u)[1]))
    if a.kind == "F":
      return [on(u, "F") for u in sorted(f_from[v])]
    return [on(v, "F")] + [on(u, backward.get((*sched.owner(u)[:1], mb, sched.owner(u)[1]), "B"))
                           for u in sorted(b_from[v])]

  return schedule_lib.execution_order(schedule, "the pipeline's schedule", deps)
