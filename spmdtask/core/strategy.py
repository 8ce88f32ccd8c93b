"""The execution-strategy contract: how a model's stack of identical layers runs.

A strategy is `task.pipeline`'s value (None = `core.scan.Scan()`, the remat'd scan):
`PipelineConfig` (the SPMD stage-dim pipeline) and `MpmdConfig` (one program per stage on
its own submesh) are the others. The framework and the models call it only through
`Strategy`, never by its type, so a new strategy is one new module that implements it
(and an experiment that sets it); nothing else changes.

A strategy
  - validates itself against the model's stack and the mesh (`validate`);
  - runs the stack inside the model's forward (`apply_stack`, given a `StackRunner`: the
    LayerStack module with the pieces every strategy needs);
  - maps its parameter layout to the canonical one checkpoints hold (`layout_maps`);
  - builds the task's program (`build_program`: an object implementing
    `spmdtask.core.program.Program`), always initialised through the canonical layout;
  - describes itself: `facts()` (JSON-able, for checkpoint metadata and plans) and
    `summary()` (one line for the console).

`layers/` imports this module only; `pipeline/` holds the implementations.
"""
from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

import jax

from spmdtask.core.model import LayoutMap


class StackFacts(NamedTuple):
  """What a strategy validates against: the stack, and the batch one program step sees."""
  num_layers: int
  batch_size: int  # examples per step through the stack (after gradient accumulation)
  mesh: jax.sharding.Mesh


class StackRunner(Protocol):
  """The layer stack (a Flax `LayerStack` inside its compact `__call__`) as a strategy sees
  it: its block and the scan every strategy builds on."""
  block_cls: type
  block_kwargs: dict
  num_layers: int

  variables: Any

  def is_initializing(self) -> bool:
    """True while Flax initialises the params (shapes and splits only matter then)."""

  def scan_layers(self, x: jax.Array, side: tuple, keys: jax.Array | None, *, start: int = 0,
                  length: int | None = None, name: str = "block") -> jax.Array:
    """Layers [start, start + length) as one remat'd `nn.scan` named `name` (weights
    `[length, ...]`); `side` arguments go to every layer, `keys[l]` to layer l."""

  def block_fn(self):
    """`(params, h, key, *side) -> h`: one layer, pure (for hand-written schedules); `key`
    is the layer's dropout key data (uint32 [2]) or None."""


@runtime_checkable
class Strategy(Protocol):
  """How a layer stack executes (module doc)."""

  def validate(self, stack: StackFacts) -> None:
    """ConfigError naming the `task.pipeline` field when it cannot run this stack here."""

  def apply_stack(self, runner: StackRunner, x: jax.Array, side: tuple,
                  keys: jax.Array | None) -> jax.Array:
    """The stack's output for `x`: every layer applied in order, however it executes.
    `side`: per-example inputs `[b, ...]` (or None) every layer takes; `keys`: per-layer
    dropout key data `[L, 2]` or None."""

  def layout_maps(self, path: Sequence[str]) -> tuple[LayoutMap, ...]:
    """Conversions between the stack's params at `path` and the canonical `[L, ...]`."""

  def build_program(self, task: Any, example_local_batch: Any, devices: Any) -> Any:
    """The task's `spmdtask.core.program.Program` under this strategy."""

  def facts(self) -> dict:
    """JSON-able description: {'strategy': name, every field}."""

  def summary(self) -> str:
    """One console line naming the strategy and its knobs."""
