"""Elastic slices, the job's half: a run on fewer slices than its task.dcn_mesh_shape spans.

A launcher that lost a slice restarts the job on the slices left with `--live_slices=L`
(`elastic_launch` decides when); `shrink` then fits the built config to L of the S slices
the config spans, before the program is set up:
- the mesh: the DCN size of the first batch axis (`task.data_axes`) that holds the slices
  falls by S/L (e.g. dcn data 2 -> 1); the ICI shape is unchanged, each slice's devices too;
- the batch, as `task.train.elastic_batch` says: 'global' (the default) keeps the global
  batch through S/L times the gradient-accumulation microbatches (each device's rows per
  microbatch stay as on S slices), so every step reads the same global rows and the losses
  are those of the S-slice run; 'per_slice' keeps each slice's rows and microbatches, the
  global batch shrinking to L/S of it (other losses: each step reads fewer rows).
The state is restored resharded onto the smaller mesh by `checkpoints` (canonical arrays),
the input's position with it. Nothing here needs JAX's devices: `num_devices` only fills the
mesh named in the console line and checks the batch split before the program does.
"""
import dataclasses
import math

from absl import flags

from spmdtask.errors import ConfigError

LIVE_SLICES = flags.DEFINE_integer(
    "live_slices", None, "Run on this many of the slices task.dcn_mesh_shape spans (an "
    "elastic restart after a slice was lost: tools/launch_local.py --slices sets it): the "
    "DCN batch axis shrinks and task.train.elastic_batch keeps the global batch (more "
    "microbatches) or the per-slice batch. Default: all of them.")
BATCH_MODES = ("global", "per_slice")
# In the job's checkpoint dir while a launcher stops a shrunk job to grow it back
# (`elastic_launch`): the stop's save then goes to the job dir, not the local tier, whose
# shards the grown job's new processes do not have (`checkpoints.Checkpointer.save`).
GROW_STOP_FILE = "stop_to_grow_back"
FIELD = "task.train.elastic_batch"


def num_slices(task) -> int:
  """The slices `task`'s mesh spans: the product of task.dcn_mesh_shape."""
  return math.prod(task.dcn_mesh_shape or (1,))


def asked(run, planning: bool = False):
  """`shrink` as --live_slices asks (`run` as it is without the flag). `planning`: a
  --mode=plan, whose devices are the plan's target, not this process's (no mesh in the line;
  the plan checks the split)."""
  if LIVE_SLICES.value is None:
    return run, None
  import jax  # pylint: disable=g-import-not-at-top
  return shrink(run, LIVE_SLICES.value, None if planning else jax.device_count())


