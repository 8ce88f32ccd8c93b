"""The partitioner's step builders: jitted train / eval steps on a mesh.

`partition` is the one place that wraps `jax.jit`. Steps take the padded
on-device state, slice it to logical shapes, do the math, and pad it back, so
padding never reaches the loss, the gradients or the optimizer statistics.
"""
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from spmdtask import sharding
from spmdtask.train_state import StateLayout, TrainState, create


@dataclasses.dataclass(frozen=True)
class Partitioned:
  """A jitted function that runs (traces, lowers, executes) under its mesh."""
  jitted: Any
  mesh: Mesh

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted(*args)

  def lower(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args)


def named_shardings(mesh: Mesh, specs):
  """A tree of PartitionSpecs -> the same tree of NamedShardings on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def partition(fn: Callable, mesh: Mesh, in_specs, out_specs, donate_argnums=()) -> Partitioned:
  """jax.jit with NamedShardings built from PartitionSpec trees (pjit)."""
  return Partitioned(jax.jit(fn, in_shardings=named_shardings(mesh, in_specs),
                             out_shardings=named_shardings(mesh, out_specs),
                             donate_argnums=donate_argnums), mesh)


def train_step_fn(model: nn.Module, tx: optax.GradientTransformation, schedule: Callable,
                  layout: StateLayout, seed: int) -> Callable:
  """The pure train step `(padded_state, batch) -> (padded_state, metrics)`.

  Metrics are replicated scalars: loss, grad_norm, param_norm (of the params the step
  started from), learning_rate (the step's), num_tokens.
  Dropout's rng is fold_in(seed, step), so it depends on neither the mesh nor a restart.
  """
  def step(padded: TrainState, batch) -> tuple[TrainState, dict]:
    state = sharding.unpad(padded, layout.logical)
    rng = jax.random.fold_in(jax.random.key(seed), state.step)

    def loss_fn(params):
      return model.apply({"params": params}, batch, method=model.loss, rngs={"dropout": rng})

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # optax.tree.norm is what clip_by_global_norm computes, so XLA shares the work; the
    # param norm is of the params the step started from, off the update's critical path.
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "param_norm": optax.tree.norm(state.params),
               "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
               "num_tokens": aux["num_tokens"]}
    new = TrainState(state.step + 1, params, opt_state)
    return sharding.pad(new, layout.padded), metrics

  return step


def eval_step_fn(model: nn.Module, layout: StateLayout) -> Callable:
  """The pure eval step `(padded_state, batch) -> {'loss_sum', 'num_tokens', 'loss'}`."""
  def step(padded: TrainState, batch) -> dict:
    params = sharding.unpad(padded.params, layout.logical.params)
    loss, aux = model.apply({"params": params}, batch, method=model.loss)
    return {"loss": loss, **aux}
  return step


def init_fn(model: nn.Module, tx: optax.GradientTransformation, layout: StateLayout,
            example_batch, seed: int) -> Callable:
  """`() -> padded_state`: a fresh state, padded for the mesh. Values do not depend on it."""
  def init():
    return sharding.pad(create(model, tx, jax.random.key(seed), example_batch), layout.padded)
  return init


@dataclasses.dataclass(frozen=True)
class Steps:
  """The jitted programs of one task on one mesh.

  to_logical / to_padded convert the whole train state between its on-device padded
  layout and logical arrays (split by `logical_split`), e.g. for checkpoints.
  to_logical returns fresh buffers, so its input may be donated later.
  """
  init: Partitioned
  train: Partitioned
  eval: Partitioned
  to_logical: Partitioned
  to_padded: Partitioned
  batch_specs: Any
  logical_split: TrainState


def build(model: nn.Module, tx: optax.GradientTransformation, schedule: Callable,
          layout: StateLayout, mesh: Mesh, batch_specs, example_batch, seed: int) -> Steps:
  """Jits init (sharded output), train (state donated) and eval on `mesh`."""
  metrics_spec = jax.sharding.PartitionSpec()
  init = partition(init_fn(model, tx, layout, example_batch, seed), mesh, (), layout.split)
  train = partition(train_step_fn(model, tx, schedule, layout, seed), mesh,
                    (layout.split, batch_specs), (layout.split, metrics_spec), donate_argnums=(0,))
  evaluate = partition(eval_step_fn(model, layout), mesh, (layout.split, batch_specs),
                       metrics_spec)
  logical_split = sharding.even_splits(layout.logical, layout.split, dict(mesh.shape))
  # `+ 0` gives fresh buffers even where unpad is a no-op: the train step donates its input.
  to_logical = partition(
      lambda st: jax.tree.map(lambda x: x + jnp.zeros((), x.dtype),
                              sharding.unpad(st, layout.logical)),
      mesh, (layout.split,), logical_split)
  to_padded = partition(lambda st: sharding.pad(st, layout.padded), mesh, (logical_split,),
                        layout.split)
  return Steps(init, train, evaluate, to_logical, to_padded, batch_specs, logical_split)
