"""Matmul FLOPs of a traced step, loops multiplied out: what remat's recompute costs. Pure.

`compiled.cost_analysis()` counts a loop body once, and a train step's layers,
microbatches and pipeline iterations are loops, so it cannot tell a policy that
recomputes each layer's forward from one that does not. The jaxpr of the differentiated
step can: the backward of a rematerialized layer holds the recomputed forward
explicitly, and a scan says how many times its body runs. This counts 2·M·N·K per
`dot_general` and grouped matmul (`ragged_dot`: each row against its own group's weights)
(and per convolution output element and kernel tap) through every
nested jaxpr, times the trip counts of the scans around it, the manual shards of a
`shard_map` (whose body is traced per shard) and the grid of a Pallas kernel (its body
works on one block; a kernel's own `cost_estimate` wins where it gives one, e.g. megablox
gmm's 2·m·k·n; splash attention's kernels count only the grid points their block mask
runs, `_splash_share`); cuDNN's fused
attention by its shapes (2 matmuls forward, 5 backward). A `while`
with no static trip count counts once. Elementwise work is not counted: on a
transformer it is a small share, and remat changes it in proportion.
"""
import math
from typing import Any, Callable

import numpy as np

import jax
from jax.extend import core
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public API


def _dot_flops(eqn) -> float:
  lhs = eqn.invars[0].aval
  (contract, _), _ = eqn.params["dimension_numbers"]
  return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in contract)


def _conv_flops(eqn) -> float:
  rhs = eqn.invars[1].aval
  dn = eqn.params["dimension_numbers"]
  out_feature = rhs.shape[dn.rhs_spec[0]]
  return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs.shape) / out_feature


def _ragged_dot_flops(eqn) -> float:
  """A grouped matmul (`lax.ragged_dot`): each row meets one group's weights, so it costs
  what one dense matmul of the rows does. Where the ragged dim is contracted (the weights'
  gradient, [groups, ...] out), each group's output sums only its own rows."""
  dims = eqn.params["ragged_dot_dimension_numbers"]
  (contract, _), _ = dims.dot_dimension_numbers
  lhs = eqn.invars[0].aval
  out = math.prod(eqn.outvars[0].aval.shape)
  if set(dims.lhs_ragged_dimensions) & set(contract):
    out //= eqn.invars[2].aval.shape[0]  # the groups: one output block each
  return 2.0 * out * math.prod(lhs.shape[d] for d in contract)


_COUNTERS = {"dot_general": _dot_flops, "conv_general_dilated": _conv_flops,
             "ragged_dot_general": _ragged_dot_flops}

# cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) traces
# as one primitive per direction, with no dot inside: its forward is two matmuls (QK^T,
# PV); its backward five (QK^T again, dP, dV, dQ, dK).
_ATTENTION_MATMULS = {"dot_product_attention_fwd_wrapper": 2,
                      "dot_product_attention_bwd_wrapper": 5}


def _attention_flops(eqn) -> float:
  """2·b·h·t·s·d per matmul of a cuDNN attention call, q [b, t, h, d] and k [b, s, kv, d]
  (layout 0) or [b, h, t, d] (layout 1), no masked block skipped."""
  q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  if int(eqn.params.get("layout", 0)) == 0:
    (b, t, h, d), s = q, k[1]
  else:
    (b, h, t, d), s = q, k[2]
  return _ATTENTION_MATMULS[eqn.primitive.name] * 2.0 * b * h * t * s * d


def _sub_jaxprs(params: dict[str, Any]):
  """(jaxpr, its closed-over constants as {var: value}) of each jaxpr an equation runs."""
  for value in params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(v, core.ClosedJaxpr):
        yield v.jaxpr, dict(zip(v.jaxpr.constvars, v.consts))
      elif isinstance(v, core.Jaxpr):
        yield v, {}


def _known_inside(eqn, sub: core.Jaxpr, known: dict) -> dict:
  """The constants among `eqn`'s operands that `sub` (a jaxpr it runs) receives, keyed by
  `sub`'s input variables: operands in order (a cond's branches after its predicate)."""
  operands = eqn.invars[1:] if eqn.primitive.name == "cond" else eqn.invars
  if len(operands) != len(sub.invars):  # e.g. a while's split constants: not followed
    return {}
  return {inner: known[outer] for inner, outer in zip(sub.invars, operands)
          if isinstance(outer, core.Var) and outer in known}


