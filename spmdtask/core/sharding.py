"""The partitioner's pure functions: shapes and split-dims mappings in, PartitionSpecs out.

A split-dims mapping is carried as a `PartitionSpec` with one entry per tensor
dim. Nothing here touches devices: a mesh is given as `{axis_name: size}`.
"""
import math
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from spmdtask.errors import BatchSplitError, ConfigError

MeshShape = Mapping[str, int]


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def entry_axes(entry: None | str | Sequence[str]) -> tuple[str, ...]:
  """The mesh axes of one split-dims entry."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def validate(split: Sequence, shape: Sequence[int], mesh_shape: MeshShape, where: str) -> None:
  """Checks one split-dims mapping against a tensor shape and the mesh axes.

  Args:
    split: one entry per dim: None, an axis name, or a tuple of axis names.
    shape: the tensor's logical shape.
    mesh_shape: axis name -> size.
    where: the config field or tensor the mapping came from, for the message.
  Raises:
    ConfigError: rank mismatch, unknown axis, or an axis used twice.
  """
  split = tuple(split)
  if len(split) != len(shape):
    raise ConfigError(
        f"{where}: split-dims mapping {split} has {len(split)} entries, but the tensor has rank "
        f"{len(shape)} (shape {tuple(shape)}). Give exactly one entry per dim (None = replicated).")
  used = [a for e in split for a in entry_axes(e)]
  for axis in used:
    if axis not in mesh_shape:
      raise ConfigError(
          f"{where}: split-dims mapping {split} names mesh axis {axis!r}, which is not in "
          f"task.mesh_axis_names={tuple(mesh_shape)}. Use one of those axes or None.")
  dup = sorted({a for a in used if used.count(a) > 1})
  if dup:
    raise ConfigError(
        f"{where}: split-dims mapping {split} uses mesh axis {dup[0]!r} on more than one dim. "
        "A mesh axis can shard at most one dim of a tensor; replace the extra use with None.")


def shards(entry, mesh_shape: MeshShape) -> int:
  """How many ways one split-dims entry cuts its dim."""
  return math.prod(mesh_shape[a] for a in entry_axes(entry))


def padded_shape(shape: Sequence[int], split: Sequence, mesh_shape: MeshShape) -> tuple[int, ...]:
  """Each dim rounded up to a multiple of the number of shards it is split into."""
  return tuple(-(-d // shards(e, mesh_shape)) * shards(e, mesh_shape) for d, e in zip(shape, split))


def replicated(x) -> P:
  return P(*([None] * len(np.shape(x))))


def path_keys(path) -> tuple[str, ...]:
  """A pytree key path as plain strings: dict keys, attribute names, sequence indices."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def path_str(path) -> str:
  return "/".join(path_keys(path))


def validate_tree(shapes, splits, mesh_shape: MeshShape, what: str) -> None:
  """`validate` for every leaf, naming each leaf by its path under `what`."""
  def check(path, x, s):
    validate(s, x.shape, mesh_shape, f"{what} {path_str(path)!r}")
  jax.tree_util.tree_map_with_path(check, shapes, splits)


@runtime_checkable
class DeclaresSplitDims(Protocol):
  """An optimizer-state node (e.g. an optax state NamedTuple) that says how it is split.

  `split_dims(param_splits)` gets the params' PartitionSpecs and returns PartitionSpecs for
  this node's leaves, in a tree of the node's structure. Use it for state the generic
  rules cannot place, e.g. a Shampoo-style [d, d] preconditioner per param.
  """

  def split_dims(self, param_splits) -> Any:
    ...


REPLICATED_WARN_BYTES = 1 << 20


