"""The pure step functions, and `partition`, the one place that wraps `jax.jit`.

Steps take the padded on-device state, slice it to logical shapes, do the math, and
pad it back, so padding never reaches the loss, the gradients or the optimizer
statistics. They know a model only through `spmdtask.core.model.Model`.
"""
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from spmdtask.core import objective as objective_lib, sharding
from spmdtask.core.model import Metrics
from spmdtask.core.objective import Objective, Reference
from spmdtask.core import train_state
from spmdtask.core.train_state import StateLayout, TrainState, create


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


def microbatches(batch, num_microbatches: int):
  """[B, ...] leaves -> [M, B/M, ...]; microbatch m holds rows m, m+M, ... (a strided split,
  so a batch dim sharded over the data axes stays sharded inside every microbatch)."""
  m = num_microbatches
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape((x.shape[0] // m, m) + x.shape[1:]), 0, 1),
                      batch)


def reported(metrics: Metrics) -> dict[str, jax.Array]:
  """Weighted metrics -> replicated scalars sum / weight (0 where the weight is 0)."""
  return {k: m.sum / jnp.maximum(m.weight, jnp.finfo(jnp.float32).tiny)
          for k, m in metrics.items()}


def value_and_grad(fn):
  """`jax.value_and_grad(fn, has_aux=True)` over params that may hold integer leaves (a
  QLoRA base's packed codes, layers.qlora: frozen, their gradient float0)."""
  return jax.value_and_grad(fn, has_aux=True, allow_int=True)


def integer_grads_zero(grads, params):
  """`grads` with each integer param's float0 gradient as zeros of the param's dtype (as
  a frozen float param's: its gradient is zero), so every leaf adds and masks alike."""
  return jax.tree.map(lambda g, p: jnp.zeros_like(p) if g.dtype == jax.dtypes.float0 else g,
                      grads, params)


def loss_and_grads(model: nn.Module, params, batch, rng: jax.Array,
                   num_microbatches: int = 1, objective: Objective | None = None,
                   reference=None) -> tuple[jax.Array, Metrics, Any]:
  """(loss, metrics, grads) of the whole batch, accumulating over microbatches in a scan.

  `objective` (None: the model's own loss) gives the loss; `reference` is what its
  `loss` takes (`objective.step_reference`: the same for every microbatch).
  With M > 1 the gradient of each microbatch's `loss · weight` (its loss sum) is
  accumulated, then divided by the total weight: exactly the whole batch's gradient.
  Microbatch i's dropout rng is fold_in(rng, i).
  """
  objective = objective or objective_lib.ModelLoss()

  def loss_fn(p, b, key):
    return objective.loss(model, p, b, key, reference)

  if num_microbatches == 1:
    (loss, metrics), grads = value_and_grad(loss_fn)(params, batch, rng)
    return loss, metrics, integer_grads_zero(grads, params)

  def summed_loss(p, b, key):
    loss, metrics = loss_fn(p, b, key)
    return loss * jax.lax.stop_gradient(metrics["loss"].weight), metrics

  def body(acc, xs):
    i, mb = xs
    (_, metrics), grads = value_and_grad(summed_loss)(params, mb, jax.random.fold_in(rng, i))
    grads = integer_grads_zero(grads, params)
    return jax.tree.map(jnp.add, acc, (grads, metrics)), None

  mbs = microbatches(batch, num_microbatches)
  one = jax.tree.map(lambda x: x[0], mbs)
  metric_shapes = jax.eval_shape(lambda: loss_fn(params, one, rng)[1])
  zeros = (jax.tree.map(jnp.zeros_like, params),
           jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes))
  (grads, metrics), _ = jax.lax.scan(body, zeros, (jnp.arange(num_microbatches), mbs))
  total = jnp.maximum(metrics["loss"].weight, jnp.finfo(jnp.float32).tiny)
  grads = jax.tree.map(lambda g: g / total, grads)
  return metrics["loss"].sum / total, metrics, grads


# What a train step reports besides the model's own metrics (the console prints those apart).
# target_tokens: the loss's weight summed over the global batch (with target masks, the
# tokens trained on; the loop's target tokens/s).
STEP_METRICS = ("loss", "grad_norm", "param_norm", "learning_rate", "target_tokens")


