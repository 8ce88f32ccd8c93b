"""Where the train state's bytes go: one row per param and optimizer-state array. Pure.

Every array of the live state is padded (`StateLayout.padded`) and split by its
PartitionSpec, so each device holds `prod(padded dim / shards)` elements of it: the same
on every device (replicated arrays in full). That is exactly what `program.init()`
allocates per device (a test checks it against the arrays' addressable shards).
"""
import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdtask.core import sharding
from spmdtask.core.train_state import StateLayout, is_adapter_name


@dataclasses.dataclass(frozen=True)
class ArrayRow:
  """One array of the train state and what it costs."""
  path: str                       # e.g. 'params/layers/block/mlp/wi', 'opt_state/1/0/mu/...'
  kind: str                       # 'param', 'opt_state' or 'step'
  logical_shape: tuple[int, ...]
  padded_shape: tuple[int, ...]
  dtype: str
  spec: tuple                     # the PartitionSpec's entries
  bytes_total: int                # the logical array, once
  bytes_per_device: int           # this device's shard of the padded array
  shards: int                     # how many ways it is split (1 = replicated)

  def as_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["spec"] = [list(e) if isinstance(e, tuple) else e for e in self.spec]
    return d


def _kind(path: str) -> str:
  return path.split("/", 1)[0] if path.split("/", 1)[0] in ("params", "opt_state") else "step"


def state_rows(layout: StateLayout, mesh_shape: sharding.MeshShape) -> list[ArrayRow]:
  """A row per leaf of the live train state, in tree order."""
  logical = jax.tree_util.tree_flatten_with_path(layout.logical)[0]
  padded = jax.tree.leaves(layout.padded)
  specs = jax.tree.leaves(layout.split, is_leaf=lambda x: isinstance(x, P))
  rows = []
  for (path, x), p, spec in zip(logical, padded, specs):
    name = sharding.path_str(path)
    entries = tuple(spec) + (None,) * (len(p.shape) - len(tuple(spec)))
    splits = [sharding.shards(e, mesh_shape) for e in entries]
    itemsize = np.dtype(x.dtype).itemsize
    per_device = math.prod(d // s for d, s in zip(p.shape, splits)) * itemsize
    rows.append(ArrayRow(name, _kind(name), tuple(x.shape), tuple(p.shape), str(x.dtype),
                         tuple(spec), math.prod(x.shape) * itemsize, per_device,
                         math.prod(splits)))
  return rows


def totals(rows: list[ArrayRow], only_adapters: bool = False) -> dict[str, Any]:
  """Bytes of the state in all (logical) and on the largest device, by kind; params split
  into trainable and frozen (`only_adapters`: a LoRA model's, `train_state.adapters_only`)."""
  out = {"state_bytes_total": sum(r.bytes_total for r in rows),
         "state_bytes_per_device": sum(r.bytes_per_device for r in rows)}
  for kind in ("params", "opt_state"):
    out[f"{kind}_bytes_total"] = sum(r.bytes_total for r in rows if r.kind == kind)
    out[f"{kind}_bytes_per_device"] = sum(r.bytes_per_device for r in rows if r.kind == kind)
  out["num_params"] = sum(math.prod(r.logical_shape) for r in rows if r.kind == "params")
  frozen = [r for r in rows if r.kind == "params" and only_adapters
            and not is_adapter_name(r.path)]
  out["num_frozen_params"] = sum(math.prod(r.logical_shape) for r in frozen)
  out["num_trainable_params"] = out["num_params"] - out["num_frozen_params"]
  out["frozen_params_bytes_per_device"] = sum(r.bytes_per_device for r in frozen)
  out["trainable_params_bytes_per_device"] = (out["params_bytes_per_device"]
                                              - out["frozen_params_bytes_per_device"])
  return out