def opt_state_split_dims(tx, opt_shapes, param_shapes, param_splits) -> tuple[Any, list[str]]:
  """A PartitionSpec for every optimizer-state leaf, and warnings about replicated ones.

  In order of precedence:
    1. a state node that declares its split dims (`DeclaresSplitDims`);
    2. a leaf that optax itself identifies as a copy of the params
       (`optax.tree_map_params`: Adam's moments, momentum, ...) and has its param's
       shape gets its param's spec;
    3. the path/shape fallback (`_fallback_split_dims`): Adafactor's factored
       statistics drop the reduced dim's entry; anything else is replicated.
  The warnings name every leaf above 1 MiB that ends up replicated while the param it
  belongs to is split (it costs the full array on every device).
  """
  def paths(tree):
    return {tuple(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is None or _is_spec(x))[0]}

  declared = {}
  def visit(path, node):
    if isinstance(node, DeclaresSplitDims):
      for sub, spec in paths(node.split_dims(param_splits)).items():
        declared[tuple(path) + sub] = spec
  jax.tree_util.tree_map_with_path(visit, opt_shapes,
                                   is_leaf=lambda x: isinstance(x, DeclaresSplitDims))
  # optax matches by tree structure (Adafactor's v_row mirrors the params' tree too), so
  # only a leaf of its param's shape takes the param's spec.
  # optax.masked's masked-out params (a LoRA model's frozen ones) hold no state: MaskedNode.
  masked = lambda x: isinstance(x, optax.MaskedNode)
  from_params = paths(optax.tree_utils.tree_map_params(
      tx, lambda leaf, spec, param: None if masked(leaf) or tuple(leaf.shape) != tuple(
          param.shape) else spec,
      opt_shapes, param_splits, param_shapes, transform_non_params=lambda _: None,
      is_leaf=masked))
  fallback, owners = _fallback_split_dims(opt_shapes, param_shapes, param_splits)
  fallback = paths(fallback)
  warnings = []

  def choose(path, leaf):
    path = tuple(path)
    spec = next(c for c in (declared.get(path), from_params.get(path), fallback[path])
                if c is not None)
    owner = owners.get(path)
    size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    if (size > REPLICATED_WARN_BYTES and not any(entry_axes(e) for e in spec)
        and owner is not None and any(entry_axes(e) for e in owner)):
      warnings.append(
          f"optimizer state {path_str(path)!r} {tuple(leaf.shape)} ({size / 2**20:.1f} MiB) is "
          f"replicated on every device while its param is split {owner}: give its "
          "transformation's state a split_dims(param_splits) method (DeclaresSplitDims).")
    return spec

  return jax.tree_util.tree_map_with_path(choose, opt_shapes), warnings


def _fallback_split_dims(opt_shapes, param_shapes, param_splits):
  """The path/shape rule, and the split of the param each leaf belongs to (by path).

  An optax state leaf whose path ends with a param's path belongs to that param:
    - same shape as the param: the param's mapping;
    - the param's shape with one dim removed (Adafactor's factored row/column
      statistics): the param's mapping with that dim's entry removed;
    - anything else (scalars, placeholder (1,) arrays): replicated.
  Leaves that belong to no param (counters) are replicated.
  """
  params = {tuple(p): (x, s) for (p, x), (_, s) in zip(
      jax.tree_util.tree_flatten_with_path(param_shapes)[0],
      jax.tree_util.tree_flatten_with_path(param_splits, is_leaf=_is_spec)[0])}
  depth = sorted({len(p) for p in params}, reverse=True)  # longest match first
  owners = {}

  def owner(path):
    for n in depth:
      if len(path) >= n and tuple(path[-n:]) in params:
        return params[tuple(path[-n:])], path[-n - 1] if len(path) > n else None
    return (None, None), None

  def split_of(path, leaf):
    (pshape, psplit), parent = owner(path)
    if pshape is None:
      return replicated(leaf)
    owners[tuple(path)] = psplit
    shape, full = tuple(leaf.shape), tuple(pshape.shape)
    if shape == full:
      return psplit
    if len(shape) == len(full) - 1:
      removed = _removed_dim(full, shape, getattr(parent, "name", None))
      if removed is not None:
        return P(*(e for i, e in enumerate(psplit) if i != removed))
    return replicated(leaf)

  return jax.tree_util.tree_map_with_path(split_of, opt_shapes), owners


def _removed_dim(full: tuple[int, ...], reduced: tuple[int, ...], field: str | None) -> int | None:
  """Which dim of `full` was reduced away to give `reduced`.

  Where several dims fit (e.g. a square matrix), Adafactor's own rule decides:
  `v_row` drops the largest dim and `v_col` the second largest.
  """
  fits = [i for i in range(len(full)) if full[:i] + full[i + 1:] == reduced]
  if len(fits) <= 1 or field not in ("v_row", "v_col"):
    return fits[0] if fits else None
  from optax._src import factorized  # pylint: disable=g-import-not-at-top
  dims = factorized._factored_dims(full, True, 0)  # pylint: disable=protected-access
  if dims is None:
    return fits[0]
  second, largest = dims
  return largest if field == "v_row" else second


def even_split(split: P, shape: Sequence[int], mesh_shape: MeshShape) -> P:
  """`split` with each entry that does not divide its dim replaced by None (replicated).

  The sharding of a LOGICAL (unpadded) array outside a step, e.g. in a checkpoint.
  """
  entries = tuple(split) + (None,) * (len(shape) - len(tuple(split)))
  return P(*(e if d % shards(e, mesh_shape) == 0 else None for d, e in zip(shape, entries)))


