"""The MPMD stage plan: every decision of a program, made once (`plan` -> `StagePlan`).

`plan(task, config, shapes, devices)` makes the stage submeshes and the full mesh, checks
the batch split into microbatches and the model on every submesh, checks the cuts (or
that "auto" can cut the stack) and makes the schedule, then resolves `layer_cuts="auto"`
(`auto_cuts`: compiled per-layer costs, balanced); the frozen `StagePlan` holds the
result, and everything after it (models, the Pipeline, the step, the report, the
program) reads it. Its pieces are pure (no tracing, no device work; only "auto"
compiles its probes): layer groups from cuts, the schedule, the microbatch size, the
submeshes. `config.MpmdConfig` is the strategy that uses them, `program` the program.
"""
import dataclasses
import math
from typing import Any, Sequence

import jax
from jax.sharding import Mesh

from spmdtask.core import layouts, mesh as mesh_lib, sharding, train_state
from spmdtask.errors import BatchSplitError, ConfigError
from spmdtask.pipeline.mpmd import auto_cuts
from spmdtask.pipeline.schedules import generators, files, simulate
from spmdtask.pipeline.schedules.schedule import Schedule, validate

_PL = "task.pipeline."
AUTO = "auto"  # layer_cuts chosen from compiled per-layer costs (pipeline.auto_cuts)


def is_auto(layer_cuts) -> bool:
  """True for `layer_cuts="auto"`; ConfigError for any other string."""
  if isinstance(layer_cuts, str):
    if layer_cuts != AUTO:
      raise ConfigError(f"{_PL}layer_cuts={layer_cuts!r}: the only string accepted is "
                        f"{AUTO!r} (cuts balanced from compiled per-layer costs); otherwise "
                        "give strictly increasing layer indices, e.g. (2,).")
    return True
  return False


def num_parts(config) -> int:
  """The parts the cuts make: stages x chunks for "auto" (resolved to that many)."""
  if is_auto(config.layer_cuts):
    return config.num_stages * config.num_chunks
  return len(check_cuts(config.layer_cuts)) + 1


def check_cuts(layer_cuts: Sequence[int]) -> tuple[int, ...]:
  """The cuts as a tuple; ConfigError unless they are strictly increasing ints (or
  "auto", which must be resolved first: `plan`)."""
  if is_auto(layer_cuts):
    raise ValueError(f"{_PL}layer_cuts={AUTO!r} must be resolved (stages.plan) first.")
  cuts = tuple(layer_cuts)
  if any(not isinstance(c, int) for c in cuts) or list(cuts) != sorted(set(cuts)):
    raise ConfigError(f"{_PL}layer_cuts={cuts!r} must be strictly increasing layer indices "
                      "(each the first layer of a new part), e.g. (2,) for layers 0-1 | 2-...")
  return cuts


def layer_groups(layer_cuts: Sequence[int], num_layers: int) -> tuple[tuple[int, int], ...]:
  """[start, end) of each part's layers. Raises ConfigError for a bad cut."""
  cuts = check_cuts(layer_cuts)
  if cuts and (cuts[0] < 1 or cuts[-1] > num_layers - 1):
    raise ConfigError(f"{_PL}layer_cuts={cuts!r} cuts beyond the last layer: a cut must be "
                      f"between 1 and task.model.num_layers - 1 = {num_layers - 1} (every part "
                      "needs at least one layer); remove or move the cuts.")
  bounds = (0,) + cuts + (num_layers,)
  return tuple(zip(bounds[:-1], bounds[1:]))


def make_schedule(config) -> Schedule:
  """The schedule data: a generator's, or the file `config.schedule` names (text form or a
  torch compute_only .csv), validated; ConfigError when it does not fit the stages and parts."""
  parts = num_parts(config)
  s, v = config.num_stages, config.num_chunks
  if parts != s * v:
    raise ConfigError(
        f"{_PL}layer_cuts={tuple(config.layer_cuts)} make {parts} parts, but the schedule runs "
        f"{s} stages ({_PL}submesh_shapes) x {v} chunks ({_PL}num_chunks) = {s * v} parts. "
        f"Give {s * v - 1} cuts, or change the stages or chunks.")
  if config.schedule == "interleaved_1f1b" and v < 2:
    raise ConfigError(
        f"{_PL}schedule='interleaved_1f1b' with {_PL}num_chunks={v} would run un-interleaved "
        f"(plain 1F1B): set {_PL}num_chunks >= 2 (with stages x chunks - 1 layer_cuts), or "
        f"{_PL}schedule='1f1b'.")
  if config.schedule not in generators.GENERATORS and _looks_like_path(config.schedule):
    return _schedule_file(config)
  try:
    return generators.generate(config.schedule, s, config.num_microbatches, v)
  except ConfigError as e:
    raise ConfigError(f"{_PL}schedule={config.schedule!r} does not fit: {e} Or give the path "
                      "of a schedule file (spmdtask text form, or a torch compute_only .csv)."
                      ) from None


