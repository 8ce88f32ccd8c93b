"""The console lines of a plan (`spmdtask.plan.planner` builds it; this only formats it). Pure."""
from spmdtask import console


def format_estimate(plan: dict) -> list[str]:
  """The roofline lines: the chip, each bound, the binding one and what it implies."""
  est, chip = plan.get("estimate"), plan["target"]["chip"]
  if est is None:
    return []
  terms = ", ".join(f"{k} {console.human_seconds(v)}" + (low_line(est) if k == "compute" else "")
                    for k, v in est["seconds"].items())
  return [
      f"chip {chip['name']}: peak {chip['peak_bf16_flops_per_s'] / 1e12:.0f} TFLOP/s bf16, HBM "
      f"{console.human_bytes(chip['hbm_bytes'])} at {chip['hbm_bytes_per_s'] / 1e9:.0f} GB/s, "
      f"{'NVLink' if plan['target']['platform'] == 'gpu' else 'ICI'} "
      f"{chip['ici_bidirectional_bytes_per_s'] / 1e9:.0f} GB/s both ways ({chip['source']})",
      f"roofline per step: {terms}; bound by {est['bound']}: step >= "
      f"{console.human_seconds(est['step_seconds_lower_bound'])}, tokens/s <= "
      f"{console.human_count(est['tokens_per_second_upper_bound'])}, MFU <= "
      f"{100 * est['mfu_upper_bound']:.1f}%"] + (
          [] if "stage" in est else step_line(plan.get("step_estimate"), est))


def low_line(est: dict) -> str:
  """The compute term's quantized share: the int8 / fp8 matmuls charged at their rate."""
  low = est.get("low_precision_flops") or {}
  parts = [f"{v['flops'] / 1e12:.3g} TFLOP of {k} matmuls at {v['peak'] / 1e12:.0f} TOP/s"
           for k, v in low.items()]
  return f" ({', '.join(parts)}; the rest at bf16's)" if parts else ""


def step_line(step: dict | None, roof: dict) -> list[str]:
  """The schedule's estimate (`plan.overlap`) beside the roofline `roof`: one line."""
  if not step:
    return []
  secs = console.human_seconds
  mfu = (f"; MFU ~ {100 * step['mfu_estimate']:.1f}% (ceiling "
         f"{100 * roof['mfu_upper_bound']:.1f}%)" if step.get("mfu_estimate") else "")
  where = (f"stage {step['stage']}'s programs' compiled schedules (the bubble not in it)"
           if "stage" in step else "the compiled schedule")
  return [f"step ~ {secs(step['step_seconds'])} from {where}: compute "
          f"{secs(step['compute_seconds'])}, HBM-bound {secs(step['hbm_seconds'])}, exposed "
          f"communication {secs(step['exposed_seconds'])} ({step['exposed_fraction']:.0%} of the "
          f"collectives' {secs(step['collective_seconds'])}){mfu}"]


def format_stage_estimates(plan: dict) -> list[str]:
  """An MPMD step's roofline per stage (`plan.stage_roofline`): what the bound rests on,
  each stage's busy time per resource, and the bubble's estimate beside the bound."""
  est = plan.get("estimate")
  if est is None or "stage" not in est:
    return []
  secs = console.human_seconds
  lines = [f"step bound: {est['basis']}"]
  for st in plan["stage_plans"]:
    terms = ", ".join(f"{k} {secs(v)}" for k, v in st["seconds"].items())
    lines.append(f"stage {st['stage']} busy per step: {terms}; busy {secs(st['busy_seconds'])}"
                 f" (bound by {st['bound']}); bubble {st['bubble']:.1%}")
  lines += step_line(plan.get("step_estimate"), est)
  with_bubble = est["step_seconds_with_bubble_estimate"]
  lines.append(f"with the schedule's bubble (the simulator's estimate with equal F/B/W costs, "
               f"not a bound): step ~ {secs(with_bubble)}, MFU ~ "
               f"{100 * (est['mfu_with_bubble_estimate'] or 0):.1f}%")
  return lines


