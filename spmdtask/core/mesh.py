"""Mesh params -> a jax Mesh with Auto axes (ICI x DCN, hybrid, -1 fill)."""
import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from spmdtask.core import sharding
from spmdtask.errors import ConfigError


def resolve_shapes(axis_names: Sequence[str], ici_mesh_shape: Sequence[int],
                   dcn_mesh_shape: Sequence[int] | None,
                   num_devices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Validates the mesh params and fills a -1 in `ici_mesh_shape`.

  Pure: no devices needed. Returns (ici_shape, dcn_shape) whose element-wise
  product has `num_devices` devices.
  """
  names = tuple(axis_names)
  ici = tuple(int(x) for x in ici_mesh_shape)
  dcn = tuple(int(x) for x in dcn_mesh_shape) if dcn_mesh_shape is not None else (1,) * len(ici)
  if len(set(names)) != len(names):
    raise ConfigError(f"task.mesh_axis_names={names} repeats an axis name; give each axis a "
                      "unique name.")
  if len(ici) != len(names) or len(dcn) != len(names):
    raise ConfigError(
        f"task.ici_mesh_shape={ici} and task.dcn_mesh_shape={dcn} must each have one entry per "
        f"axis in task.mesh_axis_names={names} ({len(names)} axes). Fix the lengths.")
  if any(d < 1 for d in dcn):
    raise ConfigError(f"task.dcn_mesh_shape={dcn} must be positive integers.")
  if ici.count(-1) > 1 or any(x == 0 or x < -1 for x in ici):
    raise ConfigError(f"task.ici_mesh_shape={ici} must be positive integers with at most one -1 "
                      "(the -1 fills the remaining devices).")
  if -1 in ici:
    rest = math.prod(x for x in ici if x != -1) * math.prod(dcn)
    if num_devices % rest:
      raise ConfigError(
          f"task.ici_mesh_shape={ici} x task.dcn_mesh_shape={dcn}: the fixed axes use {rest} "
          f"devices, which does not divide the {num_devices} devices available, so the -1 "
          "cannot be filled. Change the fixed axis sizes.")
    ici = tuple(num_devices // rest if x == -1 else x for x in ici)
  total = math.prod(ici) * math.prod(dcn)
  if total != num_devices:
    raise ConfigError(
        f"The mesh task.ici_mesh_shape={ici} x task.dcn_mesh_shape={dcn} over axes {names} has "
        f"{total} devices, but {num_devices} are available. Make the product of the shapes equal "
        f"{num_devices}, or put -1 in one ici_mesh_shape entry to fill the remaining devices.")
  return ici, dcn


def create_mesh(axis_names: Sequence[str], ici_mesh_shape: Sequence[int],
                dcn_mesh_shape: Sequence[int] | None = None,
                devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the device mesh, with Auto (pjit/GSPMD) axis types.

  With a DCN product > 1 the mesh is hybrid: DCN axes span slices (or, where
  devices have no slice index, processes) and ICI axes stay within one.
  """
  devices = list(devices if devices is not None else jax.devices())
  ici, dcn = resolve_shapes(axis_names, ici_mesh_shape, dcn_mesh_shape, len(devices))
  device_array = device_array_for(ici, dcn, devices)
  return Mesh(device_array, tuple(axis_names), axis_types=(AxisType.Auto,) * len(ici))


def device_array_for(ici: tuple[int, ...], dcn: tuple[int, ...],
                     devices: Sequence[jax.Device]) -> np.ndarray:
  """Devices laid out as ici x dcn: DCN axes across slices (or groups of consecutive
  processes, where devices have no slices), ICI within one."""
  if math.prod(dcn) == 1:
    return _ici_mesh(ici, devices)
  n = math.prod(dcn)
  slices = {getattr(d, "slice_index", 0) for d in devices}
  if len(slices) > 1:  # slices joined by DCN (TPU)
    if len(slices) != n:
      raise _granule_error(dcn, len(slices), "slices")
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=False,
                                                allow_split_physical_axes=True)
  # No slices (CPU, GPU hosts): groups of consecutive processes stand in for them, e.g. the
  # 2 processes of each slice that tools/launch_local.py --slices runs.
  processes = sorted({d.process_index for d in devices})
  if len(processes) % n:
    raise _granule_error(dcn, len(processes), "processes")
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  per = len(ordered) // n
  granules = np.empty(n, dtype=object)
  for g in range(n):
    granules[g] = _ici_mesh(ici, ordered[g * per:(g + 1) * per])
  return np.block(granules.reshape(dcn).tolist())


def _ici_mesh(ici: tuple[int, ...], devices) -> np.ndarray:
  try:
    return mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
  except (ValueError, NotImplementedError, AssertionError):
    return np.asarray(devices).reshape(ici)


def _granule_error(dcn: tuple[int, ...], found: int, unit: str) -> ConfigError:
  fix = (f"to {found}" if unit == "slices" else
         f"to a divisor of {found} (each slice then a group of as many consecutive processes)")
  return ConfigError(
      f"task.dcn_mesh_shape={dcn} spans {math.prod(dcn)} slices, but the devices come from "
      f"{found} {unit}. Set dcn_mesh_shape's product {fix}, or set it to 1s and put the whole "
      "mesh in task.ici_mesh_shape.")


def mesh_shape(mesh: Mesh) -> dict[str, int]:
  """Axis name -> size: the only thing the partitioner's pure functions need."""
  return dict(mesh.shape)


def constrain(x: jax.Array, spec) -> jax.Array:
  """`x` pinned to `spec` (one split-dims entry per dim) over the context mesh's automatic
  axes: inside a shard_map the manual ones are split by hand, so they are left out (nothing
  to pin where all are); a no-op outside a mesh context (e.g. eagerly in a unit test)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  manual = set(mesh.manual_axes)
  if manual >= set(mesh.axis_names):
    return x
  if manual:
    spec = [tuple(a for a in sharding.entry_axes(e) if a not in manual) or None for e in spec]
  return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def spread(x: jax.Array) -> NamedSharding | None:
  """x's layout cut over every device of its mesh (`sharding.spread`), for a reduction over
  x (a fingerprint, a finite check) that would otherwise run whole on each device holding a
  replica; None where x is not laid out on a mesh."""
  if not isinstance(x.sharding, NamedSharding):
    return None
  mesh = x.sharding.mesh
  return NamedSharding(mesh, sharding.spread(x.sharding.spec, x.shape, mesh_shape(mesh)))
