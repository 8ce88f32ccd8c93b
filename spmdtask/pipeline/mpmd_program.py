"""A task under `task.pipeline = MpmdConfig`: per-stage programs, with `program.Program`'s
interface, so the loop, evaluation and checkpoints run it unchanged.

  setup(task, example_local_batch, devices) -> MpmdProgram
    init()                     -> MpmdState(step, stages)
    train(state, batch)        -> (state, metrics)   loss, model metrics, grad_norm,
                                                     param_norm, learning_rate
    eval(state, batch)         -> Metrics (weighted sums, on the last stage)
    to_canonical(state)        -> TrainState on `mesh` (all devices), the canonical layout
    from_canonical(TrainState) -> MpmdState

The model's loss is cut at its stage boundaries (`pipeline.split`) and run by
`mpmd.Pipeline`; `mpmd_step.TrainStep` updates every stage with the optimizer without its
clipping (clipping uses the norm over all stages). The loss is the model's weighted mean:
each microbatch contributes its loss sum `loss · weight` and the step divides by the
summed weight (Model contract), so loss and update equal the unpipelined step's.

Canonical conversion. The live state is per stage: `{path: param}` and the optimizer's
state over those params. `to_canonical` gathers the params (a tied leaf from its first
stage) into the live tree (layer groups `block_<g>`), collects every optimizer statistic
that mirrors the params (optax identifies them: `tree_map_params`) the same way, moves
everything onto `mesh` and converts with the model's `layout_maps` (groups -> `[L, ...]`);
`from_canonical` does the reverse. The canonical optimizer state is that of
`task.train.make_optimizer()`: its clipping adds an empty state, so its leaves are the
stages' optimizer's leaves in the same order.

Processes. One process drives every submesh; with several (`--num_processes`) each owns
whole stages (their submeshes lie on its devices) and runs only their programs, and the
arrays between stages cross with collectives (mpmd_cross). Every process then gets the
same view of what the loop, evaluation and checkpoints read: the global batch (an
all-gather of the processes' rows: each stage needs every microbatch), the step and the
metrics (broadcast from the last stage to every device), and the canonical state
(every stage's state broadcast, then laid out on `mesh`); `from_canonical` replicates the
canonical state and each process keeps its stages' leaves. These conversions hold a full
copy of the state per device for a moment; they run at init, save and restore only.
"""
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdtask import mesh as mesh_lib
from spmdtask import layouts, sharding, steps, train_state
from spmdtask.errors import ConfigError
from spmdtask.inputs import global_batch
from spmdtask.model import Metrics, Model, Work
from spmdtask.pipeline import auto_cuts, mpmd, mpmd_report, mpmd_stages, mpmd_step
from spmdtask.pipeline.mpmd_step import StageState
from spmdtask.train_state import StateLayout, TrainState


class MpmdState(NamedTuple):
  """The live MPMD train state: the step (on the last stage) and every stage's state."""
  step: jax.Array
  stages: tuple[StageState, ...]


DROPOUT_KEY = "__dropout_key__"  # the batch leaf that carries each microbatch's dropout key


def _is_everything(_) -> bool:
  return True


def _mirrors(tx, opt_state) -> tuple[list, list]:
  """(param-mirroring subtrees, other leaves) of an optax state, in tree order."""
  subs, others = [], []
  optax.tree_utils.tree_map_params(tx, subs.append, opt_state, is_leaf=_is_everything,
                                   transform_non_params=others.append)
  return subs, others


def _rebuild(tx, template, subs, others):
  """`template` (an optax state of `tx`) with its mirrors and other leaves replaced."""
  subs, others = iter(subs), iter(others)
  return optax.tree_utils.tree_map_params(tx, lambda _: next(subs), template,
                                          is_leaf=_is_everything,
                                          transform_non_params=lambda _: next(others))


def _sum_metrics(aux: tuple) -> Metrics:
  return jax.tree.map(lambda *xs: sum(xs), *aux)


