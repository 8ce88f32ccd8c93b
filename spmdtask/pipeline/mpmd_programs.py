"""A part's jitted programs on its stage's submesh: fwd, bwd and the I / W split of bwd,
over the whole submesh (GSPMD) or per device on its data-parallel axes (mpmd_local).

  fwd(params, batch[M, ...], m, incoming_float, incoming_int) -> (outgoing, res, other)
  bwd(res, d_outgoing, acc) -> (acc + d_params, d_incoming)                  acc donated
  input_grad(res, d_outgoing) -> (d_incoming, stash)
  weight_grad(kept, stash, acc) -> acc + d_params                            acc donated

For the last part `outgoing` is `(loss,)` and `other` the loss function's aux. With dp
axes, residuals, stashes and accumulators are stacked per device; the last part's loss
and aux are each device's partial sums, added up at the end of fwd.
"""
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from spmdtask import steps
from spmdtask.pipeline import mpmd_local
from spmdtask.pipeline.mpmd_local import STACKED


def partition_part(fns: dict, mesh: Mesh, dp: Sequence[str], *, last: bool, kept: Sequence[int],
                   num_res: int, pspecs: tuple, bspecs: tuple, acc_specs: tuple,
                   rows: Sequence[bool], values: dict, act_in: tuple, act_out: tuple,
                   act_int_out: tuple) -> dict:
  """{fwd, bwd[, input_grad, weight_grad]} jitted (module doc); `fns` holds the plain
  functions of one device's rows when `dp` is given, else of the whole microbatch."""
  cot_in = (P(),) if last else None
  fwd_out = ((P(),), None, None) if last else (act_out, None, act_int_out)
  fns = _per_device(fns, mesh, dp, last, kept, num_res, rows, values) if dp else fns
  out = {"fwd": steps.partition(fns["fwd"], mesh, (pspecs, bspecs, P(), None, None), fwd_out),
         "bwd": steps.partition(fns["bwd"], mesh, (None, cot_in, acc_specs),
                                (acc_specs, act_in), donate_argnums=(2,))}
  if "input_grad" in fns:
    out["input_grad"] = steps.partition(fns["input_grad"], mesh, (None, cot_in), (act_in, None))
    out["weight_grad"] = steps.partition(fns["weight_grad"], mesh, (None, None, acc_specs),
                                         acc_specs, donate_argnums=(2,))
  return out


def _per_device(fns: dict, mesh: Mesh, dp, last: bool, kept, num_res: int, rows,
                values: dict) -> dict:
  """The same functions over global arrays, run per device on the dp axes. `rows`: per
  batch leaf, `values[kind]`: per value, whether its rows are split (else replicated)."""
  specs = {k: tuple(P(tuple(dp)) if r else P() for r in v) for k, v in values.items()}
  cot = P() if last else specs["float_out"]
  d_in = specs["float_in"]
  batch = tuple(P(None, tuple(dp)) if r else P() for r in rows)
  wrap = lambda f, ins, outs: mpmd_local.wrap(f, mesh, dp, ins, outs)
  fwd = wrap(fns["fwd"], (P(), batch, P(), specs["float_in"], specs["int_in"]),
             ((STACKED,), STACKED, STACKED) if last else
             (specs["float_out"], STACKED, specs["int_out"]))

  def fwd_total(*args):
    outs, res, other = fwd(*args)
    if last:  # each device's partial loss sum and metrics: their total
      total = lambda t: jax.tree.map(lambda x: jnp.sum(x, axis=0), t)
      return total(outs), res, total(other)
    return outs, res, other

  out = {"fwd": fwd_total, "bwd": wrap(fns["bwd"], (STACKED, cot, STACKED), (STACKED, d_in))}
  if "input_grad" in fns:
    out["input_grad"] = wrap(fns["input_grad"], (STACKED, cot), (d_in, STACKED))
    cots = (cot,) if last else cot
    kept_specs = tuple(STACKED if i < num_res else cots[i - num_res] for i in kept)
    out["weight_grad"] = wrap(fns["weight_grad"], (kept_specs, STACKED, STACKED), STACKED)
  return out
