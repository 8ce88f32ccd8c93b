"""A task under `task.pipeline = MpmdConfig`: per-stage programs, with `program.Program`'s
interface, so the loop, evaluation and checkpoints run it unchanged.

  setup(task, example_local_batch, devices) -> MpmdProgram
    init()                     -> MpmdState(step, stages)
    train(state, batch)        -> (state, metrics)   loss, model metrics, grad_norm,
                                                     param_norm, learning_rate
    eval(state, batch)         -> Metrics (weighted sums, on the last stage)
    to_canonical(state)        -> TrainState on `mesh` (all devices), the canonical layout
    from_canonical(TrainState) -> MpmdState

`setup` is one pass: `stages.plan` makes every decision once (submeshes, microbatches, the
cuts with "auto" resolved, the schedule) into the frozen `StagePlan` the program holds;
the models and layouts, the pipelines and the step are built from it in that order.

The model's loss is cut at its stage boundaries (`mpmd.split`) and run by
`mpmd.Pipeline`; `mpmd.step.TrainStep` updates every stage with the optimizer without its
clipping (clipping uses the norm over all stages). The loss is the model's weighted mean:
each microbatch contributes its loss sum `loss · weight` and the step divides by the
summed weight (Model contract), so loss and update equal the unpipelined step's.

Canonical conversion: `mpmd.canonical`.

Processes. One process drives every submesh; with several (`--num_processes`) each owns
whole stages (their submeshes lie on its devices) and runs only their programs, and the
arrays between stages cross with collectives (mpmd.transfers). Each process reads only what
its stages consume (`input_share`, `mpmd.feed`): every row of the global batch (a stage
needs every microbatch) but only the leaves its stages' parts read (e.g. the first
stage's 'inputs', the last stage's 'targets' and 'weights'); `global_batch` drops any
other leaf before placement, and nothing is gathered between hosts. Every process gets
the same view of the step and the metrics (broadcast from the last stage to every
device), and of the canonical state (every stage's state broadcast, then laid out on
`mesh`); `from_canonical` replicates the canonical state and each process keeps its
stages' leaves. These conversions hold a full copy of the state per device for a moment;
they run at init, save and restore only.
"""
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, PartitionSpec as P

from spmdtask.core import mesh as mesh_lib
from spmdtask.core import layouts, sharding, steps, train_state
from spmdtask.core import global_batch
from spmdtask.core.host_input import Share
from spmdtask.core.model import Metrics, Model, Work
from spmdtask.pipeline.mpmd import (pipeline as mpmd, canonical as mpmd_canonical,
    feed as mpmd_feed, report, stages as mpmd_stages, step as mpmd_step)
from spmdtask.pipeline.mpmd.step import StageState
from spmdtask.core.train_state import StateLayout, TrainState


class MpmdState(NamedTuple):
  """The live MPMD train state: the step (on the last stage) and every stage's state."""
  step: jax.Array
  stages: tuple[StageState, ...]


DROPOUT_KEY = "__dropout_key__"  # the batch leaf that carries each microbatch's dropout key
_KEY_SHAPE = (2,)  # threefry key data


@functools.partial(jax.jit, static_argnums=(0, 2))
def _microbatch_keys(seed: int, step, num_microbatches: int) -> jax.Array:
  """[M, 2] key data: fold_in(fold_in(key(seed), step), m) for every m, in one program
  (one dispatch and one read a step instead of 2M eager ops)."""
  rng = jax.random.fold_in(jax.random.key(seed), step)
  return jax.vmap(lambda m: jax.random.key_data(jax.random.fold_in(rng, m)))(
      jnp.arange(num_microbatches))


def _drained(tree):
  """`tree`, once computed. With several processes a step ends there: without a host
  sync per step one process dispatches later steps' collectives while its peer is still
  in earlier ones, and a 2-process eval (no host sync in its loop) then hung in about
  half the runs here (gloo, CPU). The host all-gather of the batch used to be that sync."""
  return jax.block_until_ready(tree)


def _sum_metrics(aux: tuple) -> Metrics:
  return jax.tree.map(lambda *xs: sum(xs), *aux)


