"""Published facts of the chips a plan can target and a run can measure its MFU against:
one row per TPU generation and GPU model, found by what JAX's `Device.device_kind` says.

HBM is in GiB (2**30 bytes): the vendors' "80 GB" of HBM are binary gigabytes (an H100
SXM holds 80 GiB, of which the driver leaves about 79.1 GiB to XLA).

Each figure is per chip, as its vendor's documentation states it (the source of each row
is named beside it). ICI (for a GPU: NVLink) is kept as the bidirectional figure the
pages give; a chip receives at most half of it (`ici_ingress_bytes_per_s`), which is what
bounds the time of the collectives it takes part in. DCN is the per-chip share of the
hosts' network, where the documentation gives one (for a GPU: its host's NIC for it, what
collectives across hosts are charged at, `roofline.network_bytes`). A GPU row also carries XLA's
description of the device (`gpu_target_config`, a GpuTargetConfigProto in text form),
which is what XLA's GPU compiler needs to compile for it without one present.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
  """One chip model's facts (bytes, bytes/s, FLOP/s; peak: dense bf16 matmul)."""
  name: str                          # the topology prefix: 'v5e' (libtpu's), 'h100'
  device_kind: str                   # what jax's Device.device_kind says: 'TPU v5 lite'
  peak_bf16_flops_per_s: float
  hbm_bytes: float
  hbm_bytes_per_s: float
  ici_bidirectional_bytes_per_s: float
  dcn_bytes_per_s: float | None      # None: not documented per chip
  source: str
  host_link_bytes_per_s: float | None = None  # host <-> HBM (PCIe) one way; None: unknown
  gpu_target_config: str | None = None  # GPUs: XLA's GpuTargetConfigProto (text)
  other_device_kinds: tuple[str, ...] = ()  # other names JAX has reported for it
  # Dense int8 / fp8 matmul peaks (ops/s); None: not documented (such a matmul is charged
  # at the bf16 peak).
  peak_int8_ops_per_s: float | None = None
  peak_fp8_flops_per_s: float | None = None

  def peak_for(self, operand_type: str) -> float:
    """The matmul peak for operands of HLO element type `operand_type` ('s8', 'f8e4m3fn',
    'bf16', ...): the int8 or fp8 rate where the chip documents one, else bf16's."""
    low = (self.peak_int8_ops_per_s if operand_type in ("s8", "u8") else
           self.peak_fp8_flops_per_s if operand_type.startswith("f8") else None)
    return low or self.peak_bf16_flops_per_s

  @property
  def ici_ingress_bytes_per_s(self) -> float:
    return self.ici_bidirectional_bytes_per_s / 2

  def as_json(self) -> dict:
    out = {**dataclasses.asdict(self), "ici_ingress_bytes_per_s": self.ici_ingress_bytes_per_s}
    out.pop("gpu_target_config")
    out.pop("other_device_kinds")
    return out


GB, GIB = 1e9, 2.0**30

CHIPS = {c.name: c for c in (
    # https://cloud.google.com/tpu/docs/v4 (key specifications: 275 TFLOPs bf16, HBM2 32 GiB,
    # 1200 GBps). The page gives no per-chip ICI figure: 6 ICI links x 50 GB/s each way
    # (TPU v4 paper, Jouppi et al., ISCA 2023, linked from that page) -> 600 GB/s both ways.
    Chip("v4", "TPU v4", 275e12, 32 * GIB, 1200 * GB, 600 * GB, None,
         "cloud.google.com/tpu/docs/v4; ICI: the TPU v4 paper (ISCA 2023)"),
    # https://cloud.google.com/tpu/docs/v5e (197 TFLOPs bf16, HBM2 16 GiB at 819 GBps,
    # bidirectional ICI 400 GBps per chip; 2 x 100 Gbps NICs per 8-chip host = 25 Gbps/chip;
    # int8 394 TOPs).
    # HBM: 16 GiB, as libtpu's compiler counts it (15.75 GiB of it usable by a program).
    # Host link: Google's pages give none; 1.5e10 B/s per chip is the PCIe figure of "How to
    # Scale Your Model" (jax-ml.github.io/scaling-book/tpus), third-party, used for offload.
    Chip("v5e", "TPU v5 lite", 197e12, 16 * GIB, 819 * GB, 400 * GB, 25e9 / 8,
         "cloud.google.com/tpu/docs/v5e; host link: jax-ml.github.io/scaling-book/tpus",
         host_link_bytes_per_s=1.5e10, other_device_kinds=("TPU v5e",),
         peak_int8_ops_per_s=394e12),
    # https://cloud.google.com/tpu/docs/v5p (459 TFLOPs bf16, HBM 95 GiB at 2765 GBps,
    # bidirectional ICI 1200 GBps per chip, DCN 50 Gbps per chip; int8 918 TOPs).
    Chip("v5p", "TPU v5", 459e12, 95 * GIB, 2765 * GB, 1200 * GB, 50e9 / 8,
         "cloud.google.com/tpu/docs/v5p", other_device_kinds=("TPU v5p",),
         peak_int8_ops_per_s=918e12),
    # https://cloud.google.com/tpu/docs/v6e (918 TFLOPs bf16, HBM 32 GiB at 1638 GBps,
    # bidirectional ICI 800 GBps per chip; no per-chip DCN figure; int8 1836 TOPs).
    Chip("v6e", "TPU v6 lite", 918e12, 32 * GIB, 1638 * GB, 800 * GB, None,
         "cloud.google.com/tpu/docs/v6e", other_device_kinds=("TPU v6e",),
         peak_int8_ops_per_s=1836e12),
)}