def shrink(run, live: int, num_devices: int | None = None):
  """(`run` fitted to `live` of its task's slices, the console line saying so); (`run`,
  None) when `live` is all of them. ConfigError (naming --live_slices or the field) where
  the mesh or the batch cannot shrink to `live` slices."""
  task = run.task
  total = num_slices(task)
  if isinstance(live, bool) or not isinstance(live, int) or not 1 <= live <= total:
    raise ConfigError(
        f"--live_slices={live!r}, but task.dcn_mesh_shape={task.dcn_mesh_shape} spans {total} "
        f"slice(s): give a count from 1 to {total} (the slices still running), or omit it "
        "to run on all of them.")
  if live == total:
    return run, None
  names = tuple(task.mesh_axis_names)
  dcn = list(task.dcn_mesh_shape)
  axis = next((i for i, a in enumerate(names)
               if a in task.batch_axes() and dcn[i] * live % total == 0), None)
  if axis is None:
    raise ConfigError(
        f"--live_slices={live}: task.dcn_mesh_shape={tuple(dcn)} has no batch axis "
        f"(task.data_axes={tuple(task.data_axes)}) whose slices shrink to {live} of {total} "
        "(its DCN size times live/total must be whole): a job runs on fewer slices only "
        "along a data axis across slices, e.g. task.dcn_mesh_shape=(2, 1, 1) over ('data', "
        "...). Restart on a slice count that divides it, or on all slices.")
  dcn[axis] = dcn[axis] * live // total
  tp, mode = task.train, task.train.elastic_batch
  batch = _batch_size(run)
  if mode == "global":
    micro = tp.num_microbatches * total
    if micro % live:
      raise ConfigError(
          f"--live_slices={live} with {FIELD}='global': the global batch ({batch} rows in "
          f"task.train.num_microbatches={tp.num_microbatches}) on {live} of {total} slices "
          f"needs {tp.num_microbatches} x {total}/{live} microbatches, not a whole number. "
          f"Make num_microbatches a multiple of {live // math.gcd(live, total)}, restart on "
          f"a slice count that divides {total}, or set {FIELD}='per_slice'.")
    micro //= live
    tp = dataclasses.replace(tp, num_microbatches=micro)
    datasets = run.datasets
  else:
    micro = tp.num_microbatches
    if batch * live % total:
      raise ConfigError(
          f"--live_slices={live} with {FIELD}='per_slice': datasets['train'].batch_size="
          f"{batch} does not split into {total} slices' equal shares. Make it a multiple of "
          f"{total}, or set {FIELD}='global'.")
    batch = batch * live // total
    datasets = {**run.datasets, "train": dataclasses.replace(run.datasets["train"],
                                                             batch_size=batch)}
  task = dataclasses.replace(task, dcn_mesh_shape=tuple(dcn), train=tp)
  mesh = _mesh(task, num_devices, batch, micro, live, total)
  line = (f"Elastic restart on {live} of {total} slices (--live_slices={live}): "
          f"task.dcn_mesh_shape {tuple(run.task.dcn_mesh_shape)} -> {tuple(dcn)}{mesh}, "
          f"{micro} microbatch{'es' if micro > 1 else ''} of {batch // micro} rows: the "
          f"{'global' if mode == 'global' else 'per-slice'} batch kept ({FIELD}={mode!r}; "
          f"global batch {batch}).")
  return dataclasses.replace(run, task=task, datasets=datasets), line


def _batch_size(run) -> int:
  train = run.datasets.get("train")
  if not dataclasses.is_dataclass(train) or not isinstance(getattr(train, "batch_size", None),
                                                           int):
    raise ConfigError(
        f"--live_slices: datasets['train'] is a {type(train).__name__} without an integer "
        "`batch_size` field (the global batch), so the batch cannot follow the slices: make "
        "the train input a dataclass with one, like spmdtask.inputs.synthetic.SyntheticLmInput.")
  return train.batch_size


def _mesh(task, num_devices: int | None, batch: int, micro: int, live: int,
          total: int) -> str:
  """', mesh data 4 x ... on N devices' (empty without `num_devices`); ConfigError where the
  rows of a microbatch do not divide over the shrunk mesh's batch axes."""
  if num_devices is None:
    return ""
  from spmdtask.core import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  ici, dcn = mesh_lib.resolve_shapes(task.mesh_axis_names, task.ici_mesh_shape,
                                     task.dcn_mesh_shape, num_devices)
  sizes = dict(zip(task.mesh_axis_names, (i * d for i, d in zip(ici, dcn))))
  shards = math.prod(sizes[a] for a in task.batch_axes())
  if batch % (micro * shards):
    raise ConfigError(
        f"--live_slices={live} of {total}: the global batch of {batch} rows in {micro} "
        f"microbatches does not divide over the shrunk mesh's {shards} batch shards "
        f"({' x '.join(f'{a} {sizes[a]}' for a in task.batch_axes())}). Make "
        f"datasets['train'].batch_size a multiple of {micro * shards} (then it divides on "
        f"{total} slices as well), or change {FIELD} or task.train.num_microbatches.")
  return (", mesh " + " x ".join(f"{a} {n}" for a, n in sizes.items())
          + f" on {num_devices} devices")
