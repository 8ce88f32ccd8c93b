"""Which param or activation an array of the compiled program holds, from its shape. Pure."""
from spmdtask.core import memory


def owner(shape: tuple[int, ...], rows: list[memory.ArrayRow], batch_shape) -> str:
  """A param of this shape (or one layer of a stacked param: its leading layer dim dropped,
  as a scanned loop's body gathers it), else an activation described by its leading batch
  dims, else the shape."""
  names = [r.path for r in rows if r.kind == "params" and shape in (r.logical_shape,
                                                                     r.padded_shape)]
  if names:
    return "param " + ", ".join(names[:3])
  layer = shape[1:] if shape[:1] == (1,) else shape
  names = [r.path for r in rows if r.kind == "params" and len(r.logical_shape) > 1
           and layer in (r.logical_shape[1:], r.padded_shape[1:])]
  if names:
    return "one layer of param " + ", ".join(names[:3])
  if len(shape) >= 2 and tuple(shape[:2]) == tuple(batch_shape[:2]):
    return f"an activation [batch {shape[0]}, seq {shape[1]}, ...] {list(shape)}"
  if shape and shape[0] == batch_shape[0]:
    return f"an activation [batch {shape[0]}, ...] {list(shape)}"
  return f"a tensor {list(shape)}"
