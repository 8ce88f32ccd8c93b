"""The SPMD core: what every program, strategy and tool stands on.

- `mesh` (mesh params -> jax Mesh), `sharding` (the pure partitioner: split-dims mappings ->
  PartitionSpecs, uneven dims padded), `train_state`, `layouts` (a model's layouts under a
  strategy), `memory` (bytes per array), `steps` (the pure step functions and `partition`, the
  one place that wraps `jax.jit`), `remat` (policies by name), `checks` (config field checks);
- the contracts: `model` (the seam to model families), `strategy` (how the layer stack runs),
  `program` (a task on devices, as the loop, plan and checkpoints see it), `host_input` (which
  rows a process reads) and `global_batch` (host batches -> global arrays);
- the default strategy and its program: `scan`, `spmd_program`.

Imports: the top-level shared modules (`errors`) only; nothing from layers, inputs, plan,
pipeline, run or the entry points.
"""