def _looks_like_path(name) -> bool:
  return isinstance(name, str) and ("/" in name or "." in name)


def _schedule_file(config) -> Schedule:
  source = f"{_PL}schedule={config.schedule!r}"
  sched = files.load(config.schedule, source)
  want = {"stages": (sched.num_stages, config.num_stages, f"{_PL}submesh_shapes"),
          "chunks per stage": (sched.num_chunks, config.num_chunks, f"{_PL}num_chunks"),
          "microbatches": (sched.num_microbatches, config.num_microbatches,
                           f"{_PL}num_microbatches")}
  for what, (got, need, field) in want.items():
    if got != need:
      raise ConfigError(f"{source}: the file's schedule has {got} {what} but {field} gives "
                        f"{need}; make them agree (a CSV's ranks are its rows, its chunks "
                        "the stages per rank, its microbatches 1 + the largest index).")
  validate(sched, source)
  return sched


def submeshes(config, axis_names: Sequence[str],
              devices: Sequence[jax.Device]) -> tuple[Mesh, ...]:
  """One Auto-axes mesh per stage over consecutive, disjoint runs of `devices`."""
  shapes = tuple(tuple(s) for s in config.submesh_shapes)
  if not shapes:
    raise ConfigError(f"{_PL}submesh_shapes is empty: give one mesh shape per stage.")
  for s, shape in enumerate(shapes):
    if len(shape) != len(axis_names) or any(not isinstance(x, int) or x < 1 for x in shape):
      raise ConfigError(f"{_PL}submesh_shapes[{s}]={shape} must have one positive size per "
                        f"axis of task.mesh_axis_names={tuple(axis_names)}.")
  sizes = [math.prod(s) for s in shapes]
  if sum(sizes) != len(devices):
    raise ConfigError(
        f"{_PL}submesh_shapes={shapes} use {sum(sizes)} devices ({' + '.join(map(str, sizes))}) "
        f"but the job has {len(devices)}: stage submeshes take consecutive devices and must "
        f"cover every device exactly once. Make the sizes add up to {len(devices)}.")
  out, start = [], 0
  for shape, n in zip(shapes, sizes):
    out.append(mesh_lib.create_mesh(axis_names, shape, None, list(devices)[start:start + n]))
    start += n
  return tuple(out)


def summary(config, schedule: Schedule) -> str:
  """The strategy's console line (`MpmdConfig.summary`) for `config` run by `schedule`."""
  sim = simulate.simulate(schedule)
  return (f"strategy MPMD pipeline: {config.num_stages} stages, schedule {config.schedule!r} "
          f"({config.num_microbatches} pipeline microbatches, {config.num_chunks} chunk(s) per "
          f"stage), simulated bubble {float(sim.bubble_fraction):.1%} (equal F/B/W costs)")


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """Every decision of one MPMD program (`plan`); read-only after it."""
  config: Any  # the MpmdConfig, its layer_cuts resolved ("auto" -> the chosen cuts)
  auto: bool  # the cuts were chosen by layer_cuts="auto"
  groups: tuple[tuple[int, int], ...]  # [start, end) of each part's layers
  schedule: Schedule
  part_stage: tuple[int, ...]  # the stage that runs each part
  batch_rows: int  # rows of the global batch
  microbatch_size: int
  micro: Any  # one microbatch: ShapeDtypeStructs of the batch's leaves
  batch_split: Any  # the batch's split dims on the full mesh
  meshes: tuple[Mesh, ...]  # one submesh per stage
  mesh: Mesh  # every device: the canonical layouts' mesh
  cut_costs: Any = None  # auto_cuts.LazyCosts: the stages' compiled costs (measured once)

  # What follows from the fields above, never stored twice.
  @property
  def layer_cuts(self) -> tuple[int, ...]:
    return tuple(self.config.layer_cuts)

  @property
  def num_layers(self) -> int:
    return self.groups[-1][1]

  @property
  def num_stages(self) -> int:
    return len(self.meshes)

  @property
  def num_microbatches(self) -> int:  # M: microbatches a step (the schedule's)
    return self.schedule.num_microbatches

  def summary(self) -> str:
    return summary(self.config, self.schedule)


