"""A roofline estimate of one train step on a chip: a lower bound on its time. Pure.

Each per-chip resource gives a time the step cannot beat:
  compute  XLA's FLOPs per chip per step / the chip's peak bf16 FLOP/s;
  hbm      XLA's HBM bytes accessed per chip per step / the HBM bandwidth;
  ici      bytes a chip receives in the collectives within its slice / its ICI ingress
           bandwidth (half the documented bidirectional figure);
  dcn      the same for collectives that cross slices / its share of the DCN; on GPUs,
           the bytes of collectives whose groups span hosts that must cross the hosts'
           network (`network_bytes`) / its share of it (its NIC);
  host_link  bytes of offloaded activations (remat `*_offloaded` presets) moved between
           HBM and host memory / the chip's host link (PCIe) bandwidth;
  transfers  (MPMD stages) bytes a chip sends to another stage's chips / its one-way ICI
           bandwidth (the same half of the bidirectional figure).
The step takes at least the largest (they may overlap perfectly, never better), which
bounds tokens/s from above and the MFU (model FLOPs / (step time x peak)) too.
"""
from spmdtask.plan.chips import Chip


def received_bytes(kind: str, result_bytes: float, group_size: int) -> float:
  """Bytes one device receives in a collective with a ring algorithm, from its result.

  all-gather / all-to-all: all but its own share of the result (a ragged all-to-all's
  result is its receive buffer: at most that); reduce-scatter: the
  other members' partial sums of its shard; all-reduce: a reduce-scatter and an
  all-gather; collective-permute: the whole result.
  """
  n = max(1, group_size)
  if kind == "collective-permute":
    return result_bytes
  if kind == "reduce-scatter":
    return result_bytes * (n - 1)
  if kind == "all-reduce":
    return 2 * result_bytes * (n - 1) / n
  return result_bytes * (n - 1) / n  # all-gather, (ragged) all-to-all