@dataclasses.dataclass
class MpmdProgram:
  """The per-stage programs of one task and the layouts they agree on (module doc)."""
  task: Any
  model: Model
  mesh: Mesh  # every device: canonical restore targets
  tx: optax.GradientTransformation  # the canonical optimizer (with clipping)
  base_tx: optax.GradientTransformation  # what each stage runs (clipping done globally)
  canonical: StateLayout
  canonical_split: TrainState
  live: StateLayout  # the live tree (layer groups) of base_tx, split evenly on `mesh`
  live_split: TrainState
  work: Work
  config: Any  # the MpmdConfig strategy
  batch_specs: Any  # the global batch on `mesh` (the loop's view; stages split it)
  pipeline: mpmd.Pipeline
  step_fn: mpmd_step.TrainStep
  _init: steps.Partitioned
  _finish: steps.Partitioned
  _sum: steps.Partitioned
  _to_canonical: steps.Partitioned
  _from_canonical: steps.Partitioned
  num_layers: int
  shapes: dict  # avals of what crosses processes: "train", "eval" outputs, "stages"
  make_eval_pipeline: Any = None  # () -> the forward-only Pipeline (no dropout), built once
  cut_costs: Any = None  # () -> auto_cuts.CutCosts: the stages' compiled costs (measured once)
  last_peak_residuals: tuple[int, ...] | None = None
  _eval_pipeline: Any = None
  _last_step: tuple = (None, 0)  # (the step array train returned, its value on the host)

  # ---- the Program interface ------------------------------------------------------------

  def init(self) -> MpmdState:
    """The canonical fresh state (the same values as every other strategy's), placed."""
    return self.from_canonical(self._init())

  @property
  def layout(self) -> StateLayout:
    """The live state's layout (layer groups) laid out evenly on `mesh` (Program.layout);
    `describe` gives each stage's own bytes."""
    return self.live

  @property
  def _last(self) -> int:
    return self.pipeline.part_stage[-1]

  def _dropout_keys(self, state: MpmdState) -> np.ndarray:
    """[M, key] dropout key data: microbatch m's is fold_in(fold_in(key(seed), step), m),
    what the unpipelined step with M-microbatch accumulation gives microbatch m. The step
    is read from the device once (after init or restore), then counted here."""
    arr, n = self._last_step
    if arr is not state.step:
      n = int(np.asarray(state.step.addressable_shards[0].data))
    rng = jax.random.fold_in(jax.random.key(self.task.train.seed), n)
    return np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(rng, m)))
                     for m in range(self.config.num_microbatches)]), n

  def train_batch(self, state: MpmdState, batch) -> dict:
    """What the train pipeline runs (e.g. for `pipeline.backward_flops`): the global batch
    and each microbatch's dropout key."""
    return {**batch, DROPOUT_KEY: self._dropout_keys(state)[0]}

  def train(self, state: MpmdState, batch) -> tuple[MpmdState, dict]:
    cross = self.pipeline.cross
    keys, n = self._dropout_keys(state)
    stages, m = self.step_fn(state.stages, {**batch, DROPOUT_KEY: keys})
    self.last_peak_residuals = m["peak_residuals"]
    if not cross.multiprocess:
      step, metrics = self._finish(state.step, m["loss"], m["grad_norm"], m["param_norm"],
                                   m["aux"])
      self._last_step = (step, n + 1)
      return MpmdState(step, stages), metrics
    out = None
    if cross.local[self._last]:
      out = self._finish(cross.localize(state.step, cross.meshes[self._last]), m["loss"],
                         m["grad_norm"], m["param_norm"], m["aux"])
    step, metrics = cross.broadcast(out, self._last, self.shapes["train"])
    self._last_step = (step, n + 1)
    return MpmdState(step, stages), metrics

  def eval(self, state: MpmdState, batch) -> Metrics:
    cross = self.pipeline.cross
    if self._eval_pipeline is None:
      self._eval_pipeline = self.make_eval_pipeline()
    _, aux = self._eval_pipeline.forward([st.params if st else None for st in state.stages],
                                         batch)
    if not cross.multiprocess:
      return self._sum(aux)
    out = self._sum(aux) if cross.local[self._last] else None
    return cross.broadcast(out, self._last, self.shapes["eval"])

  def global_batch(self, local_batch) -> Any:
    """Host arrays of the global batch (every process's rows, in process order: each
    stage needs every microbatch); the pipeline splits them on each stage's submesh."""
    if jax.process_count() > 1:
      return multihost_utils.process_allgather(local_batch, tiled=True)
    return jax.tree.map(np.asarray, local_batch)

  def canonical_targets(self) -> TrainState:
    return layouts.sharded_structs(self.mesh, self.canonical.logical, self.canonical_split)

  def layout_facts(self) -> dict:
    return layouts.layout_facts(self.mesh, self.task, self.config)

  def describe(self) -> list[str]:
    return mpmd_report.describe(self)

  def lowerings(self, example_local_batch) -> list:
    return mpmd_report.lowerings(self)

  def stage_report(self, compiled) -> list[dict]:
    return mpmd_report.stage_report(self, compiled)

  def to_canonical(self, state: MpmdState) -> TrainState:
    pl, cross = self.pipeline, self.pipeline.cross
    if cross.multiprocess:  # every stage's state on every device (module doc)
      here = lambda t: jax.tree.map(lambda x: cross.localize(x, self.mesh), t)
      state = MpmdState(here(state.step), tuple(
          here(cross.broadcast(st, s, self.shapes["stages"][s]))
          for s, st in enumerate(state.stages)))
    params = pl.gather([st.params for st in state.stages])
    per_stage = [_mirrors(self.base_tx, st.opt_state) for st in state.stages]
    subs = []
    for i in range(len(per_stage[0][0])):
      merged = {}
      for stage_subs, _ in per_stage:
        for k, x in stage_subs[i].items():
          merged.setdefault(k, x)  # a tied leaf's statistics from its first stage
      subs.append(jax.tree.unflatten(pl.params_tree, [merged[k] for k in pl.paths]))
    opt_state = _rebuild(self.base_tx, self.live.logical.opt_state, subs, per_stage[0][1])
    live = TrainState(state.step, params, opt_state)
    live = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(self.mesh, s)), live,
                        self.live_split)
    return self._to_canonical(live)

  def from_canonical(self, state: TrainState) -> MpmdState:
    live = self._from_canonical(state)
    pl, cross = self.pipeline, self.pipeline.cross
    if cross.multiprocess:  # replicated: each process takes its stages' leaves locally
      live = cross.replicate(live, self.mesh)
      here = lambda t, s: jax.tree.map(lambda x: cross.localize(x, pl.stages[s].mesh), t)
    else:
      here = lambda t, s: t
    flat = dict(zip(pl.paths, jax.tree.leaves(live.params)))
    subs, others = _mirrors(self.base_tx, live.opt_state)
    flat_subs = [dict(zip(pl.paths, jax.tree.leaves(sub))) for sub in subs]
    stages = []
    for s, (keys, prog, spec) in enumerate(zip(pl.stage_keys, self.step_fn.programs,
                                               pl.stages)):
      if not cross.local[s]:
        stages.append(None)
        continue
      params = {k: jax.device_put(here(flat[k], s), pl.sharding(s, k)) for k in keys}
      template = jax.eval_shape(self.base_tx.init, params)
      opt = _rebuild(self.base_tx, template, [{k: f[k] for k in keys} for f in flat_subs],
                     others)
      stages.append(StageState(params, jax.device_put(
          here(opt, s), steps.named_shardings(spec.mesh, prog.opt_specs))))
    if cross.multiprocess:
      return MpmdState(live.step, tuple(stages))
    step = jax.device_put(live.step, NamedSharding(pl.stages[self._last].mesh, P()))
    return MpmdState(step, tuple(stages))


