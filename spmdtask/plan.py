"""`--mode=plan`: where a job's memory, FLOPs and communication go, before it runs.

Builds the program on the mesh (with `--plan_devices=N`: N CPU devices emulated in a
subprocess, so a 64- or 256-device layout can be planned on a laptop), lowers and
compiles the train step from ShapeDtypeStructs with their shardings (no array is
allocated, no step runs), and reports:
  arrays       every param and optimizer-state array: logical / padded shape,
               PartitionSpec, bytes per device (spmdtask.memory);
  compiled     XLA's memory_analysis of the per-device program, and a peak estimate
               (arguments + outputs - aliased + temporaries);
  FLOPs        cost_analysis (per device, x devices) beside the model's own formula;
  remat        device and host (offloaded) temporaries, matmul FLOPs against the same
               step's without remat (spmdtask.remat_cost);
  collectives  by kind, with result bytes per device per step (spmdtask.hlo);
  warnings     large replicated arrays that could be split, padding overhead, and every
               'involuntary full rematerialization' XLA printed while compiling, mapped
               to the param or activation of that shape.
It prints a summary and writes `job_log_dir/plan.json`. With `device_memory_gb`, an
estimate above it raises `PlanExceeded` naming the largest consumers.
"""
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile

import jax

from spmdtask import console, hlo, memory, remat_cost, sharding
from spmdtask import program as program_lib
from spmdtask.errors import PlanExceeded
from spmdtask.inputs import global_batch

REPLICATED_WARN_BYTES = 1 << 20  # a replicated array above this that could be split is named
PADDING_WARN_FRACTION = 0.05     # padding above this fraction of an array is named


def reexec_emulated(num_devices: int, argv: list[str]) -> int:
  """Reruns this command line with `num_devices` emulated CPU devices; its exit status.

  XLA reads the device count when JAX starts, so it takes a fresh process.
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu", SPMDTASK_PLAN_DEVICES=str(num_devices),
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={num_devices}").strip(),
             TF_CPP_MIN_LOG_LEVEL="1")  # keep XLA's warnings: they are part of the plan
  return subprocess.run([sys.executable, "-m", "spmdtask.main"] + argv[1:], env=env,
                        check=False).returncode


@contextlib.contextmanager
def captured_fd2(into: list[str]):
  """Captures what C++ (XLA) writes to file descriptor 2 meanwhile; appends it to `into`."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      into.append(tmp.read().decode(errors="replace"))


def abstract_args(program: program_lib.Program, example_local_batch):
  """ShapeDtypeStructs (with shardings) of the train step's (state, batch)."""
  state = program_lib.sharded_structs(program.mesh, program.layout.padded, program.layout.split)
  batch = program_lib.sharded_structs(
      program.mesh, global_batch.global_shapes(example_local_batch), program.batch_specs)
  return state, batch


def compile_train(program: program_lib.Program, example_local_batch):
  """(compiled train step, what XLA printed while compiling it)."""
  logs: list[str] = []
  with captured_fd2(logs):
    compiled = program.train.lower(*abstract_args(program, example_local_batch)).compile()
  return compiled, "".join(logs)