TABLE_ROWS = 15  # the array table's rows: the largest per device (plan.json has every one)


def where(target: dict, num_devices: int) -> str:
  """'v5e:2x4 (8 TPU v5 lite chips)', or '8 cpu devices': what a plan is for."""
  t = target
  if not t["topology"]:
    return f"{num_devices} {t['platform']} devices"
  return (f"{t['topology']}" + (f" x {t['num_slices']} slices" if t["num_slices"] > 1 else "")
          + f" ({t['chips']} {t['device_kind']} chips)")


def array_table(rows: list[dict], top: int = TABLE_ROWS) -> list[str]:
  """The `top` arrays with the most bytes per device, largest first, and how many more."""
  mb = console.human_bytes
  ranked = sorted(rows, key=lambda a: -a["bytes_per_device"])
  largest, rest = ranked[:top], ranked[top:]
  lines = [f"{'array':58} {'logical':>16} {'padded':>16} {'spec':>24} {'per device':>11}"]
  for a in largest:
    lines.append(f"{a['path'][:58]:58} {str(a['logical_shape']):>16} "
                 f"{str(a['padded_shape']):>16} {str(tuple(a['spec'])):>24} "
                 f"{mb(a['bytes_per_device']):>11}")
  if rest:
    lines.append(f"... and {len(rest)} smaller arrays, "
                 f"{mb(sum(a['bytes_per_device'] for a in rest))} per device in all (plan.json "
                 "lists every array)")
  return lines


def adapters_line(a: dict) -> str:
  """The plan's `replicated_adapters`, in one line."""
  mb = console.human_bytes
  return (f"LoRA adapters: {a['arrays']} of {a['of']} held whole on every device (an adapter is "
          f"split as the dims of its base weight it keeps): {mb(a['params_bytes_per_device'])} "
          f"per device, with their optimizer state {mb(a['opt_state_bytes_per_device'])}")


