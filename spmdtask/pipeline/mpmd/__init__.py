"""MPMD: one program per stage part, each jitted on its stage's own submesh, run by a schedule.

Setup, in order (`program.setup`: one pass, each step reading the plan and what came before):
  config       `task.pipeline = MpmdConfig(...)`: the strategy (cuts, submeshes, schedule)
  stages       `stages.plan` -> `StagePlan`, every decision once: submeshes and the full mesh,
               microbatch count and size, the model checked on each submesh, the cuts
               ("auto" resolved through auto_cuts), layer groups, the schedule, part stages
  auto_cuts    `layer_cuts="auto"`: cuts from compiled per-layer costs (`schedules.balance`)
  (program)    the models and state layouts under the plan's cuts
  split        stage markers; a traced loss sliced into per-part functions
  backward_split  a part's backward split into input (I) and weight (W) gradients
  parts        stage specs, parts, the global dispatch order
  local        one data-parallel gradient reduction per step (per-device accumulation)
  programs     a part's jitted fwd / bwd / I / W programs on its submesh
  pipeline     `Pipeline`: the split loss, its parts and programs, run by `runner`
  runner       walks the schedule: F / B / I / W actions, sends, the live-bytes meter
  transfers    arrays between submeshes: one batched copy, or collectives across processes
  step         the train step: schedule, global-norm clipping, per-stage optimizer updates
  feed         what each process reads and places of a global batch
  canonical    the live per-stage state <-> the canonical (checkpoint) layout
  program      `MpmdProgram`: the `spmdtask.core.program` contract for all of the above; it
               holds the plan (its config, layer groups, microbatches: what `report` reads)
Around it: `report` (console lines, plan lowerings), `compiled` (compiled backward programs
for plans and tests), `stage_costs` (per-stage costs on a chip, for the TPU simulation).

Imports: core, the top-level shared modules, `pipeline.schedules` and plan (XLA costs).
"""
