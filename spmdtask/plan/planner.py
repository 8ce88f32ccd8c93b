"""`--mode=plan`: where a job's memory, FLOPs and communication go, before it runs.

Builds the program on the target's devices (spmdtask.plan.targets: the devices present; with
`--plan_devices=N` N CPU devices emulated in a subprocess; with `--plan_topology=v5e:16x16`
a TPU topology that libtpu compiles for on this CPU machine), lowers and compiles the
train step from ShapeDtypeStructs with their shardings (no array is allocated, no step
runs), and reports:
  target       platform, topology, chips, the chip's published facts (spmdtask.plan.chips);
  arrays       every param and optimizer-state array: logical / padded shape,
               PartitionSpec, bytes per device (spmdtask.core.memory);
  compiled     XLA's memory_analysis of the per-device program, and a peak estimate
               (arguments + outputs - aliased + temporaries);
  FLOPs, HBM   XLA's cost analysis per step, loop bodies counted per trip
               (spmdtask.plan.xla_cost), beside the model's own FLOPs formula;
  remat        device and host (offloaded) temporaries, traced matmul FLOPs against the
               same step's without remat (spmdtask.plan.remat_cost);
  collectives  by kind, with result bytes per device per step (spmdtask.plan.hlo);
  estimate     with a chip's facts, the roofline lower bound of the step time, and the
               tokens/s and MFU ceilings it implies (spmdtask.plan.roofline);
  warnings     (spmdtask.plan.advice) large replicated arrays that could be split, padding, every
               'involuntary full rematerialization' XLA printed while compiling, mapped
               to the param or activation of that shape.
It prints a summary and writes `job_log_dir/plan.json`. The memory budget is
`device_memory_gib`, else the chip's HBM; a peak estimate above it raises `PlanExceeded`
naming the largest consumers. `compiled_report` plans one compiled program; a plan of
several programs (an MPMD pipeline's stage programs) lists each one's memory and takes its
FLOPs, bytes and roofline from all of them, per stage (spmdtask.plan.stage_roofline).
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import jax

from spmdtask import console, fs
from spmdtask.plan import (advice, buffers, hlo, oom, overlap, owners, printout, remat_cost,
                           roofline, stage_roofline, targets, xla_cost, xla_log)
from spmdtask.plan import phases as phase_plan
from spmdtask.core import memory, sharding, train_state
from spmdtask.core import model as model_lib
from spmdtask.core import program as program_lib
from spmdtask.errors import PlanExceeded
from spmdtask.plan.oom import check_fits  # (re-exported: the budget check is oom's)
from spmdtask.core import global_batch

LARGEST = 8  # the largest arrays of each compiled program the plan lists
TICK_SECONDS = 10.0  # how often the console says a compile is still running


def reexec_emulated(num_devices: int, argv: list[str]) -> int:
  """Reruns this command line with `num_devices` emulated CPU devices; its exit status.

  XLA reads the device count when JAX starts, so it takes a fresh process.
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu", SPMDTASK_PLAN_DEVICES=str(num_devices),
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={num_devices}").strip(),
             TF_CPP_MIN_LOG_LEVEL="1")  # keep XLA's warnings: they are part of the plan
  # To this process's terminal (sys.stdout/stderr), not to its captured fds 1 and 2.
  return subprocess.run([sys.executable, "-m", "spmdtask.main"] + argv[1:], env=env,
                        stdout=sys.stdout, stderr=sys.stderr, check=False).returncode


class CompilerOutOfMemory(Exception):
  """The compiler itself refused the program: it needs more memory than the device has
  (XLA:TPU checks this while compiling). The message is the compiler's; `arrays` the
  largest arrays of the optimized program it refused (`plan.buffers.Buffer`s), where the
  compile was asked to keep it (`compile_lowering(..., keep_program=True)`)."""

  def __init__(self, message: str, arrays: list | None = None):
    super().__init__(message)
    self.arrays = arrays or []


def compile_train(program: program_lib.Program, example_local_batch):
  """(compiled train step, XLA's log) of a one-program (SPMD) task; CompilerOutOfMemory."""
  return compile_lowering(program.lowerings(example_local_batch)[0])