def format_plan(plan: dict) -> list[str]:
  """The console lines of a plan."""
  mb = console.human_bytes
  t = plan["target"]
  active = plan.get("num_active_params", plan["num_params"])
  params = f"{plan['num_params']:,} params" + (f", {active:,} active per token"
                                               if active != plan["num_params"] else "")
  lines = [f"Plan of {plan['experiment']} ({params}) on {where(t, plan['num_devices'])}, mesh "
           f"{plan['mesh']}:", *plan.get("describe", []), *array_table(plan["arrays"])]
  lines.append(
      f"params {plan['num_params']:,}; train state per device "
      f"{mb(plan['state_bytes_per_device'])} (params "
      f"{mb(plan['params_bytes_per_device'])}, optimizer {mb(plan['opt_state_bytes_per_device'])})"
      f"; total / devices = {mb(plan['state_bytes_total_over_devices'])}")
  if "num_trainable_params" in plan:
    lines.append(
        f"trainable params {plan['num_trainable_params']:,} "
        f"({mb(plan['trainable_params_bytes_per_device'])} per device), frozen "
        f"{plan['num_frozen_params']:,} ({mb(plan['frozen_params_bytes_per_device'])} per "
        f"device); optimizer state {mb(plan['opt_state_bytes_per_device'])} per device")
  if "replicated_adapters" in plan:
    lines.append(adapters_line(plan["replicated_adapters"]))
  if "decode_cache" in plan:  # decoding's, not the train step's memory
    cache = plan["decode_cache"]
    per_token, t_max = cache["bytes_per_token_per_row"], cache["max_seq_len"]
    lines.append(f"decode cache (--mode=decode, not in this step's memory): {per_token:,} B per "
                 f"token of a row over all layers, {mb(per_token * t_max)} a row at max_seq_len "
                 f"{t_max:,}, before any split over the mesh")
  if "compiler_out_of_memory" in plan:
    return lines + ["compiled step: XLA refused it, out of memory (its line is below)"]
  c, f = plan["compiled"], plan["flops_per_step"]
  hbm = f" of the chip's {mb(t['chip']['hbm_bytes'])} HBM" if t["chip"] else ""
  if t["platform"] == "cpu":  # XLA:CPU keeps far more temporaries than an accelerator's
    hbm += (" (XLA:CPU's figures, not a TPU's or GPU's: --plan_topology compiles for the "
            "chip)")
  lines += [
      f"compiled step per device: arguments {mb(c['argument_size_in_bytes'])}, outputs "
      f"{mb(c['output_size_in_bytes'])} (aliased {mb(c['alias_size_in_bytes'])}), temporaries "
      f"{mb(c['temp_size_in_bytes'])}; peak estimate {mb(c['peak_estimate_bytes'])}{hbm}",
      f"FLOPs per step: XLA {f['xla']:.4g} (loops counted per trip; {f['xla_loop_bodies_once']:.3g}"
      f" with loop bodies once), model formula {f['model']:.4g}{_attention_share(f)}; HBM "
      "bytes per step per device "
      f"{mb(plan['hbm_bytes_per_step_per_device'])}",
      "largest arrays per device: " + (arrays(plan.get("largest_arrays", []), 5) or "unknown")
      + (f"; offloaded to the host: {arrays(plan['largest_host_arrays'], 3)}"
         if plan.get("largest_host_arrays") else ""),
      *([f"MoE dispatch arrays per device: {arrays(plan['largest_moe_arrays'], 4)}"]
        if plan.get("largest_moe_arrays") else []),
      "collectives per step: " + (", ".join(
          f"{k} x{v['count']} {mb(v['bytes'])}" for k, v in sorted(plan["collectives"].items()))
          or "none")]
  if "remat" in plan:
    lines.append(remat_line(plan["remat"]))
  lines += format_estimate(plan) + format_stage_estimates(plan)
  for st in plan.get("stages", []):
    lines.append(f"stage {st['stage']}: {st['devices']} devices, state "
                 f"{mb(st['state_bytes_per_device'])} per device (of which "
                 f"{mb(st['bytes_held_by_every_stage'])} held by every stage)")
  lines += phase_lines(plan)
  for p in plan.get("programs", []):
    lines.append(f"program {p['name']} on {p['devices']} devices (x{p['calls_per_step']} a step): "
                 f"temporaries {mb(p['compiled']['temp_size_in_bytes'])}, peak estimate "
                 f"{mb(p['compiled']['peak_estimate_bytes'])} per device"
                 + (f"; largest {arrays(p['largest_arrays'])}" if p.get("largest_arrays")
                    else ""))
  for st in plan.get("stage_plans", []):
    lines.append(
        f"stage {st['stage']} ({st['devices']} devices, layers {st['layers']}): state "
        f"{mb(st['state_bytes_per_device'])}, live activations at the schedule's peak "
        f"{st['peak_activation_sets']:g} sets = {mb(st['peak_activation_bytes'])}, compiled "
        f"temporaries {mb(st['compiled_temp_bytes'])}; peak estimate "
        f"{mb(st['peak_estimate_bytes'])} per device; sends {mb(st['transfer_bytes_per_step'])}"
        f" a step; {st['flops_per_step']:.3g} FLOPs a step; bubble {st['bubble']:.1%}"
        + (f"; cost {st['cost_vs_slowest']:.2f} of the slowest" if "cost_vs_slowest" in st
           else ""))
  lines += [f"note: {n}" for n in plan.get("notes", [])]
  lines += [f"warning: {w}" for w in plan["warnings"]]
  return lines


def _per_step(calls: float) -> str:
  """'x1 a step', 'once every 2 steps'."""
  return f"x{calls:g} a step" if calls >= 1 else f"once every {round(1 / calls)} steps"


def _bound(b: dict) -> str:
  """'1.2 ms (bound by hbm: compute 0.1 ms, hbm 1.2 ms, ici 0.5 ms)'."""
  secs = console.human_seconds
  terms = ", ".join(f"{k} {secs(v)}" for k, v in b["seconds"].items())
  return f"{secs(b['seconds_lower_bound'])} (bound by {b['bound']}: {terms})"


