"""One data-parallel gradient reduction per step: per-device accumulation on a stage's submesh.

On a stage whose submesh splits the microbatch rows over data-parallel axes (axes that
split the batch and no parameter), a backward jitted over the whole submesh ends with an
all-reduce of the parameter gradients over those axes: one per microbatch, M per step.
Instead the stage's part programs run under `jax.shard_map`, manual over those axes
(`dp`) and automatic (GSPMD) over the rest, with `check_vma=False`: the cotangent of a
parameter replicated over `dp` then stays each device's partial sum (no psum is inserted),
and the gradient accumulator holds one partial sum per device, stacked on a leading dim
split over `dp` (`[D, ...]`, the same bytes per device as a replicated gradient). The
stage reduces it once, after its last backward of the step (`reduce_program`).

Inside the shard_map the part is traced on the device's rows (microbatch rows / D) under
the manual context, so the model's activation constraints name only the automatic axes
(`layers.base.constrain` drops manual ones) and its row ids continue across the devices
(`layers.base.manual_row_offset`): dropout draws the masks the whole microbatch would.

Leaf layouts at the shard_map boundary, over `dp` only (other axes stay automatic):
  split:    the array's rows (dim `d`) are split over dp: its natural layout (activations,
            their cotangents, batch leaves);
  P():      replicated over dp (params, the loss seed, microbatch index);
  STACKED:  each device's own value on a new leading dim split over dp (residuals, W
            stashes, gradient accumulators, a device's partial loss and metrics).
"""
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdtask.core import steps
from spmdtask.core.sharding import entry_axes

STACKED = "stacked"


def dp_axes(mesh: Mesh, row_specs: Sequence[P], param_specs: Sequence[P]) -> tuple[str, ...]:
  """The stage's data-parallel axes: those (of size > 1) that lead the row split (dim 0
  entry) of every value in `row_specs`, in order, and split no parameter. () when there
  are none, or a value's rows are not split that way (then the stage reduces per
  backward, as any GSPMD program would)."""
  used = {a for spec in param_specs for e in spec for a in entry_axes(e)}
  sizes = dict(mesh.shape)
  lead = None
  for spec in row_specs:
    prefix = []
    for a in entry_axes(spec[0]) if len(spec) else ():
      if a in used or sizes[a] == 1:
        break
      prefix.append(a)
    n = len(prefix) if lead is None else next(
        (i for i, (a, b) in enumerate(zip(lead, prefix)) if a != b), min(len(lead), len(prefix)))
    lead = tuple(prefix[:n])
  if not lead:
    return ()
  order = list(mesh.axis_names)
  if [order.index(a) for a in lead] != sorted(order.index(a) for a in lead):
    return ()  # rows split in an order other than the mesh's: keep GSPMD's reduction
  return lead


def size(mesh: Mesh, dp: Sequence[str]) -> int:
  return int(np.prod([dict(mesh.shape)[a] for a in dp], dtype=np.int64))


def stacked_spec(dp: Sequence[str], spec: P) -> P:
  """The PartitionSpec of a `[D, *x.shape]` accumulator of x (split as `spec`)."""
  return P(tuple(dp), *spec)


def strip(spec: P, dp: Sequence[str]) -> P:
  """`spec` without the dp axes (what a constraint names inside the manual context)."""
  drop = lambda e: (tuple(a for a in e if a not in dp) or None) if isinstance(e, tuple) else (
      None if e in dp else e)
  return P(*(drop(e) for e in spec))


def trace_local(fn: Callable, mesh: Mesh, dp: Sequence[str]):
  """`fn()` called while tracing the body of a shard_map manual over `dp` on `mesh` (so
  `axis_index` and the manual context are bound); returns what fn returned."""
  box = {}

  def body(x):
    box["out"] = fn()
    return x

  jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P(tuple(dp)), out_specs=P(tuple(dp)),
                               axis_names=set(dp), check_vma=False),
                 jax.ShapeDtypeStruct((size(mesh, dp),), jnp.int32))
  return box["out"]


def _manual(spec, dp) -> P:
  return P(tuple(dp)) if spec == STACKED else spec


def _is_spec(x) -> bool:
  return x is None or x == STACKED or isinstance(x, P)


def _map(specs, tree, f):
  """f(spec, leaf) over `tree`, `specs` a prefix of it."""
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: f(s, x), sub), specs, tree,
                      is_leaf=_is_spec)


def wrap(fn: Callable, mesh: Mesh, dp: Sequence[str], in_specs: tuple, out_specs) -> Callable:
  """fn over one device's blocks -> the same over global arrays (module doc: a spec is a
  PartitionSpec over `dp`, or STACKED; specs are prefixes of the argument/result trees)."""
  unstack = lambda s, x: x[0] if s == STACKED else x
  restack = lambda s, x: x[None] if s == STACKED else x

  def local(*args):
    args = tuple(_map(s, a, unstack) for s, a in zip(in_specs, args))
    return _map(out_specs, fn(*args), restack)

  manual = lambda specs: jax.tree.map(lambda s: _manual(s, dp), specs, is_leaf=_is_spec)
  return jax.shard_map(local, mesh=mesh, in_specs=manual(in_specs), out_specs=manual(out_specs),
                       axis_names=set(dp), check_vma=False)


class Accumulators:
  """A stage's gradient accumulators for one step, in stage_keys order: shaped and split
  like the params, or with dp axes each device's partial sums stacked (`[D, ...]`, split
  over dp on the new dim), summed once a step by `reduce`."""

  def __init__(self, mesh: Mesh, dp: Sequence[str], shapes: dict, pspecs: Sequence[P]):
    self.keys, self.dp = tuple(shapes), tuple(dp)
    lead = (size(mesh, dp),) if dp else ()
    self.specs = tuple(stacked_spec(dp, sp) if dp else sp for sp in pspecs)
    self.structs = {k: jax.ShapeDtypeStruct(lead + a.shape, a.dtype,
                                            sharding=NamedSharding(mesh, sp))
                    for (k, a), sp in zip(shapes.items(), self.specs)}
    self.zeros = steps.partition(lambda: tuple(jnp.zeros(a.shape, a.dtype)
                                               for a in self.structs.values()), mesh, (),
                                 self.specs)
    # Per-device partial sums -> their sum, split like the params: the stage's one
    # data-parallel reduction of the step.
    self.reduction = steps.partition(lambda acc: tuple(jnp.sum(a, axis=0) for a in acc), mesh,
                                     (self.specs,), tuple(pspecs),
                                     donate_argnums=(0,)) if dp else None

  def fresh(self) -> dict:
    """{path: zeros} for a new step."""
    return dict(zip(self.keys, self.zeros()))

  def reduce(self, acc: dict) -> dict:
    """The step's gradients (the identity without dp axes)."""
    if self.reduction is None:
      return acc
    return dict(zip(self.keys, self.reduction(tuple(acc[k] for k in self.keys))))
