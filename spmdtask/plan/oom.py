"""The paragraph of a plan that does not fit its chip: what fills the chip, and only the fixes
that apply, each with what it would give. Pure (reads a plan and the task's config).

What fills a device is its train state (params and optimizer state, per device) and the
compiled step's temporaries (activations kept for the backward, gradients, gathered
weights, scratch). XLA:TPU refuses a step whose temporaries exceed the chip's usable HBM
and says how much they need ('HLO temporaries (21.6G)', in GiB); a step that compiles
reports them in `memory_analysis()`.
"""
import dataclasses
import re

from spmdtask.console import human_bytes as gib
from spmdtask.plan import chips

_TEMPS = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")
TILES = 8  # the vocab tiles suggested where the loss holds the whole float32 logits


def compiler_numbers(message: str) -> tuple[float, float] | None:
  """(temporaries, usable HBM) in bytes from XLA:TPU's out-of-memory line, or None."""
  m = _TEMPS.search(message)
  return (float(m.group(1)) * 2**30, float(m.group(2)) * 2**30) if m else None


def _field(obj, name: str):
  """A config dataclass's field, or None where it has none (models differ)."""
  return getattr(obj, name) if any(f.name == name for f in dataclasses.fields(obj)) else None


def saved_inputs(task, rows_per_device: float, batch_shape) -> str | None:
  """What a scanned stack's backward keeps at the least: every layer's input
  [layers, rows, seq, d_model] in the compute dtype (the whole of it under full remat), as
  a phrase with its bytes; None for a model without those fields."""
  model = task.model
  layers, d, dtype = (_field(model, k) for k in ("num_layers", "d_model", "fprop_dtype"))
  if not (layers and d and dtype) or len(batch_shape) < 2:
    return None
  size = {"bfloat16": 2, "float16": 2}.get(dtype, 4)
  shape = [layers, rows_per_device, batch_shape[1], d]
  return (f"of them the layers' saved inputs {dtype}[{', '.join(f'{x:g}' for x in shape)}] "
          f"{gib(size * layers * rows_per_device * batch_shape[1] * d)} (what the backward of "
          "a scanned stack keeps at the least: all of it under full remat)")


def fixes(task, temp: float, state: float, budget: float, rows_per_device: float,
          batch_shape, chip: dict | None = None) -> list[str]:
  """The fixes that apply to a step needing `temp` + `state` bytes per device over
  `budget` on `chip` (a plan's target chip; None: not a chip's plan), each with the bytes
  it would give."""
  out = []
  model, need = task.model, temp + state
  if temp > state or temp > budget:  # fewer rows at once, less kept, logits in tiles
    vocab, tiles = _field(model, "vocab_size"), _field(model, "loss_vocab_tiles")
    if tiles == 1 and vocab and len(batch_shape) >= 2:
      logits = rows_per_device * batch_shape[1] * vocab * 4
      out.append(f"task.model.loss_vocab_tiles={TILES}: the loss without the whole float32 "
                 f"logits (about {gib(logits)} of the temporaries)")
    k = 2  # the fewest microbatches that fit, else one row per device at once
    while rows_per_device % (2 * k) == 0 and temp / k + state > budget:
      k *= 2
    if rows_per_device >= 2 and rows_per_device % k == 0:
      out.append(f"task.train.num_microbatches={task.train.num_microbatches * k} "
                 f"({rows_per_device / k:g} rows per device at once): temporaries about "
                 f"{gib(temp / k)}, if they scale with the rows")
    policy = _field(model, "remat_policy")
    if policy in ("minimal", "save_dot_except_mlp", "save_qkv_proj"):
      out.append(f"task.model.remat_policy='{policy}_offloaded': its saved activations in "
                 "host memory")
    if policy not in ("full", "nothing_saveable"):
      out.append(f"task.model.remat_policy='full' (now {policy!r}): each layer keeps only its "
                 "input for the backward")
  if state >= temp or state > budget:
    out.append(f"more devices along the weights' axes (fsdp) or a larger split: the state, "
               f"{gib(state)} per device now, divides by the factor")
  bigger = [c for c in chips.CHIPS.values()
            if chip and c.hbm_bytes > max(need * 1.05, chip["hbm_bytes"])]
  if bigger:
    out.append(f"a chip with more than {gib(need)} of HBM: " + ", ".join(
        f"{c.name} ({gib(c.hbm_bytes)})" for c in bigger))
  return out


def paragraph(plan: dict, task, budget: float, budget_name: str, rows_per_device: float,
              batch_shape) -> str:
  """What fills a device of a plan over `budget` bytes, and the fixes that apply."""
  state = plan["state_bytes_per_device"]
  refused = plan.get("compiler_out_of_memory")
  if refused:
    temp, usable = compiler_numbers(refused) or (0.0, budget)
    head = f"XLA refused to compile the step: {refused.rstrip('.')}"
    budget = usable
  else:
    temp = plan["compiled"]["temp_size_in_bytes"]
    head = (f"the estimated peak of one device, {gib(plan['compiled']['peak_estimate_bytes'])}, "
            f"exceeds {budget_name}")
  cause = "the temporaries" if temp > state else "the train state"
  if min(temp, state) > budget:
    cause = "each alone over the chip's " + gib(budget)
  fills = (f"What fills the chip: temporaries (activations kept for the backward, gradients, "
           f"gathered weights, scratch) {gib(temp)} and the train state {gib(state)} per device "
           f"(params {gib(plan['params_bytes_per_device'])}, optimizer "
           f"{gib(plan['opt_state_bytes_per_device'])}): {cause} first.")
  kept = saved_inputs(task, rows_per_device, batch_shape) if temp > state else None
  if kept:
    fills = fills[:-1] + f"; {kept}."
  if temp <= state or state > budget:
    top = sorted(plan["arrays"], key=lambda a: -a["bytes_per_device"])[:5]
    fills += " Largest state arrays per device: " + "; ".join(
        f"{a['path']} {gib(a['bytes_per_device'])}" for a in top) + "."
  options = fixes(task, temp, state, budget, rows_per_device, batch_shape,
                  plan.get("target", {}).get("chip"))
  return (f"{head}. {fills} Fixes that apply: " + "; ".join(options) + "."
          if options else f"{head}. {fills}")
