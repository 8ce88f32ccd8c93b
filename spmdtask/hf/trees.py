"""Nested param dicts by '/' paths ('layers/block/attn/q'), as the converters use them."""
import numpy as np

from spmdtask.core.train_state import ADAPTER_SUFFIXES


def nested(flat: dict) -> dict:
  """{'a/b': x} -> {'a': {'b': x}}."""
  out = {}
  for path, value in flat.items():
    set_leaf(out, path, value, make=True)
  return out


def leaf(tree: dict, path: str):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def set_leaf(tree: dict, path: str, value, make: bool = False) -> None:
  """tree[a][b][c] = value for path 'a/b/c' (the parents exist, or `make` them)."""
  *parents, name = path.split("/")
  for key in parents:
    tree = tree.setdefault(key, {}) if make else tree[key]
  tree[name] = value


def node(tree: dict, path: str) -> tuple[dict, str]:
  """(the dict that holds `path`'s leaf, the leaf's key)."""
  *parents, name = path.split("/")
  for key in parents:
    tree = tree[key]
  return tree, name


def copy(tree, fn=None):
  """The dicts copied; the leaves shared, or `fn` of each."""
  if isinstance(tree, dict):
    return {k: copy(v, fn) for k, v in tree.items()}
  return tree if fn is None else fn(tree)


def covers(params: dict, like: dict) -> bool:
  """Whether `params` holds a value for every leaf of the tree `like`."""
  return all(key in params and (not isinstance(value, dict) or
                                isinstance(params[key], dict) and covers(params[key], value))
             for key, value in like.items())


def filled(params: dict, init: dict) -> dict:
  """`params` cast to `init`'s dtypes, with the LoRA adapters it lacks taken from `init` (a
  model's fresh params: PEFT's init, B = 0); KeyError for any other missing param."""
  out = {}
  for key, value in init.items():
    if isinstance(value, dict):
      out[key] = filled(params.get(key, {}), value)
    elif key in params:
      out[key] = np.asarray(params[key]).astype(value.dtype)
    elif key.endswith(ADAPTER_SUFFIXES):
      out[key] = np.asarray(value)
    else:
      raise KeyError(f"no value for param {key!r}")
  return out
