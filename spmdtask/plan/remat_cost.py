"""What a remat policy costs a compiled train step, per chip: the plan's `remat` section.

  device temporaries   memory_analysis().temp_size_in_bytes (activations kept for the
                       backward, gradients, scratch);
  host temporaries     memory_analysis().host_temp_size_in_bytes: activations offloaded to
                       the host's pinned memory (`*_offloaded` presets; 0 where the backend
                       keeps them on the device, e.g. XLA:CPU);
  host transfers       2 x host temporaries: each offloaded activation goes to the host in
                       the forward and comes back once in the backward;
  recompute FLOPs      the step's matmul FLOPs (spmdtask.plan.flops, loops multiplied out) over
                       those of the same step without remat (traced: the no-remat variant
                       is never compiled); of which inside Pallas kernels (splash
                       attention's forward, backward and recompute), which XLA's cost
                       analysis of the compiled step does not see.
The host transfers are a term of the plan's roofline (spmdtask.plan.roofline: host_link).
"""
import dataclasses

import jax

from spmdtask.plan import flops
from spmdtask.core import program as program_lib
from spmdtask.task import Task


def without_remat(task: Task) -> Task:
  """`task` with every remat policy (the model's, the SPMD pipeline's) set to None."""
  model = task.model
  if any(f.name == "remat_policy" for f in dataclasses.fields(model)):
    model = model.clone(remat_policy=None)
  pipeline = task.pipeline  # the SPMD pipeline has a remat_policy of its own
  if pipeline is not None and any(f.name == "remat_policy" for f in dataclasses.fields(pipeline)):
    pipeline = dataclasses.replace(pipeline, remat_policy=None)
  return dataclasses.replace(task, model=model, pipeline=pipeline)


def step_flops(lowering) -> tuple[float, float]:
  """Matmul FLOPs of one train step (a `layouts.Lowering` with its fn and abstract args),
  all devices, and those of them inside Pallas kernels."""
  with jax.set_mesh(lowering.mesh):
    closed = jax.make_jaxpr(lowering.fn)(*lowering.args)
  return flops.closed_flops(closed), flops.closed_flops(closed, kernels_only=True)


def host_transfer_bytes(memory_analysis) -> int:
  """Bytes a device moves over its host link per step for offloaded activations: each goes
  to the host in the forward and comes back once in the backward."""
  return 2 * int(getattr(memory_analysis, "host_temp_size_in_bytes", 0))


def report(memory_analysis, flops_per_device: float, no_remat_flops_per_device: float,
           kernel_flops_per_device: float = 0.0) -> dict:
  """The remat section of a plan (see the module doc); JSON-able.

  Args:
    memory_analysis: the compiled step's `memory_analysis()`, or None where XLA refused
      to compile it (out of memory): then FLOPs only.
    flops_per_device: matmul FLOPs of the step per device; no_remat_flops_per_device: the
      same step's without remat; kernel_flops_per_device: those of the step inside Pallas
      kernels.
  """
  out = {"flops_per_device": flops_per_device, "kernel_flops_per_device": kernel_flops_per_device,
          "no_remat_flops_per_device": no_remat_flops_per_device,
          "flops_ratio": flops_per_device / max(no_remat_flops_per_device, 1.0)}
  if memory_analysis is not None:
    out.update(device_temp_bytes=int(memory_analysis.temp_size_in_bytes),
               host_temp_bytes=int(getattr(memory_analysis, "host_temp_size_in_bytes", 0)),
               host_transfer_bytes=host_transfer_bytes(memory_analysis))
  return out


def plan_section(program, example_local_batch, lowering, compiled) -> dict:
  """`report` for a compiled SPMD train step (`lowering`, with its fn and abstract args):
  traces it, and the same task without remat on the same devices, for FLOPs."""
  base = program_lib.setup(without_remat(program.task), example_local_batch,
                           devices=list(program.mesh.devices.flat))
  n = program.mesh.devices.size
  total, kernels = step_flops(lowering)
  return report(compiled and compiled.memory_analysis(), total / n,
                step_flops(base.lowerings(example_local_batch)[0])[0] / n, kernels / n)
