"""Stage markers and the splitter: one traced function -> per-stage functions.

`stage_boundary(x)` is an identity that marks a pipeline cut. `split(fn, *args)` traces
`fn` to a jaxpr and slices it at the markers into S = markers + 1 stage functions with
explicit inputs and outputs, from a cross-stage liveness analysis:

  - An equation belongs to the stage it is written in (the number of markers before it),
    except a *floating* equation: one whose inputs are only arguments, constants or other
    floating values (a parameter cast, transpose or slice, an iota). A floating equation
    is placed in every stage that consumes its result, so a stage derives what it needs
    from the parameters it holds and no weight-sized value ever crosses a boundary.
  - A value made in stage i and used in stage j > i is sent *directly* from i to j
    (not relayed through the stages between): on submeshes that is one transfer and no
    buffer on the stages in between. `Staged.crossing(b)` still lists every value live
    across boundary b (made at or before stage b, used after it).
  - A value no later stage uses is never sent; an equation whose results nobody uses is
    dropped.
  - Arguments (params, batch) go only to the stages that use them. A leaf used by two or
    more stages (a tied weight) is listed in `Staged.tied`.
  - The function's outputs are the last stage's outputs: a value made earlier and
    returned is sent to the last stage.

Markers inside a nested `jax.jit` are inlined; a marker inside any other higher-order
primitive (scan, cond, remat, custom_vjp, ...) cannot be cut and raises ValueError.
The marker's transpose is a marker too, so the backward of a marked function (its
`jax.grad` jaxpr) is cut at the same places.
"""
import dataclasses
from typing import Any, Callable

import jax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

# ---------------------------------------------------------------------------------------
# The marker primitive.

stage_boundary_p = jcore.Primitive("stage_boundary")
stage_boundary_p.multiple_results = True
stage_boundary_p.def_impl(lambda *xs: xs)
stage_boundary_p.def_abstract_eval(lambda *avals: avals)
mlir.register_lowering(stage_boundary_p, lambda ctx, *xs: xs)
batching.primitive_batchers[stage_boundary_p] = (
    lambda args, dims: (stage_boundary_p.bind(*args), dims))


def _mark_nonzero(xs):
  """Marks the entries that are not symbolic zeros (ad.Zero), in place of the list."""
  live = [x for x in xs if type(x) is not ad.Zero]
  marked = iter(stage_boundary_p.bind(*live) if live else ())
  return [x if type(x) is ad.Zero else next(marked) for x in xs]


def _jvp(primals, tangents):
  return stage_boundary_p.bind(*primals), _mark_nonzero(list(tangents))


def _transpose(cts, *primals):
  del primals  # the marker is linear in every input
  return _mark_nonzero(list(cts))


ad.primitive_jvps[stage_boundary_p] = _jvp
ad.primitive_transposes[stage_boundary_p] = _transpose


def stage_boundary(x):
  """Identity on a pytree of arrays that marks a pipeline stage cut (see module doc)."""
  leaves, tree = jax.tree.flatten(x)
  return jax.tree.unflatten(tree, stage_boundary_p.bind(*leaves) if leaves else [])


# ---------------------------------------------------------------------------------------
# The splitter.

_INLINE = ("jit", "pjit", "closed_call", "core_call")
# Views and casts of an argument: recomputed on every stage that uses them.
_VIEWS = ("convert_element_type", "transpose", "reshape", "squeeze", "expand_dims",
          "broadcast_in_dim", "slice", "copy", "copy_p", "real", "imag")


def _has_marker(jaxpr) -> bool:
  return any(e.primitive is stage_boundary_p or _sub_has_marker(e) for e in jaxpr.eqns)


def _sub_has_marker(eqn) -> bool:
  return any(_has_marker(j) for j in jcore.jaxprs_in_params(eqn.params))


