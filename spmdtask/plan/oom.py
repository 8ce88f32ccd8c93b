"""The paragraph of a plan that does not fit its chip: what fills the chip, and only the fixes
that apply, each with what it would give. Pure (reads a plan and the task's config).

What fills a device is its train state (params and optimizer state, per device) and the
compiled step's temporaries (activations kept for the backward, gradients, gathered
weights, scratch). XLA:TPU refuses a step that needs more than the chip's usable HBM; its
message gives the need and lists its largest allocations (`plan.buffers`), which the
planner keeps as the plan's `largest_arrays` (a step that compiles has them read from
its optimized program instead). Each is named by what it is where that is known: an
activation the model sizes itself (`core.model.SizesActivations`), a param's shape (a
gathered weight), else the JAX op that made it. Sizes are GiB (2**30 bytes) throughout.
"""
from spmdtask import console
from spmdtask.console import human_bytes as gib
from spmdtask.core.model import ActivationMemory, SizesActivations
from spmdtask.errors import PlanExceeded
from spmdtask.plan import buffers, chips

TOP = 4  # the largest arrays named


def model_memory(task, rows_per_device: float, batch_shape) -> ActivationMemory | None:
  """The model's own account of its largest activations at `rows_per_device` rows at once,
  or None for a model that gives none."""
  if not isinstance(task.model, SizesActivations) or len(batch_shape) < 2:
    return None
  return task.model.activation_memory(rows_per_device, int(batch_shape[1]))


def what_it_is(array: dict, memory: ActivationMemory | None, params: list[dict]) -> str:
  """What `array` (a `buffers.Buffer` as json) is: the model's activation of that shape,
  a param of that shape (or one layer's slice of a stacked param: a gathered weight; what
  a collective made, a gathered weight or a reduced gradient, is matched to the params
  first), else the op XLA says made it. Dims
  of 1 are ignored (one row, one layer)."""
  squeeze = lambda shape: tuple(int(x) for x in shape if int(x) != 1)
  dims = squeeze(buffers.Buffer(**array).dims)

  def as_activation():
    for held in (memory.arrays if memory else ()):
      if dims == squeeze(held.shape):
        return held.what
    return None

  def as_param():
    for p in params:
      shape = tuple(p["logical_shape"])
      if dims == squeeze(shape):
        return f"the param {p['path']}, whole"
      if len(shape) > 2 and dims == squeeze(shape[1:]):
        return f"one layer's {p['path']} whole (gathered, or its gradient)"
    return None

  collective = array["kind"] in ("all-gather", "all-reduce", "reduce-scatter")
  ways = (as_param, as_activation) if collective else (as_activation, as_param)
  for way in ways:
    if (what := way()) is not None:
      return what
  return f"made by {array['what']}"


def largest(plan: dict, memory: ActivationMemory | None) -> str:
  """'XLA's largest arrays per device: ...' naming each; '' where the plan has none."""
  shapes = {}  # one per shape: an array updated in place shows as each op that writes it
  for a in plan.get("largest_arrays", []):
    shapes.setdefault(a["shape"], a)
  arrays = list(shapes.values())[:TOP]
  if not arrays:
    return ""
  params = [a for a in plan["arrays"] if a["path"].startswith("params")]
  return "XLA's largest arrays per device: " + "; ".join(
      f"{a['shape']} {gib(a['bytes'])}, {what_it_is(a, memory, params)}" for a in arrays) + "."


def own_account(memory: ActivationMemory | None, temp: float) -> str:
  """The temporaries as the model accounts for them, where XLA names none of its arrays."""
  if memory is None:
    return ""
  rest = temp - sum(a.bytes for a in memory.arrays)
  return ("Of the temporaries, by the model's own account (XLA names none of its arrays): "
          + "; ".join(f"{a.what}, {a.describe()} {gib(a.bytes)}" for a in memory.arrays)
          + (f"; the other {gib(rest)}: gradients, gathered weights, scratch" if rest > 0
             else "") + ".")


