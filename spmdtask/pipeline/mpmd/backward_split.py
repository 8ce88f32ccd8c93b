"""Splits a backward pass into input gradients (I) and weight gradients (W), zero-bubble style.

`split(bwd, *avals, weight_outputs=mask)` traces `bwd(*inputs) -> outputs` (the VJP of a
stage: residuals and output cotangents in, weight and input cotangents out), and cuts its
jaxpr in two programs that together do exactly its work, none of it twice:

  input_grad(*inputs)                   -> (input cotangents, *stash)
  weight_grad(*inputs[kept], *stash)    -> weight cotangents

I holds every equation an input cotangent depends on; W holds the rest of what the weight
cotangents need. What W reads from I is the *stash*: in a dense layer `y = x @ w`, W's
`dw = x^T @ dy` reads the layer input x (a residual, passed as a kept input) and the
layer's output cotangent dy (computed by I, stashed), so the activation-gradient chain is
never recomputed and FLOPs(I) + FLOPs(W) = FLOPs(bwd).

How: calls (jit, remat, closed_call) are inlined first (a remat's recomputation is
needed by I and stays there). The equations are then classified in one backward liveness
pass: needed by an input cotangent -> I; otherwise needed by a weight cotangent -> W.
A `scan` needed by both (a layer stack: the carry is the activation cotangent, the ys
the per-layer weight cotangents) is itself split, recursively, into an I scan that also
emits the per-iteration stash as stacked ys and a W scan that consumes it; a carry that
feeds the I side (directly or through later iterations) stays in the I scan. Any other
primitive producing both kinds (cond, while) goes to I whole: still exact, just less work
moved to W.
"""
import dataclasses
import functools
from typing import Callable, Sequence

import jax
from jax.extend import core as jcore

# Call-like primitives whose body is inlined before splitting.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint")


@dataclasses.dataclass(frozen=True)
class SplitBackward:
  """The two halves of a backward (module doc); call them with `jcore.jaxpr_as_fun`."""
  input_grad: jcore.ClosedJaxpr   # inputs -> (outputs where not weight_outputs, *stash)
  weight_grad: jcore.ClosedJaxpr  # (inputs[kept], *stash) -> outputs where weight_outputs
  kept: tuple[int, ...]           # the inputs W reads directly (e.g. residual layer inputs)
  num_stash: int

  def stash_avals(self) -> tuple:
    return tuple(v.aval for v in self.input_grad.jaxpr.outvars[
        len(self.input_grad.jaxpr.outvars) - self.num_stash:])


def _is_var(a) -> bool:
  return isinstance(a, jcore.Var) and not isinstance(a, jcore.DropVar)


def _vars(atoms) -> list:
  return [a for a in atoms if _is_var(a)]


