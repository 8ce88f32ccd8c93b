"""What a plan compiles for: the devices present (or N emulated CPU devices), or a TPU
topology that libtpu compiles for ahead of time on this CPU-only machine.

`tpu(topology, num_slices)` asks libtpu for compile-only devices of e.g. 'v5e:16x16'
(`jax.experimental.topologies.get_topology_desc`); with `num_slices` > 1 they come as
that many slices joined by DCN (each device has a `slice_index`). Nothing runs on them:
`jit(...).lower(...).compile()` gives XLA:TPU's program, its memory and cost analyses.
JAX itself stays on the CPU platform (JAX_PLATFORMS=cpu works: the topology API loads
libtpu as a plugin without creating a TPU client). What libtpu prints while loading
(worker hostnames, accelerator type) is captured for job_log_dir/logs, never the console.
"""
import dataclasses
import importlib
import math
import os
import re

import jax

from spmdtask.plan import chips
from spmdtask import console
from spmdtask.errors import ConfigError

PIP_TPU = ("pip install 'spmdtask[tpu]'  (or: pip install 'jax[tpu]>=0.10.2,<0.11', which "
           "brings libtpu)")
PIP_GPU = ("pip install 'spmdtask[gpu_plan]'  (or: pip install 'jax-cuda12-plugin>=0.10.2,<0.11' "
           "'nvidia-cudnn-cu12>=9.8,<10': XLA:GPU and cuDNN, enough to compile)")
_TOPOLOGY = re.compile(r"^(v[0-9][a-z]*):([0-9]+(?:x[0-9]+)*)$")
_GPU_TOPOLOGY = re.compile(r"^([a-z][a-z0-9]*):(?:([0-9]+)x)?([0-9]+)$")


@dataclasses.dataclass(frozen=True)
class Target:
  """The devices a plan is compiled for, and what is known of their chip."""
  platform: str                   # 'cpu', 'tpu', 'gpu'
  devices: tuple                  # jax Devices (compile-only ones for a topology)
  topology: str | None = None     # e.g. 'v5e:16x16'
  num_slices: int = 1
  chip: chips.Chip | None = None  # the chip facts (TPU), else None
  log: str = ""                   # what the plugin printed while loading

  def as_json(self) -> dict:
    return {"platform": self.platform, "topology": self.topology,
            "num_slices": self.num_slices, "chips": len(self.devices),
            "device_kind": self.devices[0].device_kind,
            "chip": None if self.chip is None else self.chip.as_json()}

  def hosts_of(self, devices) -> tuple[int, ...] | None:
    """GPUs: the host of each of `devices` (a program's device assignment, in order), for
    its collectives across hosts; None elsewhere (a TPU slice's chips all share ICI)."""
    return tuple(d.process_index for d in devices) if self.platform == "gpu" else None

  def describe(self) -> str:
    if self.topology is None:
      return f"{len(self.devices)} {self.platform} devices"
    slices = f" x {self.num_slices} slices over DCN" if self.num_slices > 1 else ""
    return f"{self.topology}{slices} ({len(self.devices)} {self.devices[0].device_kind} chips)"


def topology(name: str, num_slices: int = 1) -> Target:
  """A TPU topology ('v5e:16x16') or a GPU one ('h100:8', 'h100:4x8' = 4 hosts of 8)."""
  gpu_name = name.split(":", 1)[0]
  return gpu(name) if gpu_name in chips.GPUS else tpu(name, num_slices)


def present() -> Target:
  """The devices this process sees (with --plan_devices: the emulated CPU devices)."""
  devices = tuple(jax.devices())
  return Target(devices[0].platform, devices, chip=chips.by_device_kind(devices[0].device_kind))