# XLA's device description of an H100 SXM (the fields of xla/tools/hlo_opt/gpu_specs/
# h100_sxm.txtpb): what XLA:GPU's cost model and kernel emitters read.
_H100_SXM_TARGET = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84978434048
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# GPU device kinds are CUDA's device names (cudaDeviceProp.name, as nvidia-smi prints them).
# Only a row with a gpu_target_config can be a plan's --plan_topology; every row gives a
# run its MFU peak. The datasheets give bf16 "with sparsity"; the dense figure is half.
GPUS = {c.name: c for c in (
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), SXM: BF16
    # 1979 TFLOPS with sparsity (989 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s
    # (both ways). The hosts' network: a DGX H100 has 8 ConnectX-7 ports of 400 Gb/s (NDR
    # InfiniBand), one per GPU (NVIDIA DGX H100 user guide, hardware overview): each GPU's
    # share is its port, 50 GB/s one way, what a plan charges bytes between hosts at.
    # FP8: 3958 TFLOPS with sparsity, 1979 dense.
    Chip("h100", "NVIDIA H100 80GB HBM3", 989e12, 80 * GIB, 3350 * GB, 900 * GB, 400e9 / 8,
         "NVIDIA H100 datasheet (SXM); DGX H100 networking",
         gpu_target_config=_H100_SXM_TARGET, peak_fp8_flops_per_s=1979e12),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200), SXM: the H100's 1979
    # TFLOPS sparse bf16 (989 dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; FP8 3958
    # TFLOPS sparse (1979 dense).
    Chip("h200", "NVIDIA H200", 989e12, 141 * GIB, 4800 * GB, 900 * GB, 400e9 / 8,
         "NVIDIA H200 datasheet (SXM); DGX H200 networking", peak_fp8_flops_per_s=1979e12),
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), SXM4: BF16 312 TFLOPS
    # dense, 80 GB HBM2e at 2039 GB/s (40 GB HBM2 at 1555 GB/s), NVLink 600 GB/s;
    # DGX A100: one 200 Gb/s HDR InfiniBand port per GPU.
    Chip("a100", "NVIDIA A100-SXM4-80GB", 312e12, 80 * GIB, 2039 * GB, 600 * GB, 200e9 / 8,
         "NVIDIA A100 datasheet (SXM4 80GB); DGX A100 networking"),
    Chip("a100-40", "NVIDIA A100-SXM4-40GB", 312e12, 40 * GIB, 1555 * GB, 600 * GB,
         200e9 / 8, "NVIDIA A100 datasheet (SXM4 40GB); DGX A100 networking"),
)}


def by_device_kind(device_kind: str) -> Chip | None:
  """The chip whose devices report `device_kind`, or None."""
  return next((c for c in (*CHIPS.values(), *GPUS.values())
               if device_kind in (c.device_kind, *c.other_device_kinds)), None)


@dataclasses.dataclass(frozen=True)
class Peak:
  """The FLOP/s per device an MFU is measured against, and where the figure comes from."""
  flops_per_s: float
  source: str   # 'H100 bf16 dense' or 'task.train.peak_flops_per_device'

  def figure(self) -> str:
    """'989 TFLOP/s'."""
    scale, unit = next((x for x in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"))
                        if self.flops_per_s >= x[0]), (1.0, "FLOP/s"))
    return f"{self.flops_per_s / scale:.3g} {unit}"

  def describe(self) -> str:
    """'989 TFLOP/s (h100 bf16 dense)'."""
    return f"{self.figure()} ({self.source})"


# A device with no chip row (a CPU): the fp32 matmul rate of a 2-core CPU.
DEFAULT_PEAK_FLOPS = 1.3e11


def mfu_peak(device_kind: str, override: float | None) -> Peak:
  """What MFU divides by: `override` (task.train.peak_flops_per_device) when set, else
  the chip's dense bf16 peak from its device kind, else DEFAULT_PEAK_FLOPS."""
  if override is not None:
    return Peak(override, "task.train.peak_flops_per_device")
  chip = by_device_kind(device_kind)
  if chip is not None:
    return Peak(chip.peak_bf16_flops_per_s, f"{chip.name} bf16 dense")
  return Peak(DEFAULT_PEAK_FLOPS, f"{device_kind}: no chip facts, a 2-core CPU's default; "
              "set task.train.peak_flops_per_device")
