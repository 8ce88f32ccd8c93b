"""Execution strategies beyond the default scan (`spmdtask.core.scan`).

- `spmd`: the SPMD stage-dim pipeline, one program, `shard_map` over a `stage` axis (GPipe,
  circular);
- `schedules/`: pipeline schedules as data (per-stage action lists), their generators, files,
  simulator and stage balancing; pure, no JAX;
- `mpmd/`: one program per stage part on its own submesh, run by any schedule.

Imports: core, the top-level shared modules; mpmd/ also schedules/ and plan/ (per-stage costs).
"""