def _splash_share(eqn, known: dict) -> float:
  """The share of a splash attention kernel's grid points that run: its block mask (the
  second scalar-prefetch operand, [heads or 1, blocks, blocks], 0 where a block is wholly
  masked) skips the rest, e.g. a causal mask's upper triangle. 1.0 for any other kernel,
  or where the mask is not a constant of the trace. Over a mask split across shards (a
  shard_map's operand) the global mask's share is the shards' mean, which is what the
  shard count multiplies."""
  name = str(eqn.params.get("name") or "")
  mask = known.get(eqn.invars[1]) if len(eqn.invars) > 1 and isinstance(
      eqn.invars[1], core.Var) else None
  if not name.startswith("splash") or mask is None:
    return 1.0
  mask = np.asarray(mask)
  if mask.ndim != 3 or not np.issubdtype(mask.dtype, np.integer) or not mask.size:
    return 1.0
  return float(np.count_nonzero(mask)) / mask.size


def _repeats(eqn) -> int:
  """How many times an equation's sub-jaxprs run per run of the equation."""
  name = eqn.primitive.name
  if name == "pallas_call":  # the kernel body runs once per grid point, on blocks
    return math.prod(int(g) for g in eqn.params["grid_mapping"].grid)
  if name == "scan":
    return int(eqn.params["length"])
  if name == "shard_map":
    mesh = eqn.params["mesh"]
    manual = eqn.params.get("newly_manual_axes") or mesh.axis_names
    return math.prod(mesh.shape[a] for a in manual)
  return 1


def jaxpr_flops(jaxpr: core.Jaxpr, kernels_only: bool = False, known: dict | None = None
                ) -> float:
  """Matmul FLOPs of one run of `jaxpr` (all devices together); with `kernels_only`, only
  those inside fused kernels, Pallas's (megablox gmm, splash attention) and cuDNN's
  attention (what XLA's cost analysis cannot see in a custom call). `known`: the values of
  its constant variables (a ClosedJaxpr's consts), which splash's block masks are."""
  known = known or {}
  total = 0.0
  for eqn in jaxpr.eqns:
    count = _COUNTERS.get(eqn.primitive.name)
    if count is not None:
      total += 0.0 if kernels_only else count(eqn)
      continue
    if eqn.primitive.name in _ATTENTION_MATMULS:  # a kernel: counted with kernels_only too
      total += _attention_flops(eqn)
      continue
    kernel = eqn.primitive.name == "pallas_call"
    estimate = eqn.params.get("cost_estimate") if kernel else None
    if estimate is not None and estimate.flops:
      # The kernel's own count (megablox gmm's 2·m·k·n). XLA:TPU's compiled cost_analysis
      # reads it from the custom call, but the per-step analysis (plan.xla_cost, a CPU
      # client's HloCostAnalysis of the optimized module) does not: counted as a kernel's.
      total += float(estimate.flops)
      continue
    subs = [jaxpr_flops(j, kernels_only and not kernel,
                        {**consts, **_known_inside(eqn, j, known)})
            for j, consts in _sub_jaxprs(eqn.params)]
    if eqn.primitive.name == "cond":
      total += max(subs, default=0.0)  # one branch runs
    else:
      share = _splash_share(eqn, known) if kernel else 1.0
      total += _repeats(eqn) * share * sum(subs)
  return total


def closed_flops(closed: core.ClosedJaxpr, kernels_only: bool = False) -> float:
  """`jaxpr_flops` of a traced function (`jax.make_jaxpr`'s), its unused equations dropped
  (`needed`) and its constants known."""
  return jaxpr_flops(needed(closed.jaxpr), kernels_only,
                     dict(zip(closed.jaxpr.constvars, closed.consts)))


def needed(jaxpr: core.Jaxpr) -> core.Jaxpr:
  """`jaxpr` without the equations no output needs, as the compiled program drops them:
  e.g. megablox's custom VJP forms the weight gradient (tgmm) of a frozen (LoRA) expert
  weight, which nothing reads."""
  return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]


def traced_flops(fn: Callable, *args, kernels_only: bool = False) -> float:
  """Matmul FLOPs of one call `fn(*args)` (args may be ShapeDtypeStructs), all devices;
  with `kernels_only`, those inside Pallas kernels."""
  return closed_flops(jax.make_jaxpr(fn)(*args), kernels_only)