@dataclasses.dataclass
class MpmdProgram:
  """The per-stage programs of one task and the layouts they agree on (module doc)."""
  task: Any
  plan: mpmd_stages.StagePlan  # every decision: cuts, schedule, microbatches, submeshes
  model: Model
  mesh: Mesh  # every device: canonical restore targets
  tx: optax.GradientTransformation  # the canonical optimizer (with clipping)
  base_tx: optax.GradientTransformation  # what each stage runs (clipping done globally)
  canonical: StateLayout
  canonical_split: TrainState
  live: StateLayout  # the live tree (layer groups) of base_tx, split evenly on `mesh`
  live_split: TrainState
  work: Work
  batch_specs: Any  # the global batch on `mesh` (the loop's view: stages split it, so a dim that
  # does not divide over `mesh` is replicated here)
  pipeline: mpmd.Pipeline
  step_fn: mpmd_step.TrainStep
  _init: steps.Partitioned
  _finish: steps.Partitioned
  _sum: steps.Partitioned
  _to_canonical: steps.Partitioned
  _from_canonical: steps.Partitioned
  shapes: dict  # avals of what crosses processes: "train", "eval" outputs, "stages"
  make_eval_pipeline: Any = None  # () -> the forward-only Pipeline (no dropout), built once
  feed: Share = Share()  # what this process reads of each global batch (input_share)
  last_peak_residuals: tuple[int, ...] | None = None
  _feed_logged: bool = False
  _eval_pipeline: Any = None
  _last_step: tuple = (None, 0)  # (the step array train returned, its value on the host)
  reads_dropout_key: bool = True  # whether a stage part reads DROPOUT_KEY (dropout on)

  @property
  def config(self):
    """The MpmdConfig strategy, its cuts resolved (the plan's)."""
    return self.plan.config

  @property
  def num_layers(self) -> int:
    return self.plan.num_layers

  @property
  def batch_rows(self) -> int:  # rows of the global batch
    return self.plan.batch_rows

  @property
  def cut_costs(self):  # () -> auto_cuts.CutCosts: the stages' compiled costs (measured once)
    return self.plan.cut_costs

  # ---- the Program interface ------------------------------------------------------------
  needs_reference = False  # only the LM loss runs here (MpmdConfig refuses an objective)

  def with_reference(self, canonical_params) -> "MpmdProgram":
    return self

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
    M = self.plan.num_microbatches
    if not self.reads_dropout_key:  # no dropout: nothing to compute (nor wait for)
      return np.zeros((M, *_KEY_SHAPE), np.uint32), n
    return _microbatch_keys(self.task.train.seed, n, M), n  # on a device, not read here

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
    # Each multi-process step ends when its broadcast is done (see `_drained`).
    step, metrics = _drained(cross.broadcast(out, self._last, self.shapes["train"]))
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
    return _drained(cross.broadcast(out, self._last, self.shapes["eval"]))

  def input_share(self) -> Share:
    return self.feed

  def global_batch(self, local_batch) -> Any:
    """Host arrays of the global batch for the pipeline, which splits them on each stage's
    submesh; with several processes, of the leaves this process's stages read, the
    others None (`mpmd.feed.select`)."""
    out = mpmd_feed.select(local_batch, self.feed, self.batch_rows)
    if self.feed.leaves is not None and not self._feed_logged:
      self._feed_logged = True
      logging.info("%s", mpmd_feed.describe(
          local_batch, out, self.feed, self.batch_rows,
          [s for s, here in enumerate(self.pipeline.cross.local) if here]))
    return out

  def canonical_targets(self) -> TrainState:
    return layouts.sharded_structs(self.mesh, self.canonical.logical, self.canonical_split)

  def layout_facts(self) -> dict:
    return layouts.layout_facts(self.mesh, self.task, self.config)

  def describe(self) -> list[str]:
    return report.describe(self)

  def lowerings(self, example_local_batch) -> list:
    return report.lowerings(self)

  def stage_report(self, compiled) -> list[dict]:
    return report.stage_report(self, compiled)

  def to_canonical(self, state: MpmdState) -> TrainState:
    return self._to_canonical(mpmd_canonical.gather(self, state.step, state.stages))

  def from_canonical(self, state: TrainState) -> MpmdState:
    return MpmdState(*mpmd_canonical.scatter(self, self._from_canonical(state)))