def phase_lines(plan: dict) -> list[str]:
  """Each phase's memory and (with a chip) its time; the RL step's total (`plan.phases`)."""
  mb, secs = console.human_bytes, console.human_seconds
  lines = []
  for p in plan.get("phases", []):  # GRPO: sampling and scoring beside the train step
    if "compiler_out_of_memory" in p:
      lines.append(f"phase {p['name']} ({_per_step(p['calls_per_step'])}): XLA refused it, out "
                   f"of memory: {p['compiler_out_of_memory']}")
      continue
    lines.append(f"phase {p['name']} ({_per_step(p['calls_per_step'])}): peak estimate "
                 f"{mb(p['compiled']['peak_estimate_bytes'])} per device (temporaries "
                 f"{mb(p['compiled']['temp_size_in_bytes'])})")
    est = p.get("estimate")
    if est is None:
      continue
    if "trip" in est:  # a decode loop: what runs once, then its iterations
      lines.append(
          f"  time >= {secs(est['seconds_lower_bound'])}: prefill and set-up "
          f"{_bound(est['once'])}, then {est['loop_trips']:,} decode iterations x "
          f"{_bound(est['trip'])}; iterations: {est['loop_note']}; shorter completions end "
          "it sooner (time ~ prefill + iterations run x one)")
      lines.append(
          "  HBM bytes per chip: the prefill reads the weights, "
          f"{mb(est['prefill_bytes'])}; an iteration "
          f"{mb(est['weights_bytes'])} of them and the whole KV cache it may read, "
          f"{mb(est['cache_bytes'])} "
          "(every slot's every position, or a paged pool's every page and the prompts'; a "
          "step reads up to its longest row's block: the last iterations of a wave). "
          "XLA's cost analysis counts "
          f"{mb(est['once']['xla_hbm_bytes'])} and {mb(est['trip']['xla_hbm_bytes'])} (it "
          "charges an op on one layer's slice of a stacked array, weights or cache, the whole "
          "stack): with its count, "
          f"{secs(est['seconds_with_xla_hbm_bytes'])}")
    elif "seconds" in est:
      lines.append(f"  time >= {_bound(est)}")
    else:
      lines.append(f"  time >= {secs(est['seconds_lower_bound'])} (bound by {est['bound']}: "
                   "the train step's roofline above)")
  rl = plan.get("rl_step")
  if rl:
    parts = " + ".join(f"{k} {secs(v)}" for k, v in rl["parts"].items())
    lines.append(
        f"RL step (one optimizer step) >= {secs(rl['seconds_lower_bound'])} = {parts}: each "
        "phase's roofline lower bound x its calls a step, run in turn (none overlapped); the "
        "KL reference's log-probs (beta > 0) are inside the train step's; rewards (host "
        "Python), host transfers and dispatch are not counted")
  return lines


def remat_line(r: dict) -> str:
  """The console line of a plan's remat section."""
  return (f"remat: device temporaries {console.human_bytes(r['device_temp_bytes'])}, offloaded "
          f"to host {console.human_bytes(r['host_temp_bytes'])} ({console.human_bytes(r['host_transfer_bytes'])} "
          f"over the host link per step); matmul FLOPs per device {r['flops_per_device']:.4g} = "
          f"{r['flops_ratio']:.3f}x no remat's")


def arrays(largest: list[dict], top: int = 3) -> str:
  """'f32[8192,16032] 501.0 MiB (while/body/dot_general), ...': a plan's `largest_arrays`."""
  return ", ".join(f"{a['shape']} {console.human_bytes(a['bytes'])} ({a['what']})"
                   for a in largest[:top])


def _attention_share(flops: dict) -> str:
  """', attention N% of it' where the model says how much of its work is attention."""
  part = flops.get("model_attention")
  return f" (attention {part / flops['model']:.1%} of it)" if part and flops["model"] else ""
