"""A task on a mesh: the model under its execution strategy, state layouts, jitted programs.

`setup(task, example_batch)` is the partitioner's entry point. It builds the mesh, applies
`task.pipeline` to the model (the `Stacked` protocol), validates the model against the
mesh and batch, derives two state layouts and jits every program on the mesh:

  live       what train / eval run on: padded arrays in the execution strategy's layout
             (e.g. pipelined layers `[S, R, L/(S·R), ...]`);
  canonical  what checkpoints hold: logical (unpadded) arrays in the layout of the model
             run without a pipeline (layers `[L, ...]`), split evenly where dims divide.

`to_canonical` / `from_canonical` convert a whole train state between them (params and
the optimizer statistics that mirror them), so a checkpoint restores onto any mesh,
device count or pipeline strategy.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from spmdtask import mesh as mesh_lib
from spmdtask import sharding, steps, train_state
from spmdtask.errors import ConfigError
from spmdtask.inputs import global_batch
from spmdtask.model import ChecksBatch, LayoutMap, Model, Stacked, Work
from spmdtask.pipeline.mpmd_config import MpmdConfig
from spmdtask.task import Task
from spmdtask.train_state import StateLayout, TrainState


@dataclasses.dataclass(frozen=True)
class Program:
  """The jitted programs of one task on one mesh, and the layouts they agree on.

  init:           `() -> live state`.
  train:          `(live state, batch) -> (live state, metrics)`, state donated.
  eval:           `(live state, batch) -> Metrics` (weighted sums, replicated).
  to_canonical:   `live state -> canonical state` (fresh buffers: the input may be donated).
  from_canonical: `canonical state -> live state`.
  """
  task: Task
  model: Model
  mesh: Mesh
  tx: optax.GradientTransformation
  layout: StateLayout
  canonical: StateLayout
  canonical_split: TrainState
  batch_specs: Any
  work: Work
  init: steps.Partitioned
  train: steps.Partitioned
  eval: steps.Partitioned
  to_canonical: steps.Partitioned
  from_canonical: steps.Partitioned

  def global_batch(self, local_batch) -> Any:
    if isinstance(self.model, ChecksBatch):
      self.model.check_batch(local_batch)
    return global_batch.to_global(local_batch, self.batch_specs, self.mesh)

  def canonical_targets(self) -> TrainState:
    """ShapeDtypeStructs of the canonical state with their shardings on this mesh."""
    return sharded_structs(self.mesh, self.canonical.logical, self.canonical_split)

  def layout_facts(self) -> dict:
    """JSON-able facts of this layout, for checkpoint metadata."""
    pp = self.task.pipeline
    return {**mesh_facts(self.mesh),
            "pipeline": None if pp is None else dataclasses.asdict(pp),
            "num_microbatches": int(self.task.train.num_microbatches),
            "canonical": "logical arrays, layers stacked [L, ...]"}


def sharded_structs(mesh: Mesh, shapes, specs):
  """ShapeDtypeStructs of `shapes` carrying NamedShardings of `specs` on `mesh` (restore
  targets)."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=jax.sharding.NamedSharding(mesh, s)),
      shapes, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def mesh_facts(mesh: Mesh) -> dict:
  """The mesh's axis names and shape, JSON-able."""
  return {"mesh_axis_names": list(mesh.axis_names),
          "mesh_shape": [int(mesh.shape[a]) for a in mesh.axis_names]}


def apply_layout_maps(tree, maps: tuple[LayoutMap, ...], to_canonical: bool):
  """Converts every subtree under a map's path (params and the opt stats that mirror them)."""
  if not maps:
    return tree

  def match(path):
    keys = sharding.path_keys(path)
    return next((m for m in maps if keys[-len(m.path):] == m.path), None)

  def convert(path, node):
    m = match(path)
    if m is None:
      return node
    return (m.to_canonical if to_canonical else m.from_canonical)(node)

  return jax.tree_util.tree_map_with_path(convert, tree,
                                          is_leaf=lambda path, _: match(path) is not None,
                                          is_leaf_takes_path=True)