class _States(NamedTuple):
  """The models and the state layouts a plan gives (`_states`)."""
  model: Model  # the model under the plan's cuts (layer groups)
  canonical_model: Model  # the same model unpipelined
  tx: optax.GradientTransformation
  base_tx: optax.GradientTransformation
  init_batch: Any  # one example row of zeros: what init traces
  canonical: StateLayout
  canonical_split: TrainState
  live: StateLayout
  live_split: TrainState
  work: Work


def setup(task, config, example_local_batch, devices=None) -> MpmdProgram:
  """Submeshes, layouts and per-stage programs for `task` under the MpmdConfig `config`;
  ConfigError on a bad config. One pass: the stage plan (every decision, "auto" cuts
  resolved), the models and layouts under it, the split pipelines (parts, programs,
  runner), the train step, the program."""
  devices = list(devices if devices is not None else jax.devices())
  plan = mpmd_stages.plan(task, config, global_batch.global_shapes(example_local_batch),
                          devices)
  st = _states(task, plan, example_local_batch)
  micro_train = _micro_train(plan)
  pl, make_eval, eval_loss_fn = _pipelines(task, plan, st, micro_train, devices)
  step_fn = mpmd_step.TrainStep(pl, st.base_tx, task.train.clip_grad_norm or None,
                                loss_weight=lambda aux: sum(a["loss"].weight for a in aux),
                                only_adapters=train_state.adapters_only(st.model))
  return _program(task, plan, st, micro_train, pl, make_eval, eval_loss_fn, step_fn,
                  example_local_batch)


def _states(task, plan: mpmd_stages.StagePlan, example_local_batch) -> _States:
  """The models under `plan`'s cuts and their canonical and live state layouts."""
  model, canonical_model = layouts.strategy_models(task, plan.config)
  tp = task.train
  only = train_state.adapters_only(model)  # LoRA: adapters alone hold optimizer state
  # A model's buffers (an MoE's balancing bias) hold no optimizer state; MPMD keeps them
  # as they are (their per-step update runs in the SPMD step only).
  buffers = train_state.has_buffers(model)
  tx = train_state.optimizer(tp.make_optimizer(), only, buffers)
  base_tx = train_state.optimizer(tp.optimizer(learning_rate=tp.schedule()), only, buffers)
  init_batch = jax.tree.map(lambda x: np.zeros((1,) + x.shape[1:], x.dtype), example_local_batch)
  full = mesh_lib.mesh_shape(plan.mesh)
  # `mesh=`, not a mesh context: optax's eager bits must not run on compile-only devices
  # (a TPU topology planned on this machine).
  canonical = train_state.layout(canonical_model, tx, init_batch, full, plan.mesh)
  with jax.set_mesh(plan.mesh):
    work = model.work_per_example({k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
                                   for k, v in init_batch.items()})
  # The live layout without a mesh (shapes and splits only); the Pipeline traces each
  # stage's part under that stage's submesh, where the activation constraints apply.
  live = train_state.layout(model, base_tx, init_batch, full)
  return _States(model, canonical_model, tx, base_tx, init_batch, canonical,
                 sharding.even_splits(canonical.logical, canonical.split, full), live,
                 sharding.even_splits(live.logical, live.split, full), work)


def _pipelines(task, plan: mpmd_stages.StagePlan, st: _States, micro_train, devices):
  """(the train Pipeline, () -> the eval Pipeline, the eval loss): `st.model`'s loss split
  at its stage boundaries, each part's programs on its stage's submesh."""
  model, params = st.model, st.live.logical.params
  act = P(task.batch_axes() or None)
  specs = []
  for m in plan.meshes:
    ms = mesh_lib.mesh_shape(m)
    specs.append(mpmd.StageSpec(m, sharding.even_splits(params, st.live.split.params, ms),
                                sharding.even_splits(plan.micro, plan.batch_split, ms), act))

  def eval_loss_fn(params, mb):  # microbatch m's loss sum (TrainStep divides by the total)
    loss, metrics = model.apply({"params": params}, mb, method=model.loss)
    return loss * jax.lax.stop_gradient(metrics["loss"].weight), metrics

  def loss_fn(params, mb):  # the same, with microbatch m's dropout key (DROPOUT_KEY)
    rest = {k: v for k, v in mb.items() if k != DROPOUT_KEY}
    rngs = {"dropout": jax.random.wrap_key_data(mb[DROPOUT_KEY][0])}
    loss, metrics = model.apply({"params": params}, rest, method=model.loss, rngs=rngs)
    return loss * jax.lax.stop_gradient(metrics["loss"].weight), metrics

  train_specs = [dataclasses.replace(sp, batch_specs={**sp.batch_specs, DROPOUT_KEY: P()})
                 for sp in specs]
  # Devices this process cannot run on (a TPU topology planned here) get no arrays.
  compile_only = not set(devices) <= set(jax.devices())
  pl = mpmd.Pipeline(loss_fn, params, micro_train, train_specs, plan.schedule,
                     has_aux=True, rows_are_sums=True, compile_only=compile_only)
  make_eval = lambda: mpmd.Pipeline(eval_loss_fn, params, plan.micro, specs, plan.schedule,
                                    has_aux=True, compile_only=compile_only)
  return pl, make_eval, eval_loss_fn