def _eval_inlined(jaxpr, consts, *args):
  """Evaluates `jaxpr` under the current trace with call primitives inlined (also inside
  scan bodies), so that a retrace gives one flat jaxpr."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]
  for e in jaxpr.eqns:
    ins = [read(a) for a in e.invars]
    if e.primitive.name in _CALLS:
      sub = e.params.get("jaxpr", e.params.get("call_jaxpr"))
      sub = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
      outs = _eval_inlined(sub.jaxpr, sub.consts, *ins)
    elif e.primitive.name == "scan":
      body = e.params["jaxpr"]
      flat = jax.make_jaxpr(functools.partial(_eval_inlined, body.jaxpr, body.consts))(
          *(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars))
      outs = e.primitive.bind(*ins, **{**e.params, "jaxpr": flat})
    else:
      outs = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
    outs = outs if e.primitive.multiple_results else [outs]
    env.update((v, x) for v, x in zip(e.outvars, outs) if _is_var(v))
  return [read(a) for a in jaxpr.outvars]


def _partition(jaxpr, i_out: Sequence[bool], w_out: Sequence[bool]):
  """Equations of `jaxpr` -> (I eqns, W eqns, vars W reads but does not define), in order.

  An equation is I if an I output depends on it, else W if a W output does (else dropped).
  """
  live_i = {v for v, f in zip(jaxpr.outvars, i_out) if f and _is_var(v)}
  live_w = {v for v, f in zip(jaxpr.outvars, w_out) if f and _is_var(v)}
  i_eqns, w_eqns = [], []
  for e in reversed(jaxpr.eqns):
    ni = [v in live_i for v in e.outvars]
    nw = [v in live_w and not i for v, i in zip(e.outvars, ni)]
    if not any(ni) and not any(nw) and not e.effects:
      continue
    if not any(ni):
      w_eqns.append(e)
      live_w.update(_vars(e.invars))
      continue
    halves = _split_scan(e, ni, nw) if e.primitive.name == "scan" and any(nw) else None
    if halves:
      i_eqns.append(halves[0])
      w_eqns.append(halves[1])
      live_i.update(_vars(halves[0].invars))
      live_w.update(_vars(halves[1].invars))
    else:
      i_eqns.append(e)
      live_i.update(_vars(e.invars))
  i_eqns.reverse()
  w_eqns.reverse()
  made_by_w = {v for e in w_eqns for v in e.outvars}
  return i_eqns, w_eqns, live_w - made_by_w


def _needs(jaxpr, outs) -> set:
  """Every var the given outvars of `jaxpr` depend on (themselves included)."""
  live = set(_vars(outs))
  for e in reversed(jaxpr.eqns):
    if any(v in live for v in e.outvars):
      live.update(_vars(e.invars))
  return live


def _closure(body, carry_in, carry_out, start: set, outs: list, allowed) -> set:
  """Carry indices that must run together with `start` and `outs`: a carry whose input
  the selected outputs read (through any number of iterations)."""
  chosen = set(start)
  while True:
    need = _needs(body, [carry_out[k] for k in sorted(chosen)] + outs)
    more = {k for k in allowed if carry_in[k] in need} | chosen
    if more == chosen:
      return chosen
    chosen = more


def _split_scan(e, ni: list, nw: list):
  """A scan eqn -> (I scan eqn, W scan eqn), or None when nothing moves to W."""
  p = e.params
  closed, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
  body = closed.jaxpr
  consts_in, carry_in, xs_in = (body.invars[:nc], body.invars[nc:nc + nk],
                                body.invars[nc + nk:])
  carry_out, ys_out = body.outvars[:nk], body.outvars[nk:]
  ny = len(ys_out)
  ys_i = [j for j in range(ny) if ni[nk + j]]
  ys_w = [j for j in range(ny) if nw[nk + j]]
  ci = _closure(body, carry_in, carry_out, {k for k in range(nk) if ni[k]},
                [ys_out[j] for j in ys_i], range(nk))
  cw = _closure(body, carry_in, carry_out, {k for k in range(nk) if nw[k] and k not in ci},
                [ys_out[j] for j in ys_w], [k for k in range(nk) if k not in ci])
  ci, cw = sorted(ci), sorted(cw)
  mask_i = [k in ci for k in range(nk)] + [j in ys_i for j in range(ny)]
  mask_w = [k in cw for k in range(nk)] + [j in ys_w for j in range(ny)]
  i_eqns, w_eqns, w_reads = _partition(body, mask_i, mask_w)
  if not w_eqns:
    return None
  consts_w = [j for j, v in enumerate(consts_in) if v in w_reads]
  xs_w = [j for j, v in enumerate(xs_in) if v in w_reads]
  passed = set(consts_in) | set(xs_in) | {carry_in[k] for k in cw} | set(body.constvars)
  stash = [v for v in _ordered(body, i_eqns, w_reads) if v not in passed]
  length = p["length"]
  stacked = [jcore.Var(jcore.unmapped_aval(length, 0, v.aval)) for v in stash]

  def eqn(invars_outer, outvars_outer, b_in, b_out, eqns, num_consts, num_carry):
    b = jcore.Jaxpr(body.constvars, b_in, b_out, eqns,
                    effects=frozenset().union(*(q.effects for q in eqns)),
                    debug_info=body.debug_info.with_unknown_names())
    params = {**p, "jaxpr": jcore.ClosedJaxpr(b, closed.consts), "num_consts": num_consts,
              "num_carry": num_carry}
    if "linear" in p:
      params["linear"] = (False,) * len(invars_outer)
    return e.replace(invars=invars_outer, outvars=outvars_outer, params=params)

  outer_consts, outer_carry, outer_xs = e.invars[:nc], e.invars[nc:nc + nk], e.invars[nc + nk:]
  i_scan = eqn(list(outer_consts) + [outer_carry[k] for k in ci] + list(outer_xs),
               [e.outvars[k] for k in ci] + [e.outvars[nk + j] for j in ys_i] + stacked,
               list(consts_in) + [carry_in[k] for k in ci] + list(xs_in),
               [carry_out[k] for k in ci] + [ys_out[j] for j in ys_i] + stash,
               i_eqns, nc, len(ci))
  w_scan = eqn([outer_consts[j] for j in consts_w] + [outer_carry[k] for k in cw] +
               [outer_xs[j] for j in xs_w] + stacked,
               [e.outvars[k] for k in cw] + [e.outvars[nk + j] for j in ys_w],
               [consts_in[j] for j in consts_w] + [carry_in[k] for k in cw] +
               [xs_in[j] for j in xs_w] + stash,
               [carry_out[k] for k in cw] + [ys_out[j] for j in ys_w],
               w_eqns, len(consts_w), len(cw))
  return i_scan, w_scan


def _ordered(jaxpr, eqns, wanted: set) -> list:
  """`wanted` in a deterministic order: invars, then as `eqns` define them."""
  seen = list(jaxpr.constvars) + list(jaxpr.invars) + [v for e in eqns for v in e.outvars]
  return [v for v in seen if v in wanted]


def split(bwd: Callable, *avals, weight_outputs: Sequence[bool]) -> SplitBackward:
  """Traces `bwd(*avals)` (flat arrays in, a flat list out) and splits it (module doc).

  weight_outputs[i] says whether output i is a weight cotangent (computed by W); the
  others are input cotangents (computed by I).
  """
  traced = jax.make_jaxpr(bwd)(*avals)
  flat = jax.make_jaxpr(functools.partial(_eval_inlined, traced.jaxpr, traced.consts))(*avals)
  jaxpr = flat.jaxpr
  weight = list(weight_outputs)
  if len(weight) != len(jaxpr.outvars):
    raise ValueError(f"weight_outputs has {len(weight)} entries for {len(jaxpr.outvars)} "
                     "outputs")
  i_eqns, w_eqns, w_reads = _partition(jaxpr, [not w for w in weight], weight)
  kept = tuple(i for i, v in enumerate(jaxpr.invars) if v in w_reads)
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)
  stash = [v for v in _ordered(jaxpr, i_eqns, w_reads) if v not in inputs]

  def closed(invars, outvars, eqns):
    j = jcore.Jaxpr(jaxpr.constvars, invars, outvars, eqns,
                    effects=frozenset().union(*(q.effects for q in eqns)),
                    debug_info=jaxpr.debug_info.with_unknown_names())
    return jcore.ClosedJaxpr(j, flat.consts)

  input_grad = closed(jaxpr.invars, [v for v, w in zip(jaxpr.outvars, weight) if not w] + stash,
                      i_eqns)
  weight_grad = closed([jaxpr.invars[i] for i in kept] + stash,
                       [v for v, w in zip(jaxpr.outvars, weight) if w], w_eqns)
  return SplitBackward(input_grad, weight_grad, kept, len(stash))
