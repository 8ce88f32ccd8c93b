"""One build per program in a test worker: `program.setup` memoized by the task's value.

Each `program_lib.setup` makes new `jax.jit` closures, so jit's in-memory cache never serves
a second build of the same task: every test that builds a program it (or another test of the
worker) built before traces, lowers and compiles it again (2/3 of a build is tracing and
lowering, which the persistent XLA cache does not save). A program is immutable (its state
lives outside it), so the tests of a worker share one build per (task value, example batch
shapes, devices); `setup`'s own checks of the example batch run on every call.

A task's value is `value_key` of it: dataclasses (flax modules among them) by their fields,
functools.partial and Python functions by their code and what they close over (an optax
schedule built anew by every `fdl.build` is the same value), arrays by their bytes; anything
else by identity (never a wrong hit: at worst a rebuild). An entry holds its task alive, so
the identities in its key are never reused by another object.
"""
import collections
import dataclasses
import enum
import functools
import hashlib
import types

import jax
import numpy as np

from spmdtask.core import program as program_lib

_ENTRIES = 8  # programs kept per worker (least recently used dropped first): a test's own
_PLAIN = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))


def value_key(x, _seen=None):
  """A hashable key equal for equal values (see the module docstring)."""
  seen = set() if _seen is None else _seen
  if isinstance(x, _PLAIN) or isinstance(x, enum.Enum):
    return (type(x).__name__, repr(x))
  if id(x) in seen:  # a cycle (a recursive closure): its identity
    return ("cycle", id(x))
  seen = seen | {id(x)}
  key = lambda v: value_key(v, seen)
  if isinstance(x, (tuple, list)):
    return (type(x).__qualname__, tuple(key(v) for v in x))
  if isinstance(x, dict):
    return (type(x).__qualname__, tuple((key(k), key(v)) for k, v in x.items()))
  if isinstance(x, (np.ndarray, np.generic, jax.Array)):
    a = np.asarray(x)
    return ("array", a.dtype.str, a.shape, hashlib.sha256(a.tobytes()).hexdigest())
  if isinstance(x, type):
    return ("type", id(x))
  if dataclasses.is_dataclass(x):
    return (("dataclass", id(type(x))) +
            tuple((f.name, key(getattr(x, f.name, None))) for f in dataclasses.fields(x)))
  if isinstance(x, functools.partial):
    return ("partial", key(x.func), key(x.args), key(x.keywords))
  if isinstance(x, types.FunctionType):
    cells = tuple(key(c.cell_contents) if _filled(c) else ("empty",)
                  for c in x.__closure__ or ())
    return ("function", id(x.__code__), cells, key(x.__defaults__), key(x.__kwdefaults__))
  return ("identity", id(x))


def _filled(cell) -> bool:
  try:
    cell.cell_contents  # pylint: disable=pointless-statement
  except ValueError:
    return False
  return True


def _example_key(example_local_batch):
  leaves, tree = jax.tree.flatten(example_local_batch)
  return (str(tree), tuple((tuple(np.shape(a)), str(getattr(a, "dtype", type(a))))
                           for a in leaves))


_built: collections.OrderedDict = collections.OrderedDict()
_setup = program_lib.setup


def setup(task, example_local_batch, devices=None):
  """`program_lib.setup`, built once per key in this process."""
  # The device objects themselves: a TPU topology's compile-only devices (a plan) share
  # their ids with the CPU devices.
  devs = tuple(jax.devices() if devices is None else devices)
  key = (value_key(task), _example_key(example_local_batch), devs)
  hit = _built.get(key)
  if hit is not None and value_key(hit[0]) != key[0]:  # its task was changed in place since
    del _built[key]
    hit = None
  if hit is not None:
    _built.move_to_end(key)
    if isinstance(task.model, program_lib.ChecksBatch):
      task.model.check_batch(example_local_batch)
    return hit[1]
  program = _setup(task, example_local_batch, devices)
  _built[key] = (task, program)
  if len(_built) > _ENTRIES:
    _built.popitem(last=False)
  return program


def install() -> None:
  """Routes every `program.setup` call of this process through `setup`."""
  program_lib.setup = setup
