"""The MPMD stage plan's pure pieces: layer groups from cuts, the schedule, the microbatch
size and the stage submeshes (no tracing, no device work; `mpmd_config.MpmdConfig` is the
strategy that uses them, `mpmd_program` the program).
"""
import math
from typing import Sequence

import jax
from jax.sharding import Mesh

from spmdtask.core import mesh as mesh_lib
from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import generators, files
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
  "auto", which must be resolved first: `auto_cuts.resolve`)."""
  if is_auto(layer_cuts):
    raise ValueError(f"{_PL}layer_cuts={AUTO!r} must be resolved (auto_cuts.resolve) first.")
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


def check_batch(config, global_batch_size: int) -> int:
  """The microbatch size; ConfigError naming num_microbatches when M does not divide."""
  m = config.num_microbatches
  if not isinstance(m, int) or m < 1 or global_batch_size % m:
    raise ConfigError(f"{_PL}num_microbatches={m!r} does not divide the global batch of "
                      f"{global_batch_size}: use a divisor of {global_batch_size}.")
  return global_batch_size // m


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
