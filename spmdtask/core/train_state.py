"""TrainState and its layout: logical shapes, padded shapes, split-dims mappings."""
import contextlib
import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from absl import logging
from jax.sharding import PartitionSpec as P

from spmdtask.core import mesh as mesh_lib, sharding
from spmdtask.core.model import Adapted, Buffered

# The one rule of what a LoRA model trains (layers.lora names its adapters so): params
# whose name ends so are trainable; every other param is frozen.
ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")
# Buffers (core.model.Buffered): params whose name ends so never train; the model sets
# them after each step from their gradient slot.
BUFFER_SUFFIX = "_buffer"


class TrainState(NamedTuple):
  """What a train step carries: `(state, batch) -> (state, metrics)`."""
  step: jax.Array
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """The train state as the partitioner sees it. Every field is a TrainState tree.

  logical: ShapeDtypeStructs of the math (what checkpoints hold).
  padded: ShapeDtypeStructs on device: uneven dims rounded up to their shard count.
  split: a PartitionSpec per leaf, derived from the split-dims mappings.
  """
  logical: TrainState
  padded: TrainState
  split: TrainState

  def padding(self, mesh_shape) -> dict[str, tuple]:
    return sharding.padding_report(self.logical, self.split, mesh_shape)


def _split_of_box(x) -> P:
  if isinstance(x, nn.Partitioned):
    return P(*x.names)
  return sharding.replicated(x)


# Every variable of `model` initialised from `rng` through `loss` on `batch`: one jit, the
# model a static argument (flax modules hash and compare by their fields). The layout's
# abstract trace (`abstract_variables`) and the init program's call share jit's trace cache
# for each (model, batch shapes, mesh): a program's init does not trace the model's forward
# again, nor do the plan and the costs of a model already traced in this process.
_variables = jax.jit(lambda model, rng, batch: model.init(rng, batch, method=model.loss),
                     static_argnums=0)


