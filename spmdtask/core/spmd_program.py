"""One SPMD program for a task: the scan or the SPMD stage-dim pipeline (`program.Program`).

`build(task, strategy, example_local_batch)` builds the mesh, applies the strategy to the
model (the `Stacked` protocol), validates the model against the mesh and batch, derives
the live layout (padded arrays in the strategy's layout, e.g. pipelined layers
`[S, R, L/(S·R), ...]`) and the canonical one, and jits every program on the mesh.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from spmdtask.core import layouts, objective as objective_lib
from spmdtask.core import mesh as mesh_lib
from spmdtask.core import sharding, steps, train_state
from spmdtask.core import global_batch
from spmdtask.core.host_input import Share
from spmdtask.core.model import ChecksBatch, Model, Stacked, Work
from spmdtask.core.objective import Reference
from spmdtask.core.train_state import StateLayout, TrainState


@dataclasses.dataclass(frozen=True)
class SpmdProgram:
  """The jitted programs of one task on one mesh (implements `program.Program`)."""
  task: Any
  strategy: Any  # spmdtask.core.strategy.Strategy
  model: Model
  mesh: Mesh
  tx: optax.GradientTransformation
  layout: StateLayout
  canonical: StateLayout
  canonical_split: TrainState
  batch_specs: Any
  work: Work
  _init: steps.Partitioned
  _train: steps.Partitioned
  _eval: steps.Partitioned
  _to_canonical: steps.Partitioned
  _from_canonical: steps.Partitioned
  _params_from_canonical: steps.Partitioned
  reference_kind: Reference = Reference.NONE
  # The live (padded) reference params the steps take (Reference.PARAMS): with_reference.
  reference: Any = None

  @property
  def needs_reference(self) -> bool:
    return self.reference_kind is Reference.PARAMS

  def with_reference(self, canonical_params) -> "SpmdProgram":
    """This program with its frozen reference params (a canonical params tree on `mesh`),
    converted to the live layout once; train and eval then pass them to every step."""
    return dataclasses.replace(self, reference=self._params_from_canonical(canonical_params))

  def _reference_args(self) -> tuple:
    if not self.needs_reference:
      return ()
    if self.reference is None:
      raise ValueError("This task's objective needs reference params: call "
                       "program.with_reference(params) first (run.reference does).")
    return (self.reference,)

  def init(self):
    """The canonical initial state (the unpipelined model's init), converted to live."""
    return self._init()

  def train(self, state, batch):
    return self._train(state, batch, *self._reference_args())

  def eval(self, state, batch):
    return self._eval(state, batch, *self._reference_args())

  def to_canonical(self, state) -> TrainState:
    return self._to_canonical(state)

  def from_canonical(self, state: TrainState):
    return self._from_canonical(state)

  def input_share(self) -> Share:
    return Share()  # each process its 1/N share of the rows; to_global assembles them

  def global_batch(self, local_batch) -> Any:
    if isinstance(self.model, ChecksBatch):
      self.model.check_batch(local_batch)
    return global_batch.to_global(local_batch, self.batch_specs, self.mesh)

  def canonical_targets(self) -> TrainState:
    return layouts.sharded_structs(self.mesh, self.canonical.logical, self.canonical_split)

  def layout_facts(self) -> dict:
    return layouts.layout_facts(self.mesh, self.task, self.strategy)

  def describe(self) -> list[str]:
    return [self.strategy.summary()]

  def stage_report(self, compiled) -> list[dict]:
    del compiled  # one program: plan.stage_report splits its state over the stage axis
    return []

  def lowerings(self, example_local_batch) -> list:
    state = layouts.sharded_structs(self.mesh, self.layout.padded, self.layout.split)
    batch = layouts.sharded_structs(
        self.mesh, global_batch.global_shapes(example_local_batch), self.batch_specs)
    args = (state, batch)
    if self.needs_reference:
      args += (layouts.sharded_structs(self.mesh, self.layout.padded.params,
                                       self.layout.split.params),)
    return [layouts.Lowering("train step", None, self.mesh, lambda: self._train.lower(*args),
                             fn=self._train.jitted, args=args)]


def build(task, strategy, example_local_batch, devices=None) -> SpmdProgram:
  """Mesh, layouts and jitted programs for `task` under `strategy` (module doc)."""
  mesh = mesh_lib.create_mesh(task.mesh_axis_names, task.ici_mesh_shape, task.dcn_mesh_shape,
                              devices)
  mesh_shape = mesh_lib.mesh_shape(mesh)
  model, canonical_model = layouts.strategy_models(task, task.pipeline)
  objective = objective_lib.of(task)
  objective.validate(task)
  kind = objective.reference_kind(model)
  batch_specs = global_batch.specs(example_local_batch, task.train.inputs_split_mapping,
                                   task.batch_axes(), mesh)
  global_size = jax.tree.leaves(global_batch.global_shapes(example_local_batch))[0].shape[0]
  num_mb = layouts.check_microbatches(task, global_size, mesh_shape)
  model.validate(mesh, global_size // num_mb)
  only_adapters = train_state.adapters_only(model)
  tx = train_state.optimizer(task.train.make_optimizer(), only_adapters,
                             train_state.has_buffers(model))
  schedule = task.train.schedule()
  # Init traces on one row: params do not depend on the batch size.
  # The objective's example as the model's batch (e.g. DPO: a pair, two rows).
  init_batch = objective.model_batch(
      jax.tree.map(lambda x: np.zeros((1,) + x.shape[1:], x.dtype), example_local_batch))
  # Layers read the mesh (constraints, pipeline) while tracing; only traces run under it,
  # so compile-only devices (a TPU topology) plan too.
  layout = train_state.layout(model, tx, init_batch, mesh_shape, mesh)
  canonical = (layout if canonical_model is model
               else train_state.layout(canonical_model, tx, init_batch, mesh_shape, mesh))
  with jax.set_mesh(mesh):
    work = _work(model.work_per_example({k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
                                         for k, v in init_batch.items()}),
                 jax.tree.leaves(init_batch)[0].shape[0], kind)
  canonical_split = sharding.even_splits(canonical.logical, canonical.split, mesh_shape)
  maps = model.layout_maps() if isinstance(model, Stacked) else ()

  def to_canonical(state):
    logical = layouts.apply_layout_maps(sharding.unpad(state, layout.logical), maps, True)
    # `+ 0` gives fresh buffers even where nothing changes: the train step donates its input.
    return jax.tree.map(lambda x: x + jnp.zeros((), x.dtype), logical)

  def from_canonical(state):
    return sharding.pad(layouts.apply_layout_maps(state, maps, False), layout.padded)

  def canonical_init():
    return train_state.create(canonical_model, tx, jax.random.key(task.train.seed), init_batch)

  def params_from_canonical(params):
    return sharding.pad(layouts.apply_layout_maps(params, maps, False), layout.padded.params)

  metrics_spec = P()
  ref_specs = (layout.split.params,) if kind is Reference.PARAMS else ()
  return SpmdProgram(
      task=task, strategy=strategy, model=model, mesh=mesh, tx=tx, layout=layout,
      canonical=canonical, canonical_split=canonical_split, batch_specs=batch_specs, work=work,
      # One program: the canonical init converted to live where it is made (no second
      # copy of the state, no second compile).
      _init=steps.partition(lambda: from_canonical(canonical_init()), mesh, (), layout.split),
      _train=steps.partition(
          steps.train_step_fn(model, tx, schedule, layout, task.train.seed, num_mb,
                              only_adapters, objective), mesh,
          (layout.split, batch_specs, *ref_specs), (layout.split, metrics_spec),
          donate_argnums=(0,)),
      _eval=steps.partition(steps.eval_step_fn(model, layout, objective), mesh,
                            (layout.split, batch_specs, *ref_specs), metrics_spec),
      _to_canonical=steps.partition(to_canonical, mesh, (layout.split,), canonical_split),
      _from_canonical=steps.partition(from_canonical, mesh, (canonical_split,), layout.split),
      _params_from_canonical=steps.partition(params_from_canonical, mesh,
                                             (canonical_split.params,), layout.split.params),
      reference_kind=kind)


def _work(row: Work, rows: int, kind: Reference) -> Work:
  """One example's work from one model row's: `rows` model rows (e.g. a DPO pair: 2), each
  with a reference forward (a third of a train step's FLOPs) where the step runs one."""
  scale = rows * (4 / 3 if kind in (Reference.PARAMS, Reference.ADAPTERS_OFF) else 1)
  return row._replace(train_flops=row.train_flops * scale, tokens=row.tokens * rows,
                      attention_flops=row.attention_flops * scale)
