"""The objective contract: what a train (and eval) step minimizes, chosen once on the Task.

`task.objective` is None for the model's own LM loss (`Model.loss`, `ModelLoss` below: the
step is then what it always was, bit for bit), or an `Objective` (`spmdtask.objectives`:
DPO, GRPO). The steps, the program and the loop know an objective only through this
protocol:

  - `loss(model, params, batch, rng, reference) -> (loss, Metrics)`: the same Weighted
    contract as `Model.loss` (`metrics['loss'].sum / metrics['loss'].weight == loss`), so
    microbatch accumulation in `core.steps.loss_and_grads` stays exact; for DPO the weight
    is the number of pairs. `reference` is the reference params (logical, unpadded, a tree
    like `params`, no gradient flows into it) or None (`Reference.NONE` / `PRECOMPUTED`).
    Metrics besides `loss` are reported like a model's (console, TensorBoard); a metric
    named `target_tokens` gives, by its weight, the step's target-token count (else the
    loss's weight is).
  - `reference_kind(model) -> Reference`: which reference the step needs, decided once.
  - `model_batch(batch)`: the objective's batch as the model's LM batch (`inputs`,
    `targets`, `weights`, ... `[rows, t]`): what initializes the params, sizes the work
    per example and is checked against the vocabulary. Works on numpy arrays (host) and
    on traced ones alike.
  - `validate(task)`: ConfigError naming the field when the objective cannot run this task
    (e.g. under an MPMD pipeline: `task.pipeline`).
"""
import enum
from typing import Any, Protocol, runtime_checkable

import jax

from spmdtask.core.model import Metrics

# A metric whose weight is the step's count of target tokens (optional; module doc).
TARGET_TOKENS = "target_tokens"


class Reference(enum.Enum):
  """Which frozen reference model a step needs.

  NONE          no reference (the LM loss).
  PARAMS        a frozen params tree given to the step (split and padded like the params,
                never donated): `program.with_reference(params)`.
  ADAPTERS_OFF  the policy itself with its LoRA adapters off: the step zeroes the
                `*_lora_b` leaves of the params (no second copy of the weights).
  PRECOMPUTED   the reference's log-probs are in the batch (computed once beside the data).
  """
  NONE = "none"
  PARAMS = "params"
  ADAPTERS_OFF = "adapters_off"
  PRECOMPUTED = "precomputed"


@runtime_checkable
class Objective(Protocol):
  """What a step minimizes (module doc)."""

  def loss(self, model: Any, params: Any, batch: Any, rng: jax.Array | None,
           reference: Any) -> tuple[jax.Array, Metrics]:
    """(scalar loss, Weighted metrics); metrics['loss'].sum / .weight == loss."""

  def reference_kind(self, model: Any) -> Reference:
    """The reference this objective needs with this model."""

  def model_batch(self, batch: Any) -> dict:
    """The batch as the model's LM batch (rows [n, t])."""

  def validate(self, task: Any) -> None:
    """ConfigError naming the field when this objective cannot run `task`."""


class ModelLoss:
  """The model's own loss (`Model.loss`): what `task.objective=None` means."""

  def loss(self, model, params, batch, rng, reference):
    del reference
    rngs = None if rng is None else {"dropout": rng}
    return model.apply({"params": params}, batch, method=model.loss, rngs=rngs)

  def reference_kind(self, model) -> Reference:
    del model
    return Reference.NONE

  def model_batch(self, batch):
    return batch

  def validate(self, task) -> None:
    del task


def of(task) -> Objective:
  """The task's objective (`task.objective`; None = `ModelLoss()`)."""
  return ModelLoss() if task.objective is None else task.objective


def adapters_off(params):
  """`params` with every `*_lora_b` leaf zeroed (a LoRA model's base: B·A = 0), as a
  constant: Reference.ADAPTERS_OFF's reference, no second copy of the frozen weights."""
  def off(path, x):
    last = path[-1]
    name = str(last.key if isinstance(last, jax.tree_util.DictKey) else last)
    return jax.numpy.zeros_like(x) if name.endswith("_lora_b") else x
  return jax.lax.stop_gradient(jax.tree_util.tree_map_with_path(off, params))


def step_reference(kind: Reference, params, reference):
  """The reference a step hands `Objective.loss`: the given params tree (PARAMS), the
  policy's with adapters off (ADAPTERS_OFF), else None."""
  if kind is Reference.PARAMS:
    return jax.lax.stop_gradient(reference)
  if kind is Reference.ADAPTERS_OFF:
    return adapters_off(params)
  return None