def _inline(jaxpr) -> tuple[list, list]:
  """Eqns of `jaxpr`, with the jit calls that hold markers inlined.

  Returns (items, consts): items are eqns or ("alias", {call outvar: callee atom}) entries;
  consts are the callees' (constvar, value) pairs. Callee vars are renamed afresh per call,
  so a jitted function called twice gives distinct values.
  """
  items, consts = [], []
  for e in jaxpr.eqns:
    if e.primitive is stage_boundary_p or not _sub_has_marker(e):
      items.append(e)
      continue
    if e.primitive.name not in _INLINE:
      raise ValueError(
          f"A stage_boundary sits inside a `{e.primitive.name}` (scan, cond, remat, "
          "custom_vjp, ...): a pipeline cut cannot be made inside it. Move the marker to the "
          "top level of the function (e.g. unroll the layer loop around the cut).")
    sub = e.params.get("jaxpr", e.params.get("call_jaxpr"))
    closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
    inner = closed.jaxpr
    sub_items, sub_consts = _inline(inner)
    rename = dict(zip(inner.invars, e.invars))

    def fresh(v):
      if not isinstance(v, jcore.Var):
        return v
      if v not in rename:
        rename[v] = jcore.Var(v.aval)
      return rename[v]

    for c, val in list(zip(inner.constvars, closed.consts)) + sub_consts:
      consts.append((fresh(c), val))
    for it in sub_items:
      if isinstance(it, tuple):
        items.append(("alias", {fresh(k): fresh(v) for k, v in it[1].items()}))
      else:
        items.append(it.replace(invars=[fresh(v) for v in it.invars],
                                outvars=[fresh(v) for v in it.outvars]))
    items.append(("alias", {o: fresh(v) for o, v in zip(e.outvars, inner.outvars)}))
  return items, consts


