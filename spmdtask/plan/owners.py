"""Which param or activation an array of the compiled program holds, from its shape. Pure."""
from spmdtask.core import memory


def _shard_of(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
  """Whether `shape` is `full` split along one dim (that dim divides evenly)."""
  diff = [(a, b) for a, b in zip(shape, full) if a != b]
  return len(shape) == len(full) and len(diff) == 1 and diff[0][1] % diff[0][0] == 0


def owner(shape: tuple[int, ...], rows: list[memory.ArrayRow], batch_shape) -> str:
  """A param of this shape (or one layer of a stacked param: its leading layer dim dropped,
  as a scanned loop's body gathers it, or a shard of either split along one dim), else an
  activation described by its leading batch dims, else the shape."""
  names = [r.path for r in rows if r.kind == "params" and shape in (r.logical_shape,
                                                                     r.padded_shape)]
  if names:
    return "param " + ", ".join(names[:3])
  layer = shape[1:] if shape[:1] == (1,) else shape
  names = [r.path for r in rows if r.kind == "params" and len(r.logical_shape) > 1
           and layer in (r.logical_shape[1:], r.padded_shape[1:])]
  if names:
    return "one layer of param " + ", ".join(names[:3])
  names = [r.path for r in rows if r.kind == "params" and (
      _shard_of(layer, r.logical_shape[1:]) or _shard_of(shape, r.logical_shape))]
  if names:  # e.g. a gradient reduce-scattered to its FSDP shard
    return "a shard of param " + ", ".join(names[:3])
  if len(shape) >= 2 and tuple(shape[:2]) == tuple(batch_shape[:2]):
    return f"an activation [batch {shape[0]}, seq {shape[1]}, ...] {list(shape)}"
  if shape and shape[0] == batch_shape[0]:
    return f"an activation [batch {shape[0]}, ...] {list(shape)}"
  return f"a tensor {list(shape)}"
