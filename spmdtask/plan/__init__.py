"""`--mode=plan`: a job compiled for its target (emulated CPU devices, a TPU topology through
libtpu, a GPU through XLA:GPU) and never run: memory per device, FLOPs and HBM bytes per step,
collectives, a roofline bound, what remat costs.

- `planner` builds the plan, `printout` formats it, `targets` and `chips` say what it is for;
- `xla_cost`, `hlo`, `buffers`, `flops`, `roofline`, `remat_cost` read compiled programs (and
  `buffers` XLA:TPU's out-of-memory message); `oom` says what fills a chip that a plan
  overflows; `stage_roofline` bounds a step of several programs on disjoint submeshes (an
  MPMD pipeline's stages) by its busiest stage. Pure where they can be.

Imports: core, `task` and the top-level shared modules.
"""
