"""spmdtask: train JAX models with SPMD and MPMD parallelism.

The top level holds the entry points and what every package shares:
- shared by all (import nothing else of spmdtask): `errors` (the exceptions that become exit
  codes), `fs` (paths, local or gs://), `console` (what a person reads) and `native_output`
  (C++ libraries' output kept off the console);
- the experiment's schema: `task` (Task, TrainParams, DecodeParams; over core's contracts);
- the entry points: `main` (the binary), `registry` and `experiment` (registered fiddle
  configs), `overrides` (`--fdl_set`).

The packages, lowest first; a package imports only from those before it (`tests/test_layout.py`
checks every import):
  core/       the SPMD core: mesh, the partitioner, train state, layouts, steps, and the model,
              program, strategy and input contracts
  layers/     model families (imported by configs/ only)      inputs/   data feeds
  task        (top-level module) the experiment's schema
  plan/       --mode=plan: compile for a target, memory, FLOPs, collectives, rooflines
  pipeline/   execution strategies beyond the scan: the SPMD stage pipeline, schedules, MPMD
  run/        a job: the train loop, checkpoints, evaluation, decoding, summaries
  main        argv -> experiment -> program -> run or plan
"""