def strategy_models(task: Task) -> tuple[Model, Model]:
  """(the model run by task.pipeline, the same model unpipelined: the canonical one).

  Raises ConfigError for a model outside the contract, a pipeline on a model with no
  layer stack, or a model whose `execution` was set by hand.
  """
  model = task.model
  if not isinstance(model, Model):
    raise ConfigError(
        f"task.model ({type(model).__name__}) does not implement spmdtask.model.Model "
        "(loss, work_per_example, validate). Implement that protocol.")
  if not isinstance(model, Stacked):
    if task.pipeline is not None:
      raise ConfigError(
          f"task.pipeline is set, but task.model ({type(model).__name__}) has no layer stack "
          "to pipeline (spmdtask.model.Stacked). Set task.pipeline=None.")
    return model, model
  if getattr(model, "execution", None) is not None:
    raise ConfigError("task.model.execution is set by the framework from task.pipeline; set "
                      "task.pipeline instead and leave task.model.execution=None.")
  return model.with_pipeline(task.pipeline), model.with_pipeline(None)


def _check_microbatches(task: Task, global_size: int, mesh_shape) -> int:
  m = task.train.num_microbatches
  data = sharding.shards(task.batch_axes() or None, mesh_shape)
  if not isinstance(m, int) or m < 1 or global_size % m or (global_size // m) % data:
    raise ConfigError(
        f"task.train.num_microbatches={m!r} does not split the global batch of {global_size} "
        f"into equal microbatches that divide over the data axes {task.batch_axes()} "
        f"({data} shards): use a divisor M of {global_size} with {global_size}/M a multiple "
        f"of {data} (1 = no gradient accumulation).")
  return m


def setup(task: Task, example_local_batch, devices=None) -> Program:
  """Mesh, layouts and jitted programs for `task`; raises ConfigError on a bad config.

  With `task.pipeline` an `MpmdConfig`, the per-stage programs of
  `pipeline.mpmd_program`, behind the same interface.
  """
  if isinstance(task.pipeline, MpmdConfig):
    from spmdtask.pipeline import mpmd_program  # pylint: disable=import-outside-toplevel
    return mpmd_program.setup(task, example_local_batch, devices)  # (it imports this module)
  mesh = mesh_lib.create_mesh(task.mesh_axis_names, task.ici_mesh_shape, task.dcn_mesh_shape,
                              devices)
  mesh_shape = mesh_lib.mesh_shape(mesh)
  model, canonical_model = strategy_models(task)
  batch_specs = global_batch.specs(example_local_batch, task.train.inputs_split_mapping,
                                   task.batch_axes(), mesh)
  global_size = jax.tree.leaves(global_batch.global_shapes(example_local_batch))[0].shape[0]
  num_mb = _check_microbatches(task, global_size, mesh_shape)
  model.validate(mesh, global_size // num_mb)
  tx = task.train.make_optimizer()
  schedule = task.train.schedule()
  # Init traces on one row: params do not depend on the batch size.
  init_batch = jax.tree.map(lambda x: np.zeros((1,) + x.shape[1:], x.dtype), example_local_batch)
  # Layers read the mesh (constraints, pipeline) while tracing; only traces run under it,
  # so compile-only devices (a TPU topology) plan too.
  layout = train_state.layout(model, tx, init_batch, mesh_shape, mesh)
  canonical = (layout if canonical_model is model
               else train_state.layout(canonical_model, tx, init_batch, mesh_shape, mesh))
  with jax.set_mesh(mesh):
    work = model.work_per_example({k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
                                   for k, v in init_batch.items()})
  canonical_split = sharding.even_splits(canonical.logical, canonical.split, mesh_shape)
  maps = model.layout_maps() if isinstance(model, Stacked) else ()

  def to_canonical(state):
    logical = apply_layout_maps(sharding.unpad(state, layout.logical), maps, True)
    # `+ 0` gives fresh buffers even where nothing changes: the train step donates its input.
    return jax.tree.map(lambda x: x + jnp.zeros((), x.dtype), logical)

  def from_canonical(state):
    return sharding.pad(apply_layout_maps(state, maps, False), layout.padded)

  metrics_spec = P()
  return Program(
      task=task, model=model, mesh=mesh, tx=tx, layout=layout, canonical=canonical,
      canonical_split=canonical_split, batch_specs=batch_specs, work=work,
      init=steps.partition(steps.init_fn(model, tx, layout, init_batch, task.train.seed), mesh,
                           (), layout.split),
      train=steps.partition(
          steps.train_step_fn(model, tx, schedule, layout, task.train.seed, num_mb), mesh,
          (layout.split, batch_specs), (layout.split, metrics_spec), donate_argnums=(0,)),
      eval=steps.partition(steps.eval_step_fn(model, layout), mesh, (layout.split, batch_specs),
                           metrics_spec),
      to_canonical=steps.partition(to_canonical, mesh, (layout.split,), canonical_split),
      from_canonical=steps.partition(from_canonical, mesh, (canonical_split,), layout.split))