def spread(split: P, shape: Sequence[int], mesh_shape: MeshShape) -> P:
  """`even_split(split)` with each mesh axis it leaves unused (size > 1) added to a dim that
  axis divides, the largest dim left first: the tensor cut over as many devices as its shape
  allows. A value computed under it and then laid out as `split` is computed once over the
  mesh and gathered, rather than in full on each device that holds it whole."""
  entries = [list(entry_axes(e)) for e in even_split(split, shape, mesh_shape)]
  used = {a for e in entries for a in e}
  left = [d // shards(tuple(e), mesh_shape) for d, e in zip(shape, entries)]
  for axis, size in sorted(mesh_shape.items(), key=lambda kv: -kv[1]):
    if size > 1 and axis not in used:
      fits = [d for d in range(len(shape)) if left[d] % size == 0]
      if fits:
        d = max(fits, key=lambda d: left[d])
        entries[d].append(axis)
        left[d] //= size
  return P(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries))


def even_splits(shapes, splits, mesh_shape: MeshShape):
  """`even_split` for every leaf."""
  return jax.tree.map(lambda x, s: even_split(s, x.shape, mesh_shape), shapes, splits)


def padded_shapes(shapes, splits, mesh_shape: MeshShape):
  """ShapeDtypeStructs of the on-device (padded) state."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(padded_shape(x.shape, s, mesh_shape), x.dtype),
      shapes, splits)


def padding_report(shapes, splits, mesh_shape: MeshShape) -> dict[str, tuple]:
  """Path -> (logical shape, padded shape) for every leaf that is padded."""
  out = {}
  def visit(path, x, s):
    padded = padded_shape(x.shape, s, mesh_shape)
    if padded != tuple(x.shape):
      out[path_str(path)] = (tuple(x.shape), padded)
  jax.tree_util.tree_map_with_path(visit, shapes, splits)
  return out


def pad(tree, padded):
  """Zero-pads every leaf up to its padded shape (a no-op where none is needed)."""
  def one(x, target):
    widths = [(0, t - d) for d, t in zip(x.shape, target.shape)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x
  return jax.tree.map(one, tree, padded)


def unpad(tree, logical):
  """Slices every leaf back to its logical shape (a no-op where none is needed)."""
  def one(x, target):
    if tuple(x.shape) == tuple(target.shape):
      return x
    return jax.lax.slice(x, (0,) * x.ndim, tuple(target.shape))
  return jax.tree.map(one, tree, logical)


def input_split_dims(batch_shapes, inputs_split_mapping: Mapping[str, Sequence] | None,
                     batch_axes: Sequence[str], mesh_shape: MeshShape):
  """A split-dims mapping per input array, chosen by its rank.

  `inputs_split_mapping['map_{rank}d']` when given; by default the batch dim
  (dim 0) is split over `batch_axes` and the other dims are replicated.
  Raises ConfigError when a rank has no mapping or the batch does not divide.
  """
  def split_of(path, x):
    rank = len(x.shape)
    key = f"map_{rank}d"
    if inputs_split_mapping is not None:
      if key not in inputs_split_mapping:
        raise ConfigError(
            f"task.train.inputs_split_mapping has no {key!r} entry, but input "
            f"{path_str(path)!r} has rank {rank} (shape {tuple(x.shape)}). Add {key} to "
            f"inputs_split_mapping (it has {sorted(inputs_split_mapping)}), or set it to None to "
            "split the batch dim over the data axes.")
      split = tuple(inputs_split_mapping[key])
    else:
      split = (tuple(batch_axes) or None,) + (None,) * (rank - 1)
    where = f"task.train.inputs_split_mapping[{key!r}] for input {path_str(path)!r}"
    validate(split, x.shape, mesh_shape, where)
    for dim, (size, entry) in enumerate(zip(x.shape, split)):
      if size % shards(entry, mesh_shape):
        raise BatchSplitError(
            f"{where}: dim {dim} has size {size}, which does not divide over mesh axes "
            f"{entry_axes(entry)} ({shards(entry, mesh_shape)} shards). Make the batch size a "
            f"multiple of {shards(entry, mesh_shape)} (the input's batch_size field), or change "
            "the mesh.", dim, size, shards(entry, mesh_shape))
    return P(*split)
  return jax.tree_util.tree_map_with_path(split_of, batch_shapes)
