"""`task.pipeline = MpmdConfig(...)`: the MPMD pipeline as an execution strategy.

The layer stack is cut by layer index into `len(layer_cuts) + 1` groups (parts); part p
runs on stage `schedule.owner(p)` (with one chunk per stage, part p on stage p). The
embedding goes with the first part, the head and loss with the last. Every stage has
its own submesh over `task.mesh_axis_names`; devices are assigned in order, stage 0
first, so submeshes are disjoint and must use exactly the devices of the job.

  MpmdConfig(layer_cuts=(1,), submesh_shapes=((2, 1, 2), (4, 1, 1)), schedule="1f1b",
             num_microbatches=4)
  # 4 layers: layer 0 (+ embedding) on devices 0-3 as data 2 x model 2,
  #           layers 1-3 (+ head, loss) on devices 4-7 as data 4.

In the model each group is its own scan `block_<g>` `[L_g, ...]`, with a `stage_boundary`
between groups at the top level (outside scan and remat), where `mpmd.split` cuts the
traced loss; `layout_maps` joins the groups into the canonical `block` `[L, ...]`.

`layer_cuts="auto"` lets `build_program` choose the cuts (`stages.plan`, through
`auto_cuts`) from the compiled train cost of the embedding, one layer and the head on each
stage's submesh; the program's `StagePlan` then holds this config with those cuts, which
everything after it uses (model, layout maps, checkpoint metadata, the plan).
"""
import dataclasses

import jax
import jax.numpy as jnp

from spmdtask.core.model import LayoutMap
from spmdtask.errors import ConfigError
from spmdtask.pipeline.mpmd import auto_cuts, program, stages
from spmdtask.pipeline.mpmd.split import stage_boundary
from spmdtask.core.strategy import StackFacts

BLOCK = "block"


@dataclasses.dataclass(frozen=True)
class MpmdConfig:
  """An MPMD pipeline: per-stage programs on submeshes, run by a schedule.

  Attributes:
    layer_cuts: sorted layer indices where a new part starts (uneven parts allowed):
      `(1,)` on 4 layers = layer 0 | layers 1-3. Parts = len(layer_cuts) + 1 must equal
      stages x num_chunks. Or "auto" (num_chunks=1): the cuts that minimise the slowest
      stage's compiled per-device FLOPs (embedding and head included) on the submeshes.
    submesh_shapes: one mesh shape per stage over task.mesh_axis_names (stages may
      differ); their device counts must add up to the job's devices.
    schedule: a schedule generator name (gpipe, 1f1b, interleaved_1f1b, zb_h1, or with
      num_chunks=2 the V schedules zb_v and dualpipe_v), or the path of a schedule file:
      spmdtask's text form (pipeline.schedules.schedule), or a torch.distributed.pipelining
      compute_only `.csv` (one row per rank, cells like `0F0`, `2I1`; pipeline.schedules.torch_csv).
      A file's stages, chunks and microbatches must match this config; it is validated.
    num_microbatches: M, the pipeline's microbatches: the global batch splits into M
      equal microbatches that the schedule interleaves (not gradient accumulation, which
      is task.train.num_microbatches and must stay 1 here).
    num_chunks: parts per stage (interleaved_1f1b needs >= 2); 1 otherwise.
  """
  layer_cuts: tuple[int, ...] | str
  submesh_shapes: tuple[tuple[int, ...], ...]
  schedule: str = "1f1b"
  num_microbatches: int = 4
  num_chunks: int = 1

  @property
  def num_stages(self) -> int:
    return len(self.submesh_shapes)

  # ---- the execution-strategy contract (spmdtask.core.strategy.Strategy) ---------------------

  def validate(self, stack: StackFacts) -> None:
    """Cuts within the stack (or "auto" that can cut it), and a schedule that fits the
    stages and chunks."""
    if stages.is_auto(self.layer_cuts):
      auto_cuts.check(self, stack.num_layers)
    else:
      stages.layer_groups(self.layer_cuts, stack.num_layers)
    stages.make_schedule(self)

  def apply_stack(self, runner, x: jax.Array, side: tuple, keys) -> jax.Array:
    """Each group of layers scanned as `block_<g>`, a stage boundary between groups."""
    for g, (start, end) in enumerate(stages.layer_groups(self.layer_cuts,
                                                               runner.num_layers)):
      if g:
        x = stage_boundary(x)
      x = runner.scan_layers(x, side, keys, start=start, length=end - start,
                             name=f"{BLOCK}_{g}")
    return x

  def layout_maps(self, path) -> tuple[LayoutMap, ...]:
    return (LayoutMap(tuple(path), join_groups, lambda tree: split_groups(tree, self.layer_cuts)),)

  def build_program(self, task, example_local_batch, devices):
    if task.objective is not None:
      raise ConfigError(
          f"task.objective={type(task.objective).__name__} cannot run under the MPMD "
          "pipeline (task.pipeline=MpmdConfig): its per-stage programs compute only the "
          "model's own LM loss. Set task.pipeline=None (the scan) for this objective.")
    return program.setup(task, self, example_local_batch, devices)

  def facts(self) -> dict:
    return {"strategy": "mpmd", **dataclasses.asdict(self)}

  def summary(self) -> str:
    return stages.summary(self, stages.make_schedule(self))


def join_groups(tree: dict) -> dict:
  """{block_0: [L0, ...], block_1: [L1, ...], ...} -> {block: [L0 + L1 + ..., ...]}."""
  groups = [tree[f"{BLOCK}_{g}"] for g in range(len(tree))]
  return {BLOCK: jax.tree.map(lambda *xs: jnp.concatenate(xs), *groups)}


def split_groups(tree: dict, layer_cuts) -> dict:
  """{block: [L, ...]} -> {block_<g>: layers [start_g, end_g)} (inverse of `join_groups`)."""
  num_layers = jax.tree.leaves(tree[BLOCK])[0].shape[0]
  return {f"{BLOCK}_{g}": jax.tree.map(lambda a, s=start, e=end: a[s:e], tree[BLOCK])
          for g, (start, end) in enumerate(stages.layer_groups(layer_cuts, num_layers))}