def fixes(task, temp: float, state: float, budget: float, rows_per_device: float,
          memory: ActivationMemory | None, chip: dict | None = None) -> list[str]:
  """The fixes that apply to a step needing `temp` + `state` bytes per device over
  `budget` on `chip` (a plan's target chip; None: not a chip's plan), each with the bytes
  it would give."""
  out = []
  need = temp + state
  if temp > state or temp > budget:  # fewer rows at once, less kept
    k = 2  # the fewest microbatches that fit, else one row per device at once
    while rows_per_device % (2 * k) == 0 and temp / k + state > budget:
      k *= 2
    if rows_per_device >= 2 and rows_per_device % k == 0:
      out.append(f"task.train.num_microbatches={task.train.num_microbatches * k} "
                 f"({rows_per_device / k:g} row{'s' * (rows_per_device != k)} per device at "
                 f"once): temporaries about "
                 f"{gib(temp / k)}, if they scale with the rows")
    for f in (memory.fixes if memory else ()):
      short = f.saves and temp - f.saves + state > budget
      out.append(f"{f.override}: {f.effect}"
                 + (f", at least {gib(f.saves)} less" if f.saves else "")
                 + (" (alone, perhaps not enough)" if short else ""))
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
    temp = plan.get("compiler_need_bytes", 0.0)
    budget = plan.get("compiler_usable_bytes", budget)
    head = f"XLA refused to compile the step: {refused.rstrip('.')}"
    chip = plan.get("target", {}).get("chip")
    budget_name = (f"the {budget / 2**30:.2f} GiB XLA lets a program use"
                   + (f" of the {chip['name']}'s {gib(chip['hbm_bytes'])}" if chip else ""))
  else:
    temp = plan["compiled"]["temp_size_in_bytes"]
    head = (f"the estimated peak of one device, {gib(plan['compiled']['peak_estimate_bytes'])}, "
            f"exceeds {budget_name}")
  if min(temp, state) > budget:
    cause = f"each alone over {budget_name}"
  elif temp > budget:
    cause = f"the temporaries alone over {budget_name}"
  else:
    cause = ("the temporaries" if temp > state else "the train state") + " first"
  fills = (f"What fills the chip: temporaries (activations kept for the backward, gradients, "
           f"gathered weights, scratch) {gib(temp)} and the train state {gib(state)} per device "
           f"(params {gib(plan['params_bytes_per_device'])}, optimizer "
           f"{gib(plan['opt_state_bytes_per_device'])}): {cause}.")
  memory = model_memory(task, rows_per_device, batch_shape) if task is not None else None
  if temp > state:
    fills += " " + (largest(plan, memory) if plan.get("largest_arrays") else
                    own_account(memory, temp))
  else:
    top = sorted(plan["arrays"], key=lambda a: -a["bytes_per_device"])[:5]
    fills += " Largest state arrays per device: " + "; ".join(
        f"{a['path']} {gib(a['bytes_per_device'])}" for a in top) + "."
  options = fixes(task, temp, state, budget, rows_per_device, memory,
                  plan.get("target", {}).get("chip"))
  return (f"{head}. {fills} Fixes that apply: " + "; ".join(options) + "."
          if options else f"{head}. {fills}")


def check_fits(plan: dict, budget: float, budget_name: str | None = None,
               task=None) -> None:
  """PlanExceeded saying what fills a device and the fixes that apply (`plan.oom`) when the
  peak estimate exceeds `budget` bytes or XLA refused the step (for an MPMD plan: the first
  pipeline stage that does not fit). `budget_name` says where the budget comes from
  (default: --device_memory_gib)."""
  budget_name = budget_name or f"--device_memory_gib={budget / 2**30:g}"
  for st in plan.get("stage_plans", []):
    if st["peak_estimate_bytes"] > budget:
      raise PlanExceeded(
          f"pipeline stage {st['stage']} does not fit: its estimated peak per device, "
          f"{console.human_bytes(st['peak_estimate_bytes'])} (state "
          f"{console.human_bytes(st['state_bytes_per_device'])}, live activations "
          f"{console.human_bytes(st['peak_activation_bytes'])} at "
          f"{st['peak_activation_sets']:g} sets, temporaries "
          f"{console.human_bytes(st['compiled_temp_bytes'])}), exceeds "
          f"{budget_name}. Move layers off it "
          "(task.pipeline.layer_cuts), give it more devices (task.pipeline.submesh_shapes), "
          "or use a schedule that holds fewer sets (task.pipeline.schedule).")
  for ph in plan.get("phases", [])[1:]:
    refused = ph.get("compiler_out_of_memory")
    if refused or ph["compiled"]["peak_estimate_bytes"] > budget:
      why = (f"XLA refused to compile it ({refused})" if refused else
             f"its estimated peak per device, "
             f"{console.human_bytes(ph['compiled']['peak_estimate_bytes'])}, exceeds "
             f"{budget_name}")
      raise PlanExceeded(
          f"the {ph['name']} program does not fit: {why}. Give it fewer rows at once (the sampler: fewer decode slots, "
          "task.objective.sampler_slots; both: fewer prompts per step or "
          "task.objective.num_generations) or shorter completions "
          "(task.objective.max_new_tokens).")
  if ("compiler_out_of_memory" not in plan
      and plan["compiled"]["peak_estimate_bytes"] <= budget):
    return
  batch_shape = plan["batch_shape"]
  rows = batch_shape[0] / max(1, plan["batch_shards"] * plan["num_microbatches"])
  raise PlanExceeded(paragraph(plan, task, budget, budget_name, rows, batch_shape))
