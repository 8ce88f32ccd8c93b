"""The compiled backward programs of an MPMD `Pipeline`'s parts, for plans and tests: B,
and where the schedule splits a part I and W, lowered on real arrays of microbatch 0."""
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from spmdtask.pipeline.mpmd.parts import kept_inputs
from spmdtask.pipeline.mpmd.runner import Runner, stage_batches


def compiled_backward(runner: Runner, stage_params: Sequence[dict], batch) -> dict[int, dict]:
  """The compiled backward programs of every part: {part: {"bwd": Compiled, and where the
  schedule splits the part "input_grad", "weight_grad"}}, lowered on microbatch 0's
  residuals, zero cotangents and the stage's accumulators (its per-device stack with dp
  axes); and {"reduce", stage}: the stage's once-a-step reduction, where it has one."""
  pl = runner.pl
  batches = stage_batches(pl, batch)
  inbox, res, out = {}, {}, {}
  for part in pl.parts:
    res[part.index] = runner.forward_part(part, 0, stage_params, batches, inbox, [None], [None])
  compile_ = lambda prog, *args: prog.lower(*args).compile()
  for part in pl.parts:
    mesh = pl.stages[part.stage].mesh
    avals = ([pl._seeds.jitted.eval_shape(pl._uniform)[0]]  # pylint: disable=protected-access
             if part.index == len(pl.parts) - 1 else [pl.values[i].aval for i in part.float_out])
    cot = tuple(jax.device_put(jnp.zeros(a.shape, a.dtype), NamedSharding(
        mesh, pl.stages[part.stage].spec_for(a))) for a in avals)
    zeros = pl.acc[part.stage].fresh()
    acc = tuple(zeros[k] for k in part.param_keys)
    r = res[part.index]
    out[part.index] = {"bwd": compile_(part.bwd, r, cot, acc)}
    if part.input_grad is not None:
      _, stash = part.input_grad(r, cot)
      kept = kept_inputs(r, cot, part.kept)
      out[part.index].update(input_grad=compile_(part.input_grad, r, cot),
                             weight_grad=compile_(part.weight_grad, kept, stash, acc))
  for s, acc in enumerate(pl.acc):
    if acc.reduction is not None:
      out["reduce", s] = compile_(acc.reduction, acc.zeros())
  return out


def backward_flops(runner: Runner, stage_params: Sequence[dict], batch) -> dict[int, tuple]:
  """Compiled FLOPs (`cost_analysis`) of B, I and W, per part the schedule splits:
  {part: (B, I, W)} (`compiled_backward`). With nothing recomputed, I + W equals B up to
  XLA's fusion choices."""
  flops = lambda c: c.cost_analysis().get("flops", 0.0)
  return {v: (flops(c["bwd"]), flops(c["input_grad"]), flops(c["weight_grad"]))
          for v, c in compiled_backward(runner, stage_params, batch).items()
          if isinstance(v, int) and "input_grad" in c}