def tpu(topology: str, num_slices: int = 1) -> Target:
  """Compile-only TPU devices of `topology` (libtpu's name, e.g. 'v5e:16x16', 'v5p:4x4x4').

  Raises ConfigError naming --plan_topology / --plan_slices for a name libtpu refuses,
  and with the pip line when libtpu is not installed.
  """
  m = _TOPOLOGY.match(topology)
  if not m:
    raise ConfigError(
        f"--plan_topology={topology!r} is not a TPU topology name: give a generation and "
        "its chip grid, e.g. v5e:16x16, v6e:8x8, v4:4x4x4 or v5p:4x4x8 (known generations: "
        f"{', '.join(chips.CHIPS)}).")
  if num_slices < 1:
    raise ConfigError(f"--plan_slices={num_slices} must be at least 1.")
  try:
    importlib.import_module("libtpu")
  except ImportError:
    raise ConfigError(
        f"--plan_topology={topology} compiles with XLA:TPU, which comes with libtpu, and "
        f"libtpu is not installed. Install it: {PIP_TPU}") from None
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # Cloud TPU runs v4 / v5p as one device per chip (megacore); libtpu's default for
  # v4 is one device per TensorCore.
  options = {"chip_config_name": "megacore"} if m.group(1) in ("v4", "v5p") else {}
  if num_slices > 1:
    options["num_slices"] = num_slices
  grid = [int(n) for n in m.group(2).split("x")]
  if len(grid) == 2 and grid[0] * grid[1] < 4:  # a single-host slice below a 2x2 host (v5e:1x1)
    options["chips_per_host_bounds"] = (grid[0], grid[1], 1)
  # libtpu takes /tmp/libtpu_lockfile, for a TPU host's chips; compiling for a topology
  # claims no chip, so plans in parallel processes (pytest -n, two users) are fine.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  log: list[str] = []
  try:
    with console.captured_fd2(log):
      devices = tuple(topologies.get_topology_desc(
          platform="tpu", topology_name=topology, **options).devices)
  except Exception as e:  # libtpu raises JaxRuntimeError (INVALID_ARGUMENT) for a bad name
    raise ConfigError(
        f"--plan_topology={topology} --plan_slices={num_slices}: libtpu refused it: "
        f"{str(e).splitlines()[0][:300]}. Give a slice shape of that generation, e.g. "
        "v5e:2x2, v5e:16x16, v6e:8x8, v4:2x2x2, v5p:4x4x4.") from None
  chip = chips.by_device_kind(devices[0].device_kind)
  if chip is None:
    raise ConfigError(f"--plan_topology={topology}: its chips report device kind "
                      f"{devices[0].device_kind!r}, which spmdtask.plan.chips has no facts for; "
                      f"plan one of {', '.join(chips.CHIPS)}.")
  expected = math.prod(int(d) for d in m.group(2).split("x")) * num_slices
  assert len(devices) == expected, (topology, len(devices), expected)
  return Target("tpu", devices, topology, num_slices, chip, "".join(log))


def check_mesh(target: Target, dcn_mesh_shape) -> None:
  """ConfigError unless the task's DCN axes span exactly the target's slices."""
  dcn = math.prod(dcn_mesh_shape) if dcn_mesh_shape is not None else 1
  if target.num_slices != dcn:
    raise ConfigError(
        f"--plan_slices={target.num_slices}, but task.dcn_mesh_shape={dcn_mesh_shape} spans "
        f"{dcn} slice(s). Set task.dcn_mesh_shape so its product is {target.num_slices} "
        f"(e.g. --fdl_set=\"task.dcn_mesh_shape=({target.num_slices}, 1, 1)\" for a data "
        "axis over slices), or change --plan_slices.")


def gpu(name: str) -> Target:
  """Compile-only GPUs: `model:[hosts x]gpus_per_host` (e.g. 'h100:8'), compiled by XLA:GPU
  from XLA's description of the device (no GPU, driver or CUDA library needed).

  Collectives whose groups span hosts are charged at the hosts' network rate too
  (`Target.hosts_of`, `roofline.network_bytes`).
  """
  m = _GPU_TOPOLOGY.match(name)
  models = [c.name for c in chips.GPUS.values() if c.gpu_target_config]  # XLA can compile for
  if not m or m.group(1) not in models:
    raise ConfigError(f"--plan_topology={name!r}: a GPU topology is MODEL:GPUS_PER_HOST or "
                      f"MODEL:HOSTSxGPUS_PER_HOST, e.g. h100:8 or h100:4x8 (models spmdtask "
                      f"has XLA's device description of: {', '.join(models)}).")
  chip = chips.GPUS[m.group(1)]
  hosts, per_host = int(m.group(2) or 1), int(m.group(3))
  try:
    importlib.import_module("jax_plugins.xla_cuda12")
  except ImportError:
    raise ConfigError(f"--plan_topology={name} compiles with XLA:GPU, which comes with JAX's "
                      f"CUDA plugin, and it is not installed. Install it: {PIP_GPU}") from None
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  log: list[str] = []
  with console.captured_fd2(log):
    devices = tuple(topologies.get_topology_desc(
        platform="cuda", topology_name="", target_config=chip.gpu_target_config,
        topology=f"1x{hosts}x{per_host}").devices)
  return Target("gpu", devices, name, 1, chip, "".join(log))
