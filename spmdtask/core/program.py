"""The program contract: a task on devices, as the loop, evaluation, checkpoints and plan see it.

`setup(task, example_local_batch)` is the entry point: the task's execution strategy
(`task.pipeline`, a `spmdtask.core.strategy.Strategy`; None = the scan) builds its program:
one SPMD program (`spmd_program`) for the scan and the SPMD pipeline, per-stage programs
(`pipeline.mpmd.program`) for MPMD. Every program implements `Program`:

  live       what train / eval run on, in the strategy's layout;
  canonical  what checkpoints hold: logical (unpadded) arrays in the layout of the model
             run without a pipeline (layers `[L, ...]`), split evenly where dims divide.

`init()` gives the canonical fresh state (the unpipelined model's initial weights, the same
whatever the strategy) converted to the live layout; `to_canonical` / `from_canonical`
convert a whole train state, so a checkpoint restores onto any mesh, device count or
strategy.
"""
from typing import Any, Protocol, runtime_checkable

import jax
import optax
from jax.sharding import Mesh

from spmdtask.core.host_input import Share
from spmdtask.core.layouts import Lowering  # (re-exported: part of the contract)
from spmdtask.core.model import ChecksBatch, Metrics, Model, Work
from spmdtask.core import steps, train_state
from spmdtask.core.scan import Scan
from spmdtask.core.strategy import Strategy
from spmdtask.core.train_state import StateLayout, TrainState


@runtime_checkable
class Program(Protocol):
  """A task's programs on its devices and the layouts they agree on (module doc)."""
  task: Any
  model: Model
  mesh: Mesh  # every device of the job: canonical restore targets live here
  tx: optax.GradientTransformation  # the canonical state's optimizer (a fresh state's)
  work: Work
  layout: StateLayout  # the live state's layout on `mesh` (bytes per device)
  canonical: StateLayout
  batch_specs: Any  # PartitionSpecs of the global batch on `mesh`

  def init(self) -> Any:
    """The fresh live state: the canonical initial weights, converted."""

  def train(self, state: Any, batch: Any) -> tuple[Any, dict]:
    """One step `(live state, global batch) -> (live state, metrics)`; state donated."""

  def eval(self, state: Any, batch: Any) -> Metrics:
    """Weighted metric sums of one global batch."""

  @property
  def needs_reference(self) -> bool:
    """Whether `task.objective` needs frozen reference params (`Reference.PARAMS`): then
    `with_reference` must give them before `train` / `eval` run."""

  def with_reference(self, canonical_params: Any) -> "Program":
    """This program with its reference params (a canonical params tree on `mesh`; the
    `run.reference` module finds them), held live for every step."""

  def input_share(self) -> Share:
    """The rows and leaves of each global batch this process reads (`inputs.base.reading`
    makes an input read them): SPMD, its 1/N share of the rows; multi-process MPMD, every
    row of the leaves its own stages consume."""

  def global_batch(self, local_batch: Any) -> Any:
    """The host rows this process read (`input_share`) -> what `train` / `eval` take."""

  def to_canonical(self, state: Any) -> TrainState:
    """Live -> canonical state on `mesh` (fresh buffers)."""

  def from_canonical(self, state: TrainState) -> Any:
    """Canonical -> live state."""

  def canonical_targets(self) -> TrainState:
    """ShapeDtypeStructs of the canonical state with their shardings on `mesh`."""

  def layout_facts(self) -> dict:
    """JSON-able facts for checkpoint metadata: mesh, strategy, microbatch knobs."""

  def describe(self) -> list[str]:
    """Console lines on how the program runs: the strategy, stages, submeshes, bytes."""

  def lowerings(self, example_local_batch: Any) -> list[Lowering]:
    """Every program one train step runs, ready to lower from shapes (for the plan)."""

  def stage_report(self, compiled: list) -> list[dict]:
    """Per-stage plan rows from `(Lowering, compiled)` pairs; [] for one program."""


def mesh_words(program: Program) -> str:
  """The mesh a program runs on, for the start line: `mesh data=4 model=2`, or an MPMD
  program's stage submeshes (`stage submeshes data=2 model=2 | data=4`), not the all-device
  mesh its checkpoints are laid out on."""
  shape = lambda mesh: " ".join(f"{a}={s}" for a, s in mesh.shape.items())
  stage_meshes = getattr(getattr(program, "plan", None), "meshes", None)
  if stage_meshes:
    return "stage submeshes " + " | ".join(shape(m) for m in stage_meshes)
  return f"mesh {shape(program.mesh)}"


def fresh_state(program: Program, params) -> Any:
  """`program`'s live step-0 state with `params` (a canonical params tree holding every
  param, in the model's dtypes) and a fresh optimizer state: `init()`'s state with these
  weights, without building or running the random init that they would all replace (an
  import of a checkpoint: a random init of its whole model, compiled and run for nothing)."""
  targets = program.canonical_targets()
  split = jax.tree.map(lambda t: t.sharding.spec, targets)
  make = steps.partition(lambda p: train_state.fresh(program.tx, p), program.mesh,
                         (split.params,), split)
  # Placed as the state holds them (params read whole or on another layout reshard here).
  params = jax.device_put(params, jax.tree.map(lambda t: t.sharding, targets.params))
  return program.from_canonical(make(params))


def strategy_of(task) -> Strategy:
  """The task's execution strategy (`task.pipeline`; None = `Scan()`)."""
  return Scan() if task.pipeline is None else task.pipeline


def setup(task, example_local_batch, devices=None) -> Program:
  """The task's program on `devices` (default: all); raises ConfigError on a bad config
  (the example batch too is checked, before anything is built or restored)."""
  if isinstance(task.model, ChecksBatch):
    task.model.check_batch(example_local_batch)
  return strategy_of(task).build_program(task, example_local_batch, devices)
