"""What every program builder shares: the models of a strategy, layout maps applied to a
whole train state, restore targets, and the facts checkpoint metadata records."""
from typing import Any, Callable, NamedTuple

import jax
from jax.sharding import Mesh

from spmdtask.core import sharding
from spmdtask.errors import ConfigError
from spmdtask.core.model import LayoutMap, Model, Stacked


class Lowering(NamedTuple):
  """One compiled program of a train step, as `--mode=plan` compiles it.

  name: e.g. 'train step' or 'stage 1 part 1 forward'; stage: the pipeline stage it runs
  on (None: every device); mesh: the devices it runs on; lower: `() -> jax Lowered` (from
  ShapeDtypeStructs: nothing is allocated); calls_per_step: how often one step runs it;
  fn, args: the jitted function and its abstract args, for tracing it (e.g. FLOPs of the
  traced step), where the program exposes them.
  """
  name: str
  stage: int | None
  mesh: Mesh
  lower: Callable[[], Any]
  calls_per_step: int = 1
  fn: Callable[..., Any] | None = None
  args: tuple = ()


def sharded_structs(mesh: Mesh, shapes, specs):
  """ShapeDtypeStructs of `shapes` carrying NamedShardings of `specs` on `mesh` (restore
  and lowering targets)."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=jax.sharding.NamedSharding(mesh, s)),
      shapes, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def mesh_facts(mesh: Mesh) -> dict:
  """The mesh's axis names and shape, JSON-able."""
  return {"mesh_axis_names": list(mesh.axis_names),
          "mesh_shape": [int(mesh.shape[a]) for a in mesh.axis_names]}


def layout_facts(mesh: Mesh, task, strategy) -> dict:
  """Checkpoint metadata of a program: the mesh, the strategy and both microbatch knobs
  under names that say which is which."""
  facts = strategy.facts()
  return {**mesh_facts(mesh), "pipeline": facts,
          "grad_accumulation_microbatches": int(task.train.num_microbatches),
          "pipeline_microbatches": facts.get("num_microbatches"),
          "canonical": "logical arrays, layers stacked [L, ...]"}


def apply_layout_maps(tree, maps: tuple[LayoutMap, ...], to_canonical: bool):
  """Converts every subtree under a map's path (params and the opt stats that mirror them)."""
  if not maps:
    return tree

  def match(path):
    keys = sharding.path_keys(path)
    return next((m for m in maps if keys[-len(m.path):] == m.path), None)

  def convert(path, node):
    m = match(path)
    if m is None:
      return node
    return (m.to_canonical if to_canonical else m.from_canonical)(node)

  return jax.tree_util.tree_map_with_path(convert, tree,
                                          is_leaf=lambda path, _: match(path) is not None,
                                          is_leaf_takes_path=True)


def strategy_models(task, execution: Any) -> tuple[Model, Model]:
  """(the model run by `execution`, the same model unpipelined: the canonical one).

  `execution` is what the model's stack runs (None: its own scan). Raises ConfigError for
  a model outside the contract, a pipeline on a model with no layer stack, or a model
  whose `execution` was set by hand.
  """
  model = task.model
  if not isinstance(model, Model):
    raise ConfigError(
        f"task.model ({type(model).__name__}) does not implement spmdtask.core.model.Model "
        "(loss, work_per_example, validate). Implement that protocol.")
  if not isinstance(model, Stacked):
    if execution is not None:
      raise ConfigError(
          f"task.pipeline is set, but task.model ({type(model).__name__}) has no layer stack "
          "to pipeline (spmdtask.core.model.Stacked). Set task.pipeline=None.")
    return model, model
  if getattr(model, "execution", None) is not None:
    raise ConfigError("task.model.execution is set by the framework from task.pipeline; set "
                      "task.pipeline instead and leave task.model.execution=None.")
  return model.with_pipeline(execution), model


def check_microbatches(task, global_size: int, mesh_shape) -> int:
  """task.train.num_microbatches (gradient accumulation); ConfigError if it does not split
  the global batch into equal microbatches over the data axes."""
  m = task.train.num_microbatches
  data = sharding.shards(task.batch_axes() or None, mesh_shape)
  if not isinstance(m, int) or m < 1 or global_size % m or (global_size // m) % data:
    raise ConfigError(
        f"task.train.num_microbatches={m!r} does not split the global batch of {global_size} "
        f"into equal microbatches that divide over the data axes {task.batch_axes()} "
        f"({data} shards): use a divisor M of {global_size} with {global_size}/M a multiple "
        f"of {data} (1 = no gradient accumulation).")
  return m