def _micro_train(plan: mpmd_stages.StagePlan) -> dict:
  """A train microbatch: the plan's, with its dropout key (DROPOUT_KEY)."""
  key_aval = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  return {**plan.micro, DROPOUT_KEY: jax.ShapeDtypeStruct((1,) + key_aval.shape,
                                                          key_aval.dtype)}


def _program(task, plan: mpmd_stages.StagePlan, st: _States, micro_train, pl: mpmd.Pipeline,
             make_eval, eval_loss_fn, step_fn: mpmd_step.TrainStep,
             example_local_batch) -> MpmdProgram:
  """The MpmdProgram: the plan, the pipelines and step, and the small programs around
  them (init, the step's finish, eval sums, canonical conversion)."""
  tp, base_tx, canonical, live = task.train, st.base_tx, st.canonical, st.live
  lr_schedule = tp.schedule()
  key_leaf = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      micro_train)[0]].index(jax.tree_util.keystr((jax.tree_util.DictKey(DROPOUT_KEY),)))
  last_mesh = plan.meshes[pl.part_stage[-1]]

  def finish(step, loss, grad_norm, param_norm, aux):
    summed = _sum_metrics(aux)
    return step + 1, {**steps.reported(summed), "loss": loss,
                      "grad_norm": grad_norm, "param_norm": param_norm,
                      "learning_rate": jnp.asarray(lr_schedule(step), jnp.float32),
                      "target_tokens": summed["loss"].weight}

  aux = (jax.eval_shape(eval_loss_fn, live.logical.params, plan.micro)[1],) * \
      plan.num_microbatches
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  cross_shapes = {
      "train": jax.eval_shape(finish, canonical.logical.step, scalar, scalar, scalar, aux),
      "eval": jax.eval_shape(_sum_metrics, aux),
      "stages": [jax.eval_shape(lambda p: StageState(p, base_tx.init(p)), {
          k: pl.param_shapes[pl.paths.index(k)] for k in keys}) for keys in pl.stage_keys]}
  maps = st.model.layout_maps()
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

  mesh, csplit, lsplit = plan.mesh, st.canonical_split, st.live_split
  return MpmdProgram(
      task=task, plan=plan, model=st.model, mesh=mesh, tx=st.tx, base_tx=base_tx,
      canonical=canonical, canonical_split=csplit, live=live, live_split=lsplit, work=st.work,
      batch_specs=sharding.even_splits(global_batch.global_shapes(example_local_batch),
                                       plan.batch_split, mesh_lib.mesh_shape(mesh)),
      pipeline=pl, make_eval_pipeline=make_eval, step_fn=step_fn, shapes=cross_shapes,
      feed=mpmd_feed.share(pl, micro_train, skip=(DROPOUT_KEY,)),
      reads_dropout_key=any(key_leaf in part.batch_leaves for part in pl.parts),
      _init=steps.partition(lambda: train_state.create(st.canonical_model, st.tx,
                                                       jax.random.key(tp.seed), st.init_batch),
                            mesh, (), csplit),
      _finish=steps.partition(finish, last_mesh, (P(), P(), P(), P(), P()), P()),
      _sum=steps.partition(_sum_metrics, last_mesh, (P(),), P()),
      _to_canonical=steps.partition(to_canonical, mesh, (lsplit,), csplit),
      _from_canonical=steps.partition(from_canonical, mesh, (csplit,), lsplit))
