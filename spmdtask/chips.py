"""Published facts of the TPU chips a plan can target: one row per generation. Pure data.

Each figure is per chip, as Google's Cloud TPU documentation states it (the source of each
row is named beside it). ICI is kept as the bidirectional figure the pages give; a chip
receives at most half of it (`ici_ingress_bytes_per_s`), which is what bounds the time of
the collectives it takes part in. DCN is the per-chip share of the hosts' network, where
the documentation gives one.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's per-chip facts (bytes, bytes/s, FLOP/s)."""
  name: str                          # the topology prefix libtpu accepts: 'v5e'
  device_kind: str                   # what jax's Device.device_kind says: 'TPU v5 lite'
  peak_bf16_flops_per_s: float
  hbm_bytes: float
  hbm_bytes_per_s: float
  ici_bidirectional_bytes_per_s: float
  dcn_bytes_per_s: float | None      # None: not documented per chip
  source: str
  host_link_bytes_per_s: float | None = None  # host <-> HBM (PCIe) one way; None: unknown

  @property
  def ici_ingress_bytes_per_s(self) -> float:
    return self.ici_bidirectional_bytes_per_s / 2

  def as_json(self) -> dict:
    return {**dataclasses.asdict(self), "ici_ingress_bytes_per_s": self.ici_ingress_bytes_per_s}


GB, GIB = 1e9, 2.0**30

CHIPS = {c.name: c for c in (
    # https://cloud.google.com/tpu/docs/v4 (key specifications: 275 TFLOPs bf16, HBM2 32 GiB,
    # 1200 GBps). The page gives no per-chip ICI figure: 6 ICI links x 50 GB/s each way
    # (TPU v4 paper, Jouppi et al., ISCA 2023, linked from that page) -> 600 GB/s both ways.
    Chip("v4", "TPU v4", 275e12, 32 * GIB, 1200 * GB, 600 * GB, None,
         "cloud.google.com/tpu/docs/v4; ICI: the TPU v4 paper (ISCA 2023)"),
    # https://cloud.google.com/tpu/docs/v5e (197 TFLOPs bf16, HBM2 16 GB at 819 GBps,
    # bidirectional ICI 400 GBps per chip; 2 x 100 Gbps NICs per 8-chip host = 25 Gbps/chip).
    # Host link: Google's pages give none; 1.5e10 B/s per chip is the PCIe figure of "How to
    # Scale Your Model" (jax-ml.github.io/scaling-book/tpus), third-party, used for offload.
    Chip("v5e", "TPU v5 lite", 197e12, 16 * GB, 819 * GB, 400 * GB, 25e9 / 8,
         "cloud.google.com/tpu/docs/v5e; host link: jax-ml.github.io/scaling-book/tpus",
         host_link_bytes_per_s=1.5e10),
    # https://cloud.google.com/tpu/docs/v5p (459 TFLOPs bf16, HBM 95 GiB at 2765 GBps,
    # bidirectional ICI 1200 GBps per chip, DCN 50 Gbps per chip).
    Chip("v5p", "TPU v5", 459e12, 95 * GIB, 2765 * GB, 1200 * GB, 50e9 / 8,
         "cloud.google.com/tpu/docs/v5p"),
    # https://cloud.google.com/tpu/docs/v6e (918 TFLOPs bf16, HBM 32 GB at 1638 GBps,
    # bidirectional ICI 800 GBps per chip; no per-chip DCN figure).
    Chip("v6e", "TPU v6 lite", 918e12, 32 * GB, 1638 * GB, 800 * GB, None,
         "cloud.google.com/tpu/docs/v6e"),
)}


def by_device_kind(device_kind: str) -> Chip | None:
  """The chip whose devices report `device_kind`, or None."""
  return next((c for c in CHIPS.values() if c.device_kind == device_kind), None)
