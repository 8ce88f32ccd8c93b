"""Mesh params -> Mesh: -1 fill, hybrid ICI x DCN, validation."""
import jax
import pytest
from jax.sharding import AxisType

from spmdtask.core import mesh
from spmdtask.errors import ConfigError

NAMES = ("data", "fsdp", "model")


def test_fill_and_auto_axes():
  m = mesh.create_mesh(NAMES, (-1, 2, 2))
  assert dict(m.shape) == {"data": 2, "fsdp": 2, "model": 2}
  assert m.axis_types == (AxisType.Auto,) * 3
  assert sorted(d.id for d in m.devices.flat) == list(range(8))


def test_resolve_shapes_is_pure():
  assert mesh.resolve_shapes(NAMES, (1, -1, 2), (2, 1, 1), 16) == ((1, 4, 2), (2, 1, 1))


def test_hybrid_mesh_over_processes_needs_matching_granules():
  # One process here: a DCN product of 2 cannot be laid over it.
  with pytest.raises(ConfigError, match=r"task.dcn_mesh_shape=.* spans 2 slices, but the "
                     r"devices come from 1 processes\. Set dcn_mesh_shape's product to a "
                     r"divisor of 1"):
    mesh.create_mesh(NAMES, (2, 2, 1), (2, 1, 1))


def test_hybrid_mesh_uses_the_granule_for_dcn_axes():
  class Fake:  # two slices of four devices each
    def __init__(self, i):
      self.id, self.slice_index, self.process_index = i, i // 4, 0
      self.platform, self.device_kind = "cpu", "cpu"
    def __repr__(self):
      return f"D{self.id}"
  devices = [Fake(i) for i in range(8)]
  arr = mesh.device_array_for((1, 2, 2), (2, 1, 1), devices)
  assert arr.shape == (2, 2, 2)
  # data (the DCN axis) splits the slices; fsdp x model stay within one slice.
  assert {d.slice_index for d in arr[0].flat} == {0} and {d.slice_index for d in arr[1].flat} == {1}


def test_without_slices_groups_of_consecutive_processes_are_the_dcn_granules():
  class Fake:  # 4 processes of 2 devices, no slices (CPU): 2 slices of 2 processes each
    def __init__(self, i):
      self.id, self.process_index, self.slice_index = i, i // 2, 0
      self.platform, self.device_kind = "cpu", "cpu"
  devices = [Fake(i) for i in reversed(range(8))]
  arr = mesh.device_array_for((4, 1, 1), (2, 1, 1), devices)
  assert arr.shape == (8, 1, 1)
  assert [d.process_index for d in arr.flat] == [0, 0, 1, 1, 2, 2, 3, 3]
  with pytest.raises(ConfigError, match=r"spans 3 slices, but the devices come from 4 processes"):
    mesh.device_array_for((2, 1, 1), (3, 1, 1), devices)


@pytest.mark.parametrize("ici,dcn,needle", [
    ((2, 2, 4), None, "16 devices, but 8 are available"),
    ((2, 2), None, "one entry per axis"),
    ((-1, -1, 2), None, "at most one -1"),
    ((3, -1, 1), None, "does not divide the 8 devices"),
])
def test_bad_mesh_params_name_the_field(ici, dcn, needle):
  with pytest.raises(ConfigError, match=needle) as e:
    mesh.create_mesh(NAMES, ici, dcn, jax.devices())
  assert "task.ici_mesh_shape" in str(e.value)