def compiled_memory(compiled) -> dict[str, int]:
  """memory_analysis fields of the per-device program, and the peak estimate."""
  ma = compiled.memory_analysis()
  out = {k: int(getattr(ma, k)) for k in (
      "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
      "temp_size_in_bytes", "generated_code_size_in_bytes") if hasattr(ma, k)}
  out["peak_estimate_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
  return out


def _owner(shape: tuple[int, ...], rows: list[memory.ArrayRow], batch_shape) -> str:
  """A param of this shape, else an activation described by its leading batch dims."""
  names = [r.path for r in rows if r.kind == "params" and shape in (r.logical_shape,
                                                                     r.padded_shape)]
  if names:
    return "param " + ", ".join(names[:3])
  if len(shape) >= 2 and tuple(shape[:2]) == tuple(batch_shape[:2]):
    return f"an activation [batch {shape[0]}, seq {shape[1]}, ...] {list(shape)}"
  if shape and shape[0] == batch_shape[0]:
    return f"an activation [batch {shape[0]}, ...] {list(shape)}"
  return f"a tensor {list(shape)}"


def warnings(rows: list[memory.ArrayRow], mesh_shape: dict[str, int], remats: list[dict],
             batch_shape) -> list[str]:
  """Human-readable warnings, each naming the array it concerns."""
  out = []
  devices = math.prod(mesh_shape.values())
  params = [r for r in rows if r.kind == "params"]  # optimizer state mirrors its param
  # The axes weights are split over (none in pure data parallelism, where replicas are meant).
  weight_axes = {a for r in params for e in r.spec for a in sharding.entry_axes(e)
                 if mesh_shape[a] > 1}
  for r in params:
    if (r.shards == 1 and r.bytes_total >= REPLICATED_WARN_BYTES
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
    owner = _owner(hlo.dims(w["shape"]), rows, batch_shape)
    out.append(f"XLA involuntary full rematerialization of {owner} (HLO %{w['op']} "
               f"{w['shape']}): it cannot reshard {w['from']} -> {w['to']} without replicating "
               "it; align the split-dims mappings of the arrays around it.")
  return out


def make_plan(run_cfg, name: str = "experiment") -> dict:
  """The plan of `run_cfg.task`'s train step on the devices present (JSON-able)."""
  task = run_cfg.task
  example = run_cfg.datasets["train"].batch_at(0)
  program = program_lib.setup(task, example)
  mesh_shape = {a: int(s) for a, s in program.mesh.shape.items()}
  rows = memory.state_rows(program.layout, mesh_shape)
  compiled, log_text = compile_train(program, example)
  remat = remat_cost.plan_section(program, example, *abstract_args(program, example), compiled)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  n = program.mesh.devices.size
  batch_shape = jax.tree.leaves(global_batch.global_shapes(example))[0].shape
  plan = {"experiment": name, "num_devices": n, "mesh": mesh_shape,
          **memory.totals(rows),
          "state_bytes_total_over_devices": memory.totals(rows)["state_bytes_total"] / n,
          "compiled": compiled_memory(compiled),
          "flops_per_step": {
              "xla_cost_analysis": float(cost.get("flops", 0.0)) * n,
              "model": float(program.work.train_flops) * batch_shape[0],
              "note": "XLA's count is per device x devices and counts a loop body (scanned "
                      "layers, microbatches) once; the model's is 6·N·T + attention."},
          "collectives": hlo.collectives(compiled.as_text()),
          "remat": remat,
          "warnings": warnings(rows, mesh_shape, hlo.remat_warnings(log_text), batch_shape),
          "arrays": [r.as_json() for r in rows]}
  if task.pipeline is not None:
    plan["stages"] = stage_report(rows, mesh_shape, task.pipeline)
  return plan


def stage_report(rows, mesh_shape, pipeline) -> list[dict]:
  """Per stage of an SPMD pipeline: its devices and each device's state bytes.

  Stacked layers are split over the stage axis; arrays that are not (embedding, head,
  norms) are held by every stage.
  """
  axis = pipeline.stage_axis
  s = mesh_shape.get(axis, 1)
  per_device = sum(r.bytes_per_device for r in rows)
  shared = sum(r.bytes_per_device for r in rows
               if not any(axis in (e if isinstance(e, tuple) else (e,)) for e in r.spec))
  devices = math.prod(mesh_shape.values()) // s
  return [{"stage": i, "devices": devices, "state_bytes_per_device": per_device,
           "bytes_held_by_every_stage": shared}
          for i in range(s)]


def format_plan(plan: dict) -> list[str]:
  """The console lines of a plan."""
  mb = console.human_bytes
  c = plan["compiled"]
  lines = [f"Plan of {plan['experiment']} on {plan['num_devices']} devices, mesh {plan['mesh']}:",
           f"{'array':58} {'logical':>16} {'padded':>16} {'spec':>24} {'per device':>11}"]
  for a in plan["arrays"]:
    lines.append(f"{a['path'][:58]:58} {str(a['logical_shape']):>16} "
                 f"{str(a['padded_shape']):>16} {str(tuple(a['spec'])):>24} "
                 f"{mb(a['bytes_per_device']):>11}")
  lines += [
      f"train state per device {mb(plan['state_bytes_per_device'])} (params "
      f"{mb(plan['params_bytes_per_device'])}, optimizer {mb(plan['opt_state_bytes_per_device'])})"
      f"; total / devices = {mb(plan['state_bytes_total_over_devices'])}",
      f"compiled step per device: arguments {mb(c['argument_size_in_bytes'])}, outputs "
      f"{mb(c['output_size_in_bytes'])} (aliased {mb(c['alias_size_in_bytes'])}), temporaries "
      f"{mb(c['temp_size_in_bytes'])}; peak estimate {mb(c['peak_estimate_bytes'])}",
      f"FLOPs per step: XLA {plan['flops_per_step']['xla_cost_analysis']:.3g} (loop bodies once)"
      f", model formula {plan['flops_per_step']['model']:.3g}",
      remat_line(plan["remat"]),
      "collectives per step: " + (", ".join(
          f"{k} x{v['count']} {mb(v['bytes'])}" for k, v in sorted(plan["collectives"].items()))
          or "none")]
  for st in plan.get("stages", []):
    lines.append(f"stage {st['stage']}: {st['devices']} devices, state "
                 f"{mb(st['state_bytes_per_device'])} per device (of which "
                 f"{mb(st['bytes_held_by_every_stage'])} held by every stage)")
  lines += [f"warning: {w}" for w in plan["warnings"]]
  return lines


def remat_line(r: dict) -> str:
  """The console line of a plan's remat section."""
  line = (f"remat: device temporaries {console.human_bytes(r['device_temp_bytes'])}, offloaded "
          f"to host {console.human_bytes(r['host_temp_bytes'])}; matmul FLOPs per device "
          f"{r['flops_per_device']:.3g} = {r['flops_ratio']:.3f}x no remat's")
  if "roofline" in r:
    rf = r["roofline"]
    line += f"; step >= {rf['bound_s'] * 1e3:.1f} ms ({rf['bound_by']}-bound)"
  return line


def check_fits(plan: dict, device_memory_gb: float) -> None:
  """PlanExceeded naming the largest consumers when the peak estimate exceeds the budget."""
  peak = plan["compiled"]["peak_estimate_bytes"]
  if peak <= device_memory_gb * 1e9:
    return
  top = sorted(plan["arrays"], key=lambda a: -a["bytes_per_device"])[:5]
  raise PlanExceeded(
      f"the estimated peak of one device, {peak / 1e9:.3g} GB, exceeds --device_memory_gb="
      f"{device_memory_gb:g}. Largest consumers per device: temporaries (activations, "
      f"gradients) {console.human_bytes(plan['compiled']['temp_size_in_bytes'])}; "
      + "; ".join(f"{a['path']} {console.human_bytes(a['bytes_per_device'])}" for a in top)
      + ". Split them over more devices (fsdp / model axes in their split-dims mappings), "
      "remat more (task.model.remat_policy), add microbatches (task.train.num_microbatches) "
      "or a smaller batch.")


def run_plan(run_cfg, job_log_dir: str, name: str, plan_devices: int | None = None,
             device_memory_gb: float | None = None) -> dict:
  """--mode=plan: prints the plan, writes job_log_dir/plan.json, checks the budget."""
  if plan_devices is not None and jax.device_count() != plan_devices:
    raise RuntimeError(f"expected {plan_devices} emulated devices, have {jax.device_count()}")
  plan = make_plan(run_cfg, name)
  for line in format_plan(plan):
    console.say("%s", line)
  path = os.path.join(job_log_dir, "plan.json")
  if jax.process_index() == 0:
    with open(path, "w") as f:
      json.dump(plan, f, indent=1)
  console.say("Wrote %s", path)
  if device_memory_gb is not None:
    check_fits(plan, device_memory_gb)
  return plan
