"""What a plan tells a person to change, by array: warnings (a large param replicated though a
dim could be split, padding, XLA's involuntary full rematerializations) and the one line for
LoRA adapters held whole by design. Pure: reads the plan's `memory.ArrayRow`s."""
import math

from spmdtask import console
from spmdtask.core import memory, sharding, train_state
from spmdtask.plan import hlo, owners

# A replicated param that could be split is named when it holds at least this many bytes
# and this share of the train state per device: splitting a smaller one saves nothing worth
# a line (Llama 3.1 70B's two norm stacks, 2.5 MiB each of a 6.3 GiB state: 0.04%).
REPLICATED_WARN_BYTES = 1 << 20
REPLICATED_WARN_SHARE = 0.01
PADDING_WARN_FRACTION = 0.05     # padding above this fraction of an array is named


def warnings(rows: list[memory.ArrayRow], mesh_shape: dict[str, int], remats: list[dict],
             batch_shape) -> list[str]:
  """Human-readable warnings, each naming the array it concerns."""
  out = []
  devices = math.prod(mesh_shape.values())
  params = [r for r in rows if r.kind == "params"]  # optimizer state mirrors its param
  weight_axes = _weight_axes(rows, mesh_shape)
  worth = max(REPLICATED_WARN_BYTES,
              REPLICATED_WARN_SHARE * sum(r.bytes_per_device for r in rows))
  for r in params:
    if (r.shards == 1 and r.bytes_total >= worth
        and not train_state.is_adapter_name(r.path)  # by design: `replicated_adapters`
        and any(d % mesh_shape[a] == 0 for d in r.logical_shape for a in weight_axes)):
      out.append(f"{r.path} {list(r.logical_shape)} ({console.human_bytes(r.bytes_total)}) is "
                 f"replicated on all {devices} devices, though a dim divides a weight axis "
                 f"{sorted(weight_axes)}: split it in its weight_split_dims_mapping field.")
    pad = r.bytes_per_device * r.shards - r.bytes_total
    if r.bytes_total and pad / r.bytes_total > PADDING_WARN_FRACTION:
      out.append(f"{r.path} is padded from {list(r.logical_shape)} to {list(r.padded_shape)} "
                 f"(+{100 * pad / r.bytes_total:.0f}%, and so is its optimizer state): pick "
                 "dims divisible by their mesh axes.")
  for w in remats:
    owner = owners.owner(hlo.dims(w["shape"]), rows, batch_shape)
    out.append(f"XLA involuntary full rematerialization of {owner} (HLO %{w['op']} "
               f"{w['shape']}): it cannot reshard {w['from']} -> {w['to']} without replicating "
               "it; align the split-dims mappings of the arrays around it.")
  return out


def _weight_axes(rows: list[memory.ArrayRow], mesh_shape: dict[str, int]) -> set[str]:
  """The mesh axes (of more than one device) that split some param: none in pure data
  parallelism, where replicas are meant."""
  return {a for r in rows if r.kind == "params" for e in r.spec
          for a in sharding.entry_axes(e) if mesh_shape[a] > 1}


def replicated_adapters(rows: list[memory.ArrayRow], mesh_shape: dict[str, int]) -> dict | None:
  """LoRA adapters held whole by every device over more than one device, with their
  optimizer state: an adapter is split as its base weight's dims that it keeps
  (layers/lora.py), so one whose base is split over FSDP on the dim it replaces by the rank
  is whole on each device. Small by design (rank x a dim), so a line, not a warning."""
  whole = [r for r in rows if r.shards == 1 and train_state.is_adapter_name(r.path)]
  if not _weight_axes(rows, mesh_shape) or not whole:
    return None
  params = [r for r in whole if r.kind == "params"]
  return {"arrays": len(params),
          "of": sum(1 for r in rows if r.kind == "params" and train_state.is_adapter_name(r.path)),
          "params_bytes_per_device": sum(r.bytes_per_device for r in params),
          "opt_state_bytes_per_device": sum(r.bytes_per_device for r in whole
                                            if r.kind == "opt_state")}
