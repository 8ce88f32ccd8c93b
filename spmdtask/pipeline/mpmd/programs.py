"""A part's jitted programs on its stage's submesh: fwd, bwd and the I / W split of bwd,
over the whole submesh (GSPMD) or per device on its data-parallel axes (mpmd.local).

  fwd(params, batch[M, ...], m, incoming_float, incoming_int) -> (outgoing, res, other)
  bwd(res, d_outgoing, acc) -> (acc + d_params, d_incoming)                  acc donated
  input_grad(res, d_outgoing) -> (d_incoming, stash)
  weight_grad(kept, stash, acc) -> acc + d_params                            acc donated
  fused: the last part's fwd then bwd (or input_grad) as one program (mpmd.parts.Part)

For the last part `outgoing` is `(loss,)` and `other` the loss function's aux. With dp
axes, residuals, stashes and accumulators are stacked per device; the last part's loss
and aux are each device's partial sums, added up at the end of fwd.
"""
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdtask.core import steps
from spmdtask.pipeline.mpmd import local as mpmd_local
from spmdtask.pipeline.mpmd.local import STACKED
from spmdtask.pipeline.mpmd.parts import Part, is_float, kept_inputs, split_backward


def partition_part(fns: dict, mesh: Mesh, dp: Sequence[str], *, last: bool, kept: Sequence[int],
                   num_res: int, pspecs: tuple, bspecs: tuple, acc_specs: tuple,
                   rows: Sequence[bool], values: dict, act_in: tuple, act_out: tuple,
                   act_int_out: tuple, fuse: bool = False) -> dict:
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
  if fuse:
    fwd_in = (pspecs, bspecs, P(), None, None)
    out["fused"] = (steps.partition(_fused_i(fns, kept), mesh, fwd_in + (cot_in,),
                                    (fwd_out[0], fwd_out[2], act_in, None, None))
                    if "input_grad" in fns else
                    steps.partition(_fused_b(fns), mesh, fwd_in + (cot_in, acc_specs),
                                    (fwd_out[0], fwd_out[2], acc_specs, act_in),
                                    donate_argnums=(6,)))
  return out


def _fused_b(fns: dict):
  def fused(p, batch, m, fin, iin, cot, acc):
    outs, res, other = fns["fwd"](p, batch, m, fin, iin)
    new, d_in = fns["bwd"](res, cot, acc)
    return outs, other, new, d_in
  return fused


def _fused_i(fns: dict, kept: Sequence[int]):
  def fused(p, batch, m, fin, iin, cot):
    outs, res, other = fns["fwd"](p, batch, m, fin, iin)
    d_in, stash = fns["input_grad"](res, cot)
    return outs, other, d_in, kept_inputs(res, cot, kept), stash
  return fused


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


def build_part(pl, v: int) -> Part:
  """Part v of the Pipeline `pl`: its function cut from the traced loss (on one device's
  rows with dp axes), differentiated by `jax.fwd_and_bwd`, split into I / W where the
  schedule splits it, and jitted on its stage's submesh (`partition_part`)."""
  st, s = pl.traced_on_stage(v), pl.part_stage[v]
  spec, dp = pl.stages[s], pl.dp[s]
  last = v == pl.staged.num_stages - 1
  pleaves = [i for i in st.arg_leaves if i < pl.num_params]
  bleaves = tuple(i - pl.num_params for i in st.arg_leaves if i >= pl.num_params)
  aval = lambda i: pl.values[i].aval
  float_in = tuple(i for i in st.incoming if is_float(aval(i)))
  int_in = tuple(i for i in st.incoming if not is_float(aval(i)))
  float_out = tuple(i for i in st.outgoing if is_float(aval(i)))
  int_out = tuple(i for i in st.outgoing if not is_float(aval(i)))

  def part_fn(p, batch, m, fin, iin):
    mb = [jax.lax.dynamic_index_in_dim(b, m, keepdims=False) for b in batch]
    fin, iin = constrain(fin, float_in), constrain(iin, int_in)
    have = dict(zip(float_in + int_in, fin + iin))
    outs = st(list(p) + mb, [have[i] for i in st.incoming])
    if last:
      return (outs[0],), tuple(outs[1:])
    got = dict(zip(st.outgoing, outs))
    return tuple(got[i] for i in float_out), tuple(got[i] for i in int_out)

  fwd, bwd = jax.fwd_and_bwd(part_fn, argnums=(0, 3), has_aux=True, jitted=False)

  def bwd_acc(res, cot, acc):
    d_params, d_in = bwd(res, cot if last else constrain(cot, float_out))
    return tuple(a + g for a, g in zip(acc, d_params)), d_in

  pspecs = tuple(pl.param_specs[s][i] for i in pleaves)
  bspecs = tuple(P(None, *pl.batch_specs[s][j]) for j in bleaves)
  act = lambda ids: tuple(spec.spec_for(aval(i)) for i in ids)

  def constrain(xs, ids):  # values arrive in their sender's layout (see `_send`)
    if dp:  # inside the stage's shard_map: the automatic axes only
      return tuple(jax.lax.with_sharding_constraint(x, mpmd_local.strip(sp, dp))
                   for x, sp in zip(xs, act(ids)))
    return tuple(jax.lax.with_sharding_constraint(x, NamedSharding(spec.mesh, sp))
                 for x, sp in zip(xs, act(ids)))

  fns = {"fwd": fwd, "bwd": bwd_acc}
  kept, num_res = (), 0
  if v in pl.split_parts:
    local = lambda a, split=True: (jax.ShapeDtypeStruct(
        (a.shape[0] // mpmd_local.size(spec.mesh, dp), *a.shape[1:]), a.dtype) if dp and split
                                   else a)
    rows = pl.rows_split(s)
    args = ([pl.param_shapes[i] for i in pleaves],
            [jax.ShapeDtypeStruct((a.shape[0], *local(
                jax.ShapeDtypeStruct(a.shape[1:], a.dtype), rows[j]).shape), a.dtype)
             for j, a in ((j, pl.batch_avals[j]) for j in bleaves)],
            jax.ShapeDtypeStruct((), jnp.int32), [local(aval(i)) for i in float_in],
            [local(aval(i)) for i in int_in])
    cut = lambda: split_backward(fwd, bwd, args,
                                 (lambda c: c) if last else lambda c: constrain(c, float_out))
    fns["input_grad"], fns["weight_grad"], kept, num_res = (
        mpmd_local.trace_local(cut, spec.mesh, dp) if dp else cut())
  progs = partition_part(
      fns, spec.mesh, dp, last=last, kept=kept, num_res=num_res, pspecs=pspecs, bspecs=bspecs,
      acc_specs=tuple(mpmd_local.stacked_spec(dp, sp) if dp else sp for sp in pspecs),
      rows=tuple(pl.rows_split(s)[j] for j in bleaves),
      values={k: tuple(bool(dp) and pl.row_split(s, i) for i in ids) for k, ids in (
          ("float_in", float_in), ("int_in", int_in), ("float_out", float_out),
          ("int_out", int_out))},
      act_in=act(float_in), act_out=act(float_out), act_int_out=act(int_out),
      fuse=v == pl.fused)
  return Part(v, s, tuple(pl.paths[i] for i in pleaves), bleaves, float_in, int_in,
              float_out, int_out, kept=kept, **progs)