def _batch_split(task, config, micro, meshes: Sequence[Mesh]):
  """The batch's split dims (task.train.inputs_split_mapping), checked for one microbatch on
  every stage's submesh, where the batch is split."""
  for s, m in enumerate(meshes):
    try:
      split = sharding.input_split_dims(micro, task.train.inputs_split_mapping,
                                        task.batch_axes(), mesh_lib.mesh_shape(m))
    except BatchSplitError as e:  # a mapping's own axes: not the train batch's size as such
      raise ConfigError(f"On stage {s} ({_PL}submesh_shapes[{s}]="
                        f"{tuple(config.submesh_shapes[s])}), a microbatch of "
                        f"{_PL}num_microbatches={config.num_microbatches}: {e}") from None
  return split


def plan(task, config, shapes, devices: Sequence[jax.Device]) -> StagePlan:
  """The stage plan of `task` under the MpmdConfig `config` for a global batch of `shapes`
  (module doc); ConfigError naming the field on a bad config."""
  meshes = submeshes(config, task.mesh_axis_names, devices)
  mesh = mesh_lib.create_mesh(task.mesh_axis_names, task.ici_mesh_shape, task.dcn_mesh_shape,
                              devices)
  _, model = layouts.strategy_models(task, config)  # the canonical model: the stack's facts
  rows = jax.tree.leaves(shapes)[0].shape[0]
  if train_state.base_storage(task.model) is not None:
    raise ConfigError(
        "task.model.lora.base_quantization with task.pipeline (MPMD): the per-stage programs "
        "differentiate every param, and a QLoRA base's packed codes are integers. Run QLoRA "
        "without MPMD (task.pipeline=None: FSDP and tensor axes over the slice), or set "
        "task.model.lora.base_quantization=None.")
  if task.train.num_microbatches != 1:
    raise ConfigError(f"task.train.num_microbatches={task.train.num_microbatches} with an MPMD "
                      "pipeline: the pipeline splits the batch itself; set "
                      "task.pipeline.num_microbatches and task.train.num_microbatches=1.")
  # Each stage splits a microbatch's rows over its own data axes (the all-device mesh only
  # holds checkpoints), so the batch must split there.
  mb_size = layouts.check_batch_split(
      rows, config.num_microbatches, f"{_PL}num_microbatches", task.batch_axes(),
      [(f"{_PL}submesh_shapes[{s}]={tuple(config.submesh_shapes[s])}", mesh_lib.mesh_shape(m))
       for s, m in enumerate(meshes)])
  for m in meshes:
    model.validate(m, mb_size)
  auto = is_auto(config.layer_cuts)
  if auto:  # the strategy's own checks (`MpmdConfig.validate`), once
    auto_cuts.check(config, model.num_layers)
  else:
    groups = layer_groups(config.layer_cuts, model.num_layers)
  schedule = make_schedule(config)
  micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((mb_size,) + x.shape[1:], x.dtype), shapes)
  batch_split = _batch_split(task, config, micro, meshes)
  part_stage = tuple(schedule.owner(v)[0] for v in range(num_parts(config)))
  cuts, costs = auto_cuts.resolve(task, model, config, meshes, micro, batch_split, part_stage,
                                  auto)  # "auto": the balanced cuts, measured now
  if auto:
    config = dataclasses.replace(config, layer_cuts=cuts)
    groups = layer_groups(cuts, model.num_layers)
  return StagePlan(
      config=config, auto=auto, groups=groups, schedule=schedule, part_stage=part_stage,
      batch_rows=rows, microbatch_size=mb_size, micro=micro, batch_split=batch_split,
      meshes=meshes, mesh=mesh, cut_costs=costs)
