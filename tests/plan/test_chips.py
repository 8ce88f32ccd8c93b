"""The device-kind -> chip lookup, and the peak an MFU is measured against."""
import pytest

from spmdtask.plan import chips

GIB = 2**30


@pytest.mark.parametrize("device_kind, name, peak, hbm_gib", [
    ("NVIDIA H100 80GB HBM3", "h100", 989e12, 80),
    ("NVIDIA H200", "h200", 989e12, 141),
    ("NVIDIA A100-SXM4-80GB", "a100", 312e12, 80),
    ("NVIDIA A100-SXM4-40GB", "a100-40", 312e12, 40),
    ("TPU v4", "v4", 275e12, 32),
    ("TPU v5 lite", "v5e", 197e12, 16),
    ("TPU v5e", "v5e", 197e12, 16),
    ("TPU v5", "v5p", 459e12, 95),
    ("TPU v5p", "v5p", 459e12, 95),
    ("TPU v6 lite", "v6e", 918e12, 32),
    ("TPU v6e", "v6e", 918e12, 32),
])
def test_by_device_kind(device_kind, name, peak, hbm_gib):
  chip = chips.by_device_kind(device_kind)
  assert (chip.name, chip.peak_bf16_flops_per_s, chip.hbm_bytes) == (name, peak, hbm_gib * GIB)
  assert chips.mfu_peak(device_kind, None) == chips.Peak(peak, f"{name} bf16 dense")


def test_unknown_devices_and_the_override():
  assert chips.by_device_kind("cpu") is None and chips.by_device_kind("NVIDIA H100 PCIe") is None
  cpu = chips.mfu_peak("cpu", None)
  assert cpu.flops_per_s == chips.DEFAULT_PEAK_FLOPS == 1.3e11
  assert cpu.describe().startswith("130 GFLOP/s (cpu: no chip facts")
  assert "task.train.peak_flops_per_device" in cpu.describe()
  # The override wins over the chip's own figure.
  assert chips.mfu_peak("NVIDIA H100 80GB HBM3", 5e14) == chips.Peak(
      5e14, "task.train.peak_flops_per_device")
  assert chips.mfu_peak("NVIDIA H100 80GB HBM3", None).describe() == "989 TFLOP/s (h100 bf16 dense)"
  assert chips.Peak(1.2e15, "x").figure() == "1.2 PFLOP/s"


def test_every_device_kind_names_one_chip():
  kinds = [k for c in (*chips.CHIPS.values(), *chips.GPUS.values())
           for k in (c.device_kind, *c.other_device_kinds)]
  assert len(kinds) == len(set(kinds))


def test_only_the_h100_has_xla_s_device_description():
  """What --plan_topology=h100:8 compiles from (a plan for another GPU model is refused)."""
  described = {n: c.gpu_target_config for n, c in chips.GPUS.items() if c.gpu_target_config}
  assert list(described) == ["h100"] and chips.GPUS["h100"].host_link_bytes_per_s is None
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in described["h100"]