def model_metrics(metrics: dict) -> list[tuple[str, float]]:
  """The model's own metrics among a step's (e.g. an MoE's aux loss), besides the loss."""
  return [(k, v) for k, v in metrics.items() if k not in STEP_METRICS]


def target_tokens(metrics: Metrics) -> jax.Array:
  """The step's target-token count: the `target_tokens` metric's weight where the objective
  gives one (e.g. DPO, whose loss weight counts pairs), else the loss's weight."""
  return metrics.get(objective_lib.TARGET_TOKENS, metrics["loss"]).weight


def _reference_arg(kind: Reference, layout: StateLayout, padded_reference):
  """The reference params as a step's `reference` argument: unpadded (PARAMS), else None."""
  if kind is not Reference.PARAMS:
    return None
  return sharding.unpad(padded_reference, layout.logical.params)


def train_step_fn(model: nn.Module, tx: optax.GradientTransformation, schedule: Callable,
                  layout: StateLayout, seed: int, num_microbatches: int = 1,
                  only_adapters: bool = False, objective: Objective | None = None) -> Callable:
  """The pure train step `(padded_state, batch[, padded_reference]) -> (padded_state,
  metrics)`.

  `objective` (None: the model's loss) gives the loss; where it needs a frozen params tree
  (`Reference.PARAMS`) the step takes it as a third argument (padded like the params,
  never donated), otherwise it takes two.

  `only_adapters` (a LoRA model, `train_state.adapters_only`; `tx` then made by
  `train_state.optimizer`): frozen params come back bitwise unchanged, and grad_norm is
  the adapters'. A model's buffers (`core.model.Buffered`) are set after the update from
  their gradient slot (not with LoRA: its checkpoints keep only the adapters).

  Metrics are replicated scalars: loss, every model metric (sum / weight over the
  batch), grad_norm, param_norm (of the params the step started from), learning_rate
  (the step's) and target_tokens (the loss's weight: the global batch's target count).
  Dropout's rng is fold_in(seed, step), so it depends on neither the mesh nor a restart.
  """
  objective = objective or objective_lib.ModelLoss()
  kind = objective.reference_kind(model)

  def step(padded: TrainState, batch, padded_reference=None) -> tuple[TrainState, dict]:
    state = sharding.unpad(padded, layout.logical)
    rng = jax.random.fold_in(jax.random.key(seed), state.step)
    reference = objective_lib.step_reference(
        kind, state.params, _reference_arg(kind, layout, padded_reference))
    loss, metrics, grads = loss_and_grads(model, state.params, batch, rng, num_microbatches,
                                          objective, reference)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = train_state.apply_updates(state.params, updates, only_adapters)
    if train_state.has_buffers(model) and not only_adapters:  # a LoRA job's stay as loaded
      params = model.update_buffers(params, grads)
    # optax.tree.norm is what clip_by_global_norm computes, so XLA shares the work; the
    # param norm is of the params the step started from, off the update's critical path.
    grad_norm = optax.tree.norm(train_state.trainable(grads, only_adapters))
    out = {**reported(metrics), "loss": loss, "grad_norm": grad_norm,
           "param_norm": optax.tree.norm(state.params),
           "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
           "target_tokens": target_tokens(metrics)}
    new = TrainState(state.step + 1, params, opt_state)
    return sharding.pad(new, layout.padded), out

  return step


def eval_step_fn(model: nn.Module, layout: StateLayout,
                 objective: Objective | None = None) -> Callable:
  """The pure eval step `(padded_state, batch[, padded_reference]) -> Metrics` (sums and
  weights, to aggregate); the reference as in `train_step_fn`."""
  objective = objective or objective_lib.ModelLoss()
  kind = objective.reference_kind(model)

  def step(padded: TrainState, batch, padded_reference=None) -> Metrics:
    params = sharding.unpad(padded.params, layout.logical.params)
    reference = objective_lib.step_reference(
        kind, params, _reference_arg(kind, layout, padded_reference))
    return objective.loss(model, params, batch, None, reference)[1]
  return step


def init_fn(model: nn.Module, tx: optax.GradientTransformation, layout: StateLayout,
            example_batch, seed: int) -> Callable:
  """`() -> padded_state`: a fresh state, padded for the mesh. Values do not depend on it."""
  def init():
    return sharding.pad(create(model, tx, jax.random.key(seed), example_batch), layout.padded)
  return init