def network_bytes(op) -> float:
  """Bytes of one run of a collective whose groups span `op.hosts` hosts (GPUs) that one
  GPU's NIC must carry at least: each host as one member of the collective over the
  hosts, its part spread over its GPUs' NICs (m GPUs of the group per host): an
  all-gather's host receives the (H-1)/H of the result held elsewhere, a reduce-scatter's
  the other hosts' partial sums of its m shards, an all-reduce both; a permute its whole
  result. 0 within one host."""
  h = op.hosts
  if h <= 1:
    return 0.0
  if op.kind == "collective-permute":
    return float(op.bytes)
  m = max(1, op.group_size // h)
  scale = m if op.kind in ("reduce-scatter", "all-to-all") else 1
  return received_bytes(op.kind, op.bytes * scale, h) / m


def link_seconds(op, chip: Chip) -> float:
  """Seconds one run of a collective (`hlo.Collective`) holds the chip's links: the bytes it
  receives over its ICI (NVLink) ingress or, across slices, its DCN share; a GPU
  collective across hosts the longer of that and its `network_bytes` over its NIC (0 for
  a rate the chip's facts lack: `estimate` notes it)."""
  rate = chip.dcn_bytes_per_s if op.dcn else chip.ici_ingress_bytes_per_s
  link = received_bytes(op.kind, op.bytes, op.group_size) / rate if rate else 0.0
  net = network_bytes(op) / chip.dcn_bytes_per_s if chip.dcn_bytes_per_s else 0.0
  return max(link, net)


def collective_traffic(ops) -> dict[str, float]:
  """Bytes one device receives per run of a program in its collectives (`hlo.Collective`s,
  each run `runs` times): within its slice (ICI) and across slices (DCN); on GPUs the
  bytes its NIC carries for collectives across hosts count as DCN too (`network_bytes`),
  beside all their bytes on NVLink."""
  out = {"ici": 0.0, "dcn": 0.0}
  for op in ops:
    out["dcn" if op.dcn else "ici"] += op.runs * received_bytes(op.kind, op.bytes, op.group_size)
    out["dcn"] += op.runs * network_bytes(op)
  return out


def received_by_kind(ops) -> dict[str, float]:
  """Bytes one device receives per step in each kind of collective (`hlo.Collective`s,
  by their `label`): what its links carry, where result bytes mislead.
  A weight gathered over two mesh axes in turn (16 x 16) counts 1 + 1/16 of itself in
  results, and brings the 255/256 a chip lacks, as one gather over all 256 would."""
  out: dict[str, float] = {}
  for op in ops:
    out[op.label] = (out.get(op.label, 0.0)
                     + op.runs * received_bytes(op.kind, op.bytes, op.group_size))
  return out


def kernel_note(calls: str, amount: str, kernel_flops: float, flops: float) -> str:
  """What a compute bound with fused kernels' traced FLOPs (`kernel_flops` of `flops`)
  rests on: `calls` says which kernels, `amount` their FLOPs and over what."""
  return (f"{calls}: their FLOPs ({amount}: forward, backward, recompute) are traced, "
          "splash's over the blocks its mask runs (a partly masked block counted whole), any "
          "other kernel's as if no block were skipped; one that skips blocks unseen does less "
          "(cuDNN under a causal mask: about half), so the compute bound may be up to "
          f"{kernel_flops / 2 / flops:.0%} high.")


def compute_seconds(chip: Chip, flops: float, low: dict[str, float]) -> float:
  """`flops` of which `low` (by operand type, `low_precision_flops`) are int8 / fp8 matmuls,
  each charged at the chip's rate for its type (`Chip.peak_for`), the rest at bf16's."""
  rest = max(0.0, flops - sum(low.values()))
  return rest / chip.peak_bf16_flops_per_s + sum(f / chip.peak_for(k) for k, f in low.items())



def estimate(chip: Chip, flops: float, hbm_bytes: float, ici_bytes: float, dcn_bytes: float,
             model_flops: float, tokens: float, host_bytes: float = 0.0,
             transfer_bytes: float = 0.0, low_flops: dict[str, float] | None = None) -> dict:
  """The roofline of one step; every argument is per chip per step but `tokens` (the
  step's tokens over all chips) and `model_flops` (the model formula's, per chip);
  `low_flops` of `flops` are int8 / fp8 matmuls (by operand type), charged at their rate."""
  low = low_flops or {}
  terms = {"compute": compute_seconds(chip, flops, low),
           "hbm": hbm_bytes / chip.hbm_bytes_per_s,
           "ici": ici_bytes / chip.ici_ingress_bytes_per_s}
  if transfer_bytes:
    terms["transfers"] = transfer_bytes / chip.ici_ingress_bytes_per_s
  notes = []
  if dcn_bytes:
    if chip.dcn_bytes_per_s:
      terms["dcn"] = dcn_bytes / chip.dcn_bytes_per_s
    else:
      notes.append(f"{chip.name} has no documented per-chip DCN bandwidth: the "
                   f"{dcn_bytes:.3g} DCN bytes per step are not in the bound.")
  if host_bytes:
    if chip.host_link_bytes_per_s:
      terms["host_link"] = host_bytes / chip.host_link_bytes_per_s
    else:
      notes.append(f"{chip.name} has no documented host link bandwidth: the {host_bytes:.3g} "
                   "offload bytes per step are not in the bound.")
  bound = max(terms, key=terms.get)
  step = terms[bound]
  return {"seconds": terms, "bound": bound, "step_seconds_lower_bound": step,
          "tokens_per_second_upper_bound": tokens / step if step else None,
          "mfu_upper_bound": model_flops / (step * chip.peak_bf16_flops_per_s) if step else None,
          "low_precision_flops": {k: {"flops": f, "peak": chip.peak_for(k)}
                                  for k, f in low.items()},
          "notes": notes}