def compile_lowering(lowering: program_lib.Lowering, keep_program: bool = False):
  """(compiled program, what XLA printed while compiling it); CompilerOutOfMemory. With
  `keep_program`, XLA writes its optimized program to a scratch folder while it compiles
  (XLA:TPU does so before its memory check), so that a refusal can name its largest
  arrays; the folder is removed."""
  logs: list[str] = []
  with tempfile.TemporaryDirectory() as scratch:
    options = ({"xla_dump_to": scratch, "xla_dump_hlo_as_text": True} if keep_program
               else None)
    try:
      with console.captured_fd2(logs):
        compiled = lowering.lower().compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" in str(e):
        raise CompilerOutOfMemory(str(e), _largest_dumped(scratch)) from None
      raise
  return compiled, "".join(logs)


def _largest_dumped(folder: str) -> list[buffers.Buffer]:
  """The largest arrays of the optimized programs XLA wrote to `folder` (none if none)."""
  out = []
  for name in sorted(os.listdir(folder)):
    if name.endswith("after_optimizations.txt"):
      with open(os.path.join(folder, name)) as f:
        out += buffers.hlo_arrays(f.read(), LARGEST)
  return sorted(out, key=lambda b: -b.bytes)[:LARGEST]


def out_of_memory_report(message: str, arrays=()) -> dict:
  """The plan's part for a step XLA refused: the message's first line, the need and the
  usable HBM it states, and the largest arrays of the program it refused (`arrays`:
  `plan.buffers.Buffer`s)."""
  need, usable = buffers.compiler_need(message) or (None, None)
  out = {"compiler_out_of_memory": message.splitlines()[0],
         "largest_arrays": [b.as_json() for b in arrays]}
  if need is not None:
    out.update(compiler_need_bytes=need, compiler_usable_bytes=usable)
  return out


def largest_arrays(compiled, top: int) -> list[dict]:
  """The `top` largest arrays of a compiled program (`plan.buffers.hlo_arrays`); none where
  its optimized program cannot be read back."""
  try:
    return [b.as_json() for b in buffers.hlo_arrays(compiled.as_text(), top)]
  except jax.errors.JaxRuntimeError:
    return []