@dataclasses.dataclass(frozen=True)
class Value:
  """A value sent between stages: made by stage `producer`, used by stages `consumers`."""
  id: int
  aval: Any
  producer: int
  consumers: tuple[int, ...]

  def __str__(self) -> str:
    return (f"v{self.id}:{self.aval.str_short()} stage {self.producer} -> "
            f"{','.join(map(str, self.consumers))}")


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage's function `(stage_args, incoming) -> outgoing`.

  arg_leaves: indices into the flat leaves of the split function's arguments.
  incoming: ids of the values received (from any earlier stage), in order.
  outgoing: ids of the values sent on (any later stage). The last stage's outgoing is
    empty: it returns the function's flat outputs instead.
  """
  index: int
  arg_leaves: tuple[int, ...]
  incoming: tuple[int, ...]
  outgoing: tuple[int, ...]
  jaxpr: Any  # ClosedJaxpr: invars = arg leaves + incoming, outvars = outgoing / outputs

  def __call__(self, stage_args, incoming) -> tuple:
    return tuple(jcore.jaxpr_as_fun(self.jaxpr)(*stage_args, *incoming))


@dataclasses.dataclass(frozen=True)
class Staged:
  """A function cut into stages. Composing the stages in order gives the function."""
  stages: tuple[Stage, ...]
  values: dict  # id -> Value
  arg_paths: tuple[str, ...]  # keystr of every flat argument leaf
  in_tree: Any
  out_tree: Any

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  @property
  def tied(self) -> dict[int, tuple[int, ...]]:
    """Flat argument leaf -> the stages using it, for leaves used by more than one stage."""
    users = {}
    for st in self.stages:
      for i in st.arg_leaves:
        users.setdefault(i, []).append(st.index)
    return {i: tuple(s) for i, s in sorted(users.items()) if len(s) > 1}

  def crossing(self, boundary: int) -> tuple[Value, ...]:
    """Values live across the cut between stage `boundary` and `boundary + 1`."""
    return tuple(v for v in self.values.values()
                 if v.producer <= boundary < max(v.consumers))

  def __call__(self, *args):
    """Runs the stages one after the other (a sequential reference)."""
    leaves = jax.tree.leaves(args)
    have = {}
    for st in self.stages:
      out = st([leaves[i] for i in st.arg_leaves], [have[v] for v in st.incoming])
      if st.index == self.num_stages - 1:
        return jax.tree.unflatten(self.out_tree, out)
      have.update(zip(st.outgoing, out))

  def describe(self) -> str:
    """One line per stage: the argument leaves it takes, what it receives and sends."""
    lines = []
    for st in self.stages:
      args = ", ".join(self.arg_paths[i] for i in st.arg_leaves)
      lines.append(f"stage {st.index}: args [{args}] in {list(st.incoming)} "
                   f"out {list(st.outgoing)}")
    lines += [str(v) for v in self.values.values()]
    return "\n".join(lines)


def split(fn: Callable, *example_args) -> Staged:
  """Traces `fn(*example_args)` and cuts it at its `stage_boundary` markers (module doc).

  `example_args` may be arrays or jax.ShapeDtypeStructs; only shapes and dtypes matter.
  """
  closed = jax.make_jaxpr(fn)(*example_args)
  out_tree = jax.tree.structure(jax.eval_shape(fn, *example_args))
  flat_paths, in_tree = jax.tree_util.tree_flatten_with_path(example_args)
  arg_paths = tuple(jax.tree_util.keystr(p) for p, _ in flat_paths)
  jaxpr = closed.jaxpr
  eqns, inner_consts = _inline(jaxpr)
  consts = dict(zip(jaxpr.constvars, closed.consts))
  consts.update(inner_consts)

  # Positional stage of every eqn; marker outputs alias their inputs.
  alias, placed, pinned, pos = {}, [], [], 0

  def resolve(a):
    while isinstance(a, jcore.Var) and a in alias:
      a = alias[a]
    return a

  for e in eqns:
    if isinstance(e, tuple):  # outputs of an inlined call
      alias.update(e[1])
    elif e.primitive is stage_boundary_p:
      alias.update(zip(e.outvars, e.invars))
      pinned += [(v, pos) for v in e.invars if isinstance(v, jcore.Var)]
      pos += 1
    else:
      placed.append((e, pos))
  num_stages = pos + 1
  pinned = [(resolve(v), s) for v, s in pinned]
  placed = [(e.replace(invars=[resolve(v) for v in e.invars]), s) for e, s in placed]
  outvars = [resolve(v) for v in jaxpr.outvars]

  arg_vars = set(jaxpr.invars) | set(consts)
  floating_vars, view_vars, kinds = set(arg_vars), set(arg_vars), []
  for e, _ in placed:
    ins = [v for v in e.invars if isinstance(v, jcore.Var)]
    kind = "fixed"
    if not e.effects and all(v in floating_vars for v in ins):
      floating_vars.update(e.outvars)
      kind = "floating"
      if e.primitive.name in _VIEWS and all(v in view_vars for v in ins):
        view_vars.update(e.outvars)
        kind = "view"
    kinds.append(kind)

  # Backward liveness: users[var] = the stages that read var. A marker's inputs are read by
  # the stage before its cut (they are that stage's results).
  users: dict = {}
  for v in outvars:
    if isinstance(v, jcore.Var):
      users.setdefault(v, set()).add(num_stages - 1)
  for v, s in pinned:
    users.setdefault(v, set()).add(s)
  stage_eqns = [[] for _ in range(num_stages)]
  producer = {}
  for (e, pos), kind in zip(reversed(placed), reversed(kinds)):
    need = set().union(*(users.get(v, set()) for v in e.outvars))
    if kind == "view":  # recomputed wherever used
      where = need
    elif kind == "floating":  # the stage of its first consumer
      where = {min(need)} if need else set()
    else:
      where = {pos} if need or e.effects else set()
    for s in where:
      stage_eqns[s].append(e)
    if kind != "view" and where:
      producer.update((v, min(where)) for v in e.outvars)
    for v in e.invars:
      if isinstance(v, jcore.Var):
        users.setdefault(v, set()).update(where)
  for s in stage_eqns:
    s.reverse()

  values, ids = {}, {}
  for e, _ in placed:  # ids in program order
    for v in e.outvars:
      later = sorted(u for u in users.get(v, ()) if v in producer and u > producer[v])
      if later:
        ids[v] = len(values)
        values[ids[v]] = Value(ids[v], v.aval, producer[v], tuple(later))
  var_of = {i: v for v, i in ids.items()}

  stages = []
  for s in range(num_stages):
    arg_leaves = tuple(i for i, v in enumerate(jaxpr.invars) if s in users.get(v, ()))
    const_vars = [v for v in consts if s in users.get(v, ())]
    incoming = tuple(i for i, v in values.items() if s in v.consumers)
    last = s == num_stages - 1
    outgoing = () if last else tuple(i for i, v in values.items() if v.producer == s)
    outs = outvars if last else [var_of[i] for i in outgoing]
    body = stage_eqns[s]
    sub = jcore.Jaxpr(const_vars, [jaxpr.invars[i] for i in arg_leaves] +
                      [var_of[i] for i in incoming], outs, body,
                      effects=frozenset().union(*(e.effects for e in body)),
                      debug_info=jaxpr.debug_info)
    stages.append(Stage(s, arg_leaves, incoming, outgoing,
                        jcore.ClosedJaxpr(sub, [consts[v] for v in const_vars])))
  return Staged(tuple(stages), values, arg_paths, in_tree, out_tree)