def init_params(model: nn.Module, rng: jax.Array, example_batch) -> Any:
  """Boxed (nn.Partitioned) params from `model.loss` on an example batch.

  Under a mesh each weight is drawn cut over every device (`sharding.spread` of its
  split-dims mapping), then laid out as the state holds it: partitionable threefry draws the
  same values on any layout, so a weight held whole on each device (data parallel) is drawn
  once over the mesh and gathered instead of drawn in full by every device.
  """
  boxed = _variables(model, rng, example_batch)["params"]
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.manual_axes:
    return boxed
  mesh_shape = mesh_lib.mesh_shape(mesh)

  def drawn(x):
    value = x.value if isinstance(x, nn.Partitioned) else x
    value = jax.lax.with_sharding_constraint(
        value, sharding.spread(_split_of_box(x), value.shape, mesh_shape))
    return x.replace_boxed(value) if isinstance(x, nn.Partitioned) else value
  return jax.tree.map(drawn, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def abstract_variables(model: nn.Module, example_batch) -> Any:
  """`model`'s variables as ShapeDtypeStructs (boxed): nothing runs, so compile-only devices
  may hold the mesh."""
  key = jax.eval_shape(lambda: jax.random.key(0))
  return _variables.eval_shape(model, key, example_batch)


def create(model: nn.Module, tx: optax.GradientTransformation, rng: jax.Array,
           example_batch) -> TrainState:
  """A fresh logical train state at step 0."""
  return fresh(tx, nn.unbox(init_params(model, rng, example_batch)))


def fresh(tx: optax.GradientTransformation, params) -> TrainState:
  """A step-0 logical state: `params` and `tx`'s initial optimizer state of them."""
  return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


def layout(model: nn.Module, tx: optax.GradientTransformation, example_batch,
           mesh_shape: sharding.MeshShape, mesh: jax.sharding.Mesh | None = None) -> StateLayout:
  """Traces init abstractly (`jax.eval_shape`) and derives the whole state layout.

  With `mesh`, the traces run under it (layers read it); nothing else does, so a mesh
  of compile-only devices (a TPU topology planned on a CPU machine) works: optax's
  eager bits (`tree_map_params` inits on a placeholder) stay on the default device.
  Raises ConfigError if a weight's split-dims mapping does not fit its tensor or the mesh.
  """
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    boxed = abstract_variables(model, example_batch)["params"]
    # The state's shapes from the params' (as `create` makes them) rather than a second
    # trace of the model's forward: a program's build traces its model once less.
    logical = jax.eval_shape(lambda b: fresh(tx, nn.unbox(b)), boxed)
  param_split = jax.tree.map(_split_of_box, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  sharding.validate_tree(logical.params, param_split, mesh_shape, "weight")
  opt_split, warnings = sharding.opt_state_split_dims(tx, logical.opt_state, logical.params,
                                                      param_split)
  for w in warnings:
    logging.warning("%s", w)
  split = TrainState(P(), param_split, opt_split)
  return StateLayout(logical, sharding.padded_shapes(logical, split, mesh_shape), split)


def adapters_only(model) -> bool:
  """Whether `model` trains only its adapters (the `Adapted` protocol)."""
  return isinstance(model, Adapted) and model.adapters_only()


def base_storage(model):
  """`model`'s quantized base's storage (the `Adapted` protocol's BaseStorage), else None."""
  return model.base_storage() if isinstance(model, Adapted) else None


def has_buffers(model) -> bool:
  """Whether `model`'s params hold buffers (the `Buffered` protocol)."""
  return isinstance(model, Buffered) and model.has_buffers()


def is_buffer(path) -> bool:
  """Whether the param at this tree path is a buffer (its name ends in BUFFER_SUFFIX)."""
  last = path[-1]
  return str(last.key if isinstance(last, jax.tree_util.DictKey) else last).rstrip(
      "]'\"").endswith(BUFFER_SUFFIX)


def is_adapter_name(name: str) -> bool:
  """Whether a param of this name or path ('a/b/q_lora_a', or MPMD's flat keys
  "['a']['q_lora_a']") is an adapter: trainable."""
  return name.rstrip("]'\"").endswith(ADAPTER_SUFFIXES)


def _is_adapter(path) -> bool:
  last = path[-1]
  return is_adapter_name(str(last.key if isinstance(last, jax.tree_util.DictKey) else last))


def _trains(path, only_adapters: bool) -> bool:
  return not is_buffer(path) and (not only_adapters or _is_adapter(path))


def trainable_mask(params, only_adapters: bool):
  """Per param leaf (nested or flat path-keyed dicts alike): True where it trains (never
  a buffer)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: _trains(path, only_adapters), params)


def _any_buffer(tree) -> bool:
  return any(is_buffer(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def adapters(tree):
  """A params tree (nested dicts) with only its adapters' leaves (what a LoRA job's
  checkpoints hold); subtrees with no adapter left out."""
  if not isinstance(tree, dict):
    return tree
  kept = {k: v if is_adapter_name(str(k)) else adapters(v) for k, v in tree.items()
          if is_adapter_name(str(k)) or isinstance(v, dict)}
  return {k: v for k, v in kept.items() if is_adapter_name(str(k)) or v}


def trainable(tree, only_adapters: bool):
  """`tree` (params or grads) with its frozen leaves and buffers None (e.g. for a
  gradient norm)."""
  if not only_adapters and not _any_buffer(tree):
    return tree
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if _trains(path, only_adapters) else None, tree)


def optimizer(tx: optax.GradientTransformation, only_adapters: bool, buffers: bool = False
              ) -> optax.GradientTransformation:
  """`tx` over the trainable params alone: frozen ones and buffers (`buffers`: the model
  has some, `has_buffers`) hold no optimizer state (and their gradients are not clipped
  with the others). Pair with `apply_updates`."""
  if not only_adapters and not buffers:
    return tx
  return optax.masked(tx, lambda params: trainable_mask(params, only_adapters))


def apply_updates(params, updates, only_adapters: bool):
  """`optax.apply_updates`, frozen params and buffers returned as they were (bitwise,
  not p + 0)."""
  new = optax.apply_updates(params, updates)
  if not only_adapters and not _any_buffer(params):
    return new
  return jax.tree_util.tree_map_with_path(
      lambda path, p, n: n if _trains(path, only_adapters) else p, params, new)


def merged_weight(w, a, b, scale: float, xp=jnp):
  """W + scale·A·B in float32: the effective weight LoRA's layers compute (layers.lora). A
  [*batch, *in, r], B [*batch, r, *out] beside W [*batch, *in, *out], the batch dims (a
  stack's layers, an MoE's experts) those W has beyond A·B's. `xp`: jax.numpy on device, or
  numpy on the host (an export: a big model's weights never touch a device)."""
  k = a.ndim + b.ndim - 2 - w.ndim  # the leading dims A, B and W share
  batch, ins, outs = a.shape[:k], a.shape[k:-1], b.shape[k + 1:]
  if k < 0 or b.shape[:k] != batch or w.shape != batch + ins + outs:
    raise ValueError(f"adapters {a.shape} x {b.shape} do not fit weight {w.shape}")
  r = a.shape[-1]
  delta = xp.einsum("gir,gro->gio", xp.asarray(a, xp.float32).reshape(-1, math.prod(ins), r),
                    xp.asarray(b, xp.float32).reshape(-1, r, math.prod(outs)))
  return xp.asarray(w, xp.float32) + xp.float32(scale) * delta.reshape(w.shape)


def merged_adapters(params, scale: float, xp=jnp):
  """`params` (nested dicts) with each adapted weight X as `merged_weight` of X and its
  X_lora_a, X_lora_b (scale: the adapters' alpha / rank; `xp` as there), the adapters left
  out: a model's params without LoRA."""
  if not isinstance(params, dict):
    return params
  out = {}
  for k, v in params.items():
    if str(k).endswith(ADAPTER_SUFFIXES):
      continue
    a, b = (params.get(f"{k}{s}") for s in ADAPTER_SUFFIXES)
    out[k] = merged_adapters(v, scale, xp) if a is None else merged_weight(v, a, b, scale, xp)
  return out