def compiled_memory(compiled) -> dict[str, int]:
  """memory_analysis fields of the per-device program, and the peak estimate."""
  ma = compiled.memory_analysis()
  out = {k: int(getattr(ma, k)) for k in (
      "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
      "temp_size_in_bytes", "generated_code_size_in_bytes") if hasattr(ma, k)}
  out["peak_estimate_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
  return out


def compiled_report(compiled, target: targets.Target, num_devices: int, model_flops: float,
                    tokens: float, kernel_flops: float | None = None) -> dict:
  """What one compiled program costs per device per step on `target`'s chips: memory,
  FLOPs and HBM bytes, collectives, and (with the chip's facts) the roofline estimate.

  `num_devices` run the program (a stage's submesh may hold part of the target);
  `model_flops` and `tokens` are the program's per step over all of them;
  `kernel_flops` the FLOPs per device per step inside its Pallas kernels (traced:
  `remat_cost.step_flops`), which XLA's cost analysis does not count, or None where unknown.
  'warnings' says what could not be read from the compiled program.
  """
  n = num_devices
  once = compiled.cost_analysis()
  once = (once[0] if isinstance(once, list) else once) or {}  # XLA:GPU AOT gives None
  notes = []
  unseen_kernels = False  # kernel calls whose FLOPs neither XLA nor a trace counted
  try:
    text = compiled.as_text()
  except jax.errors.JaxRuntimeError as e:
    # A libtpu newer than jaxlib can emit HLO that jaxlib cannot read back (e.g. async
    # instructions of a new arity): keep XLA:TPU's own analysis, say what is missing.
    text = None
    notes.append("XLA's optimized program could not be read back "
                 f"({str(e).splitlines()[0][:160]}; libtpu newer than jaxlib? jax[tpu] pins the "
                 "matching one): FLOPs and HBM bytes are XLA's with loop bodies counted once, "
                 "collectives are not listed.")
  if text is not None:
    step = xla_cost.per_step(text)
    hosts = (target.hosts_of(jax.tree.leaves(compiled.input_shardings)[0].mesh.devices.flat)
             if target.platform == "gpu" else None)
    ops = hlo.collective_ops(text, target.num_slices, hosts)
    kernels = hlo.kernel_calls(text)
    if kernels and kernel_flops is None:
      unseen_kernels = True
      notes.append(f"{kernels} fused kernel call(s) (Pallas, e.g. splash; cuDNN attention): "
                   "XLA's cost "
                   "analysis counts none of their FLOPs, so the compute bound uses the model "
                   "formula's FLOPs where larger (its attention term counts a causal mask's "
                   "visible half only).")
    elif kernels:
      step["flops"] += kernel_flops
      notes.append(roofline.kernel_note(f"{kernels} fused kernel call(s)",
                                        f"{kernel_flops:.3g} per device per step", kernel_flops,
                                        step["flops"]))
  else:
    step = {"flops": float(once.get("flops", 0.0)),
            "bytes accessed": float(once.get("bytes accessed", 0.0)), "loops": []}
    ops = []
  traffic = roofline.collective_traffic(ops)
  report = {
      "compiled": compiled_memory(compiled),
      "flops_per_step": {
          "xla": step["flops"] * n,
          "xla_per_device": step["flops"],
          "xla_loop_bodies_once": float(once.get("flops", 0.0)) * n,
          "model": model_flops,
          "kernels_per_device": kernel_flops or 0.0,
          # Of them, what the kernels state themselves (megablox's cost_estimate): another
          # program's kernels can be charged their own count (tools/compare_maxtext.py).
          "kernels_stated_per_device": xla_cost.stated_kernel_flops(text) if text else 0.0,
          "note": "XLA's cost analysis of the optimized program per device x devices, each "
                  "loop body (scanned layers, microbatches) weighted by its trips, plus the "
                  "traced FLOPs of its Pallas kernels (forward, backward, recompute); the "
                  "model's is 6·N·T + 12·(heads·head_dim) per (query, key) pair the mask "
                  "leaves (causal: position i sees i + 1 keys, a sliding-window layer's "
                  "min(i + 1, window))."},
      "hbm_bytes_per_step_per_device": step["bytes accessed"],
      "loops": step["loops"],
      "collectives": hlo.by_kind(ops),
      "collective_bytes_received_by_kind": roofline.received_by_kind(ops),
      "collective_bytes_received_per_device": traffic,
      **buffers.plan_section(text, LARGEST),
      "warnings": notes}
  if target.chip is not None:
    flops = step["flops"]
    if unseen_kernels:
      flops = max(flops, model_flops / n)
    report["estimate"] = est = roofline.estimate(
        target.chip, flops, step["bytes accessed"], traffic["ici"], traffic["dcn"],
        model_flops / n, tokens, remat_cost.host_transfer_bytes(compiled.memory_analysis()),
        low_flops=overlap.low_precision_flops(text) if text is not None else None)
    if text is not None:  # the schedule's estimate: what the compute hides (plan.overlap)
      report["step_estimate"] = overlap.estimate(
          text, target.chip, flops, step["bytes accessed"], kernel_flops or 0.0,
          target.num_slices, est["step_seconds_lower_bound"], model_flops / n, hosts)
  return report


def make_plan(run_cfg, name: str = "experiment", target: targets.Target | None = None,
              example=None, phases=None) -> dict:
  """The plan of `run_cfg.task`'s train step on `target` (default: the devices present).

  `example`: the process-local train batch to set up with (default: the train input's
  first); `phases(program) -> [Lowering]`: programs a step runs besides the train step
  (GRPO's sampling), each compiled and its memory reported under `phases`.
  """
  task = run_cfg.task
  target = target or targets.present()
  if target.topology is not None:
    targets.check_mesh(target, task.dcn_mesh_shape)
  example = run_cfg.datasets["train"].batch_at(0) if example is None else example
  program = program_lib.setup(task, example, devices=list(target.devices))
  mesh_shape = {a: int(s) for a, s in program.mesh.shape.items()}
  rows = memory.state_rows(program.layout, mesh_shape)
  n = program.mesh.devices.size
  batch_shape = jax.tree.leaves(global_batch.global_shapes(example))[0].shape
  lowerings = program.lowerings(example)
  pairs, programs = [], []
  where = printout.where(target.as_json(), n)
  what = ("the train step" if len(lowerings) == 1
          else f"the train step's {len(lowerings)} programs (its stages' parts)")
  console.say("Planning %s: compiling %s for %s, mesh %s (the console says every %.0f s that it "
              "is still compiling; a pod slice's model takes minutes)", name, what, where,
              mesh_shape, TICK_SECONDS)
  try:
    keep = target.topology is not None  # a chip's compiler may refuse: name what it held
    with console.elapsed(f"compiling {what} for {where}", TICK_SECONDS) as took:
      compiled, log_text = compile_lowering(lowerings[0], keep)
      pairs.append((lowerings[0], compiled))
      for lw in lowerings[1:]:  # MPMD: every part's and stage's program
        c, text = compile_lowering(lw, keep)
        pairs.append((lw, c))
        log_text += text
    console.say("Compiled %s in %s", what, console.duration(took.seconds))
    if len(pairs) > 1:  # the largest per-device peak stands for the step's memory
      programs = [{"name": lw.name, "stage": lw.stage, "devices": lw.mesh.devices.size,
                   "calls_per_step": lw.calls_per_step, "compiled": compiled_memory(c),
                   "largest_arrays": largest_arrays(c, LARGEST)} for lw, c in pairs]
      compiled = max(pairs, key=lambda p: compiled_memory(p[1])["peak_estimate_bytes"])[1]
  except CompilerOutOfMemory as e:  # the whole message to logs/, its first line in the plan
    compiled, log_text = None, f"{e}\n"
    report = out_of_memory_report(str(e), e.arrays)
  remat = None
  if len(lowerings) == 1 and lowerings[0].fn is not None:  # MPMD: per stage instead
    remat = remat_cost.plan_section(program, example, lowerings[0], compiled)
  model_flops = float(program.work.train_flops) * batch_shape[0]
  tokens = float(program.work.tokens) * batch_shape[0]
  if compiled is not None:
    report = compiled_report(compiled, target, n, model_flops, tokens,
                             remat and remat["kernel_flops_per_device"])
  if programs:  # MPMD: the step costs what every stage's programs do (plan.stage_roofline)
    costs = [stage_roofline.measure(lw, c, target.num_slices, target.chip,
                                    target.hosts_of(lw.mesh.devices.flat)) for lw, c in pairs]
    step, stage_plans = stage_roofline.step_report(costs, program.stage_report(pairs),
                                                   target.chip, model_flops, tokens, n)
    report.update(step)
  if "flops_per_step" in report:  # how much of the model's work is attention
    report["flops_per_step"]["model_attention"] = (float(program.work.attention_flops)
                                                   * batch_shape[0])
  for row in report.get("step_estimate", {}).get("top_exposed", []):
    row["what"] = owners.owner(hlo.dims(row["shape"]), rows, batch_shape)
  if remat is not None:
    report["remat"] = remat
  notes = report.get("warnings", []) + report.get("estimate", {}).get("notes", [])
  plan = {"experiment": name, "target": target.as_json(), "num_devices": n, "mesh": mesh_shape,
          "xla_flags": task.xla_flags or {},
          "batch_shape": list(batch_shape),
          "batch_shards": sharding.shards(task.batch_axes() or None, mesh_shape),
          "num_microbatches": task.train.num_microbatches,
          **memory.totals(rows, train_state.adapters_only(program.model)),
          # what the model FLOPs (hence MFU, tokens/s) count: a mixture of experts' are fewer
          "num_active_params": program.work.active_params or memory.totals(rows)["num_params"],
          "state_bytes_total_over_devices": memory.totals(rows)["state_bytes_total"] / n,
          **report,
          # What to change in the config, apart from what the figures rest on (`notes`).
          "warnings": advice.warnings(rows, mesh_shape, xla_log.remat_warnings(log_text),
                                     batch_shape),
          "notes": notes,
          "arrays": [r.as_json() for r in rows]}
  adapters = advice.replicated_adapters(rows, mesh_shape)
  if adapters:
    plan["replicated_adapters"] = adapters
  plan["xla_log"] = target.log + log_text
  plan["strategy"] = program.layout_facts()["pipeline"]
  axis = plan["strategy"].get("stage_axis")
  if axis is not None:
    plan["stages"] = stage_report(rows, mesh_shape, axis)
  if programs:
    plan["programs"] = programs
    plan["stage_plans"] = stage_plans
  plan["describe"] = program.describe()  # after stage_report: MPMD stage costs measured
  if isinstance(program.model, model_lib.Decodable):  # what decoding holds per row of context
    plan["decode_cache"] = {
        "bytes_per_token_per_row": model_lib.cache_bytes_per_token(program.model),
        "max_seq_len": program.model.max_seq_len}
  if phases is not None and compiled is not None:  # GRPO: sampling, scoring (plan.phases)
    with console.elapsed(f"compiling the step's other phases for {where}", TICK_SECONDS):
      plan["phases"] = phase_plan.report(
          phases(program), compiled_memory(compiled), plan.get("estimate"), target.chip,
          target.num_slices, lambda lw: compile_lowering(lw)[0], compiled_memory,
          CompilerOutOfMemory)
    total = phase_plan.rl_step(plan["phases"])
    if total is not None:
      plan["rl_step"] = total
  return plan


def stage_report(rows, mesh_shape, axis: str) -> list[dict]:
  """Per stage of an SPMD pipeline over mesh axis `axis`: its devices and each device's
  state bytes.

  Stacked layers are split over the stage axis; arrays that are not (embedding, head,
  norms) are held by every stage.
  """
  s = mesh_shape.get(axis, 1)
  per_device = sum(r.bytes_per_device for r in rows)
  shared = sum(r.bytes_per_device for r in rows
               if not any(axis in (e if isinstance(e, tuple) else (e,)) for e in r.spec))
  devices = math.prod(mesh_shape.values()) // s
  return [{"stage": i, "devices": devices, "state_bytes_per_device": per_device,
           "bytes_held_by_every_stage": shared}
          for i in range(s)]


def run_plan(run_cfg, job_log_dir: str, name: str, plan_devices: int | None = None,
             device_memory_gib: float | None = None, topology: str | None = None,
             num_slices: int = 1, example=None, phases=None) -> dict:
  """--mode=plan: prints the plan, writes job_log_dir/plan.json (and what XLA / libtpu
  printed, a refusal's whole message included, to job_log_dir/logs/plan_xla.log), checks
  the memory budget: `device_memory_gib` (GiB, 2**30 bytes), else with a topology the
  chip's HBM."""
  if plan_devices is not None and jax.device_count() != plan_devices:
    raise RuntimeError(f"expected {plan_devices} emulated devices, have {jax.device_count()}")
  target = targets.topology(topology, num_slices) if topology else targets.present()
  plan = make_plan(run_cfg, name, target, example, phases)
  xla_log = plan.pop("xla_log")
  for line in printout.format_plan(plan):
    console.say("%s", line)
  path = fs.join(job_log_dir, "plan.json")
  if jax.process_index() == 0:
    fs.write_text(path, json.dumps(plan, indent=1))
    fs.write_text(fs.join(job_log_dir, "logs", "plan_xla.log"), xla_log)
  console.say("Wrote %s", path)
  if device_memory_gib is not None or "compiler_out_of_memory" in plan:
    check_fits(plan, (device_memory_gib or 0.0) * 2**30, task=run_cfg.task)
  elif topology and target.chip is not None:
    check_fits(plan, target.chip.hbm_bytes,
               f"the {target.chip.name} chip's HBM, {console.human_bytes(target.chip.hbm_bytes)} "
               "(--device_memory_gib sets another budget)", task=run_cfg.task)
  return plan