def setup(task, config, example_local_batch, devices=None) -> MpmdProgram:
  """Submeshes, layouts and per-stage programs for `task` under the MpmdConfig `config`;
  ConfigError on a bad config. `layer_cuts="auto"` is resolved first (auto_cuts) and the
  program holds the config with the chosen cuts."""
  devices = list(devices if devices is not None else jax.devices())
  meshes = mpmd_stages.submeshes(config, task.mesh_axis_names, devices)
  mesh = mesh_lib.create_mesh(task.mesh_axis_names, task.ici_mesh_shape, task.dcn_mesh_shape,
                              devices)
  model, canonical_model = layouts.strategy_models(task, config)  # cuts may be "auto" here
  shapes = global_batch.global_shapes(example_local_batch)
  global_size = jax.tree.leaves(shapes)[0].shape[0]
  mb_size = mpmd_stages.check_batch(config, global_size)
  if task.train.num_microbatches != 1:
    raise ConfigError(f"task.train.num_microbatches={task.train.num_microbatches} with an MPMD "
                      "pipeline: the pipeline splits the batch itself; set "
                      "task.pipeline.num_microbatches and task.train.num_microbatches=1.")
  for s, m in enumerate(meshes):
    model.validate(m, mb_size)
    data = sharding.shards(task.batch_axes() or None, mesh_lib.mesh_shape(m))
    if mb_size % data:  # the stage's activation constraints split microbatch rows
      raise ConfigError(
          f"task.pipeline.num_microbatches={config.num_microbatches} makes microbatches of "
          f"{mb_size} rows, which do not split over stage {s}'s data axes "
          f"{task.batch_axes()} ({data} shards, task.pipeline.submesh_shapes[{s}]="
          f"{tuple(config.submesh_shapes[s])}): use fewer microbatches, a larger batch, or "
          "fewer data shards on that stage.")
  full = mesh_lib.mesh_shape(mesh)
  batch_split = sharding.input_split_dims(shapes, task.train.inputs_split_mapping,
                                          task.batch_axes(), full)
  micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((mb_size,) + x.shape[1:], x.dtype), shapes)
  config, cut_costs = auto_cuts.resolve(task, config, meshes, micro, batch_split,
                                        canonical_model.num_layers)  # "auto" -> its cuts
  model, _ = layouts.strategy_models(task, config)
  schedule = mpmd_stages.make_schedule(config)
  tp = task.train
  tx = tp.make_optimizer()
  base_tx = tp.optimizer(learning_rate=tp.schedule())
  lr_schedule = tp.schedule()
  init_batch = jax.tree.map(lambda x: np.zeros((1,) + x.shape[1:], x.dtype), example_local_batch)
  with jax.set_mesh(mesh):
    canonical = train_state.layout(canonical_model, tx, init_batch, full)
    work = model.work_per_example({k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
                                   for k, v in init_batch.items()})
  # The live layout without a mesh (shapes and splits only); the Pipeline traces each
  # stage's part under that stage's submesh, where the activation constraints apply.
  live = train_state.layout(model, base_tx, init_batch, full)
  canonical_split = sharding.even_splits(canonical.logical, canonical.split, full)
  live_split = sharding.even_splits(live.logical, live.split, full)

  act = P(task.batch_axes() or None)
  specs = []
  for m in meshes:
    ms = mesh_lib.mesh_shape(m)
    specs.append(mpmd.StageSpec(m, sharding.even_splits(live.logical.params, live.split.params,
                                                        ms),
                                sharding.even_splits(micro, batch_split, ms), act))

  def eval_loss_fn(params, mb):  # microbatch m's loss sum (TrainStep divides by the total)
    loss, metrics = model.apply({"params": params}, mb, method=model.loss)
    return loss * jax.lax.stop_gradient(metrics["loss"].weight), metrics

  def loss_fn(params, mb):  # the same, with microbatch m's dropout key (DROPOUT_KEY)
    rest = {k: v for k, v in mb.items() if k != DROPOUT_KEY}
    rngs = {"dropout": jax.random.wrap_key_data(mb[DROPOUT_KEY][0])}
    loss, metrics = model.apply({"params": params}, rest, method=model.loss, rngs=rngs)
    return loss * jax.lax.stop_gradient(metrics["loss"].weight), metrics

  key_aval = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  micro_train = {**micro, DROPOUT_KEY: jax.ShapeDtypeStruct((1,) + key_aval.shape,
                                                            key_aval.dtype)}
  train_specs = [dataclasses.replace(sp, batch_specs={**sp.batch_specs, DROPOUT_KEY: P()})
                 for sp in specs]
  pl = mpmd.Pipeline(loss_fn, live.logical.params, micro_train, train_specs, schedule,
                     has_aux=True)
  make_eval = lambda: mpmd.Pipeline(eval_loss_fn, live.logical.params, micro, specs, schedule,
                                    has_aux=True)
  step_fn = mpmd_step.TrainStep(pl, base_tx, tp.clip_grad_norm or None,
                                loss_weight=lambda aux: sum(a["loss"].weight for a in aux))
  last_mesh = meshes[pl.part_stage[-1]]

  def finish(step, loss, grad_norm, param_norm, aux):
    return step + 1, {**steps.reported(_sum_metrics(aux)), "loss": loss,
                      "grad_norm": grad_norm, "param_norm": param_norm,
                      "learning_rate": jnp.asarray(lr_schedule(step), jnp.float32)}

  aux = (jax.eval_shape(eval_loss_fn, live.logical.params, micro)[1],) * config.num_microbatches
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  cross_shapes = {"train": jax.eval_shape(finish, canonical.logical.step, scalar, scalar, scalar, aux),
            "eval": jax.eval_shape(_sum_metrics, aux),
            "stages": [jax.eval_shape(lambda p: StageState(p, base_tx.init(p)), {
                k: pl.param_shapes[pl.paths.index(k)] for k in keys}) for keys in pl.stage_keys]}
  maps = model.layout_maps()
  canonical_tree = jax.tree.structure(canonical.logical.opt_state)
  live_tree = jax.tree.structure(live.logical.opt_state)

  def to_canonical(state: TrainState) -> TrainState:
    params = layouts.apply_layout_maps(state.params, maps, True)
    opt = layouts.apply_layout_maps(state.opt_state, maps, True)
    opt = jax.tree.unflatten(canonical_tree, jax.tree.leaves(opt))
    return jax.tree.map(lambda x: x + jnp.zeros((), x.dtype), TrainState(state.step, params, opt))

  def from_canonical(state: TrainState) -> TrainState:
    params = layouts.apply_layout_maps(state.params, maps, False)
    opt = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(base_tx.init, state.params)),
                             jax.tree.leaves(state.opt_state))
    opt = layouts.apply_layout_maps(opt, maps, False)
    return TrainState(state.step, params, jax.tree.unflatten(live_tree, jax.tree.leaves(opt)))

  return MpmdProgram(
      task=task, model=model, mesh=mesh, tx=tx, base_tx=base_tx, canonical=canonical,
      canonical_split=canonical_split, live=live, live_split=live_split, work=work,
      config=config, batch_specs=global_batch.specs(example_local_batch, tp.inputs_split_mapping,
                                                    task.batch_axes(), mesh),
      pipeline=pl, make_eval_pipeline=make_eval, step_fn=step_fn, shapes=cross_shapes,
      num_layers=canonical_model.num_layers, cut_costs=cut_costs,
      _init=steps.partition(lambda: train_state.create(canonical_model, tx,
                                                       jax.random.key(tp.seed), init_batch),
                            mesh, (), canonical_split),
      _finish=steps.partition(finish, last_mesh, (P(), P(), P(), P(), P()), P()),
      _sum=steps.partition(_sum_metrics, last_mesh, (P(),), P()),
      _to_canonical=steps.partition(to_canonical, mesh, (live_split,), canonical_split),
      _from_canonical=steps.partition(from_canonical, mesh, (canonical_split,), live_split))
