"""What every program builder shares: the models of a strategy, layout maps applied to a
whole train state, restore targets, and the facts checkpoint metadata records."""
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax.sharding import Mesh

from spmdtask.core import sharding
from spmdtask.errors import ConfigError
from spmdtask.core.model import Buffered, LayoutMap, Model, Stacked


class Lowering(NamedTuple):
  """One compiled program of a train step, as `--mode=plan` compiles it.

  name: e.g. 'train step' or 'stage 1 part 1 forward'; stage: the pipeline stage it runs
  on (None: every device); mesh: the devices it runs on; lower: `() -> jax Lowered` (from
  ShapeDtypeStructs: nothing is allocated); calls_per_step: how often one step runs it;
  fn, args: the jitted function and its abstract args, for tracing it (e.g. FLOPs of the
  traced step), where the program exposes them. loop: a program's data-dependent loop
  (a sampler's decode loop, run until its samples stop) as a plan assumes it (`Loop`).
  """
  name: str
  stage: int | None
  mesh: Mesh
  lower: Callable[[], Any]
  calls_per_step: float = 1
  fn: Callable[..., Any] | None = None
  args: tuple = ()
  loop: "Loop | None" = None


class Loop(NamedTuple):
  """A program's data-dependent loop as a plan assumes it: its trips and what they count
  (`note`); the HBM bytes per device its program must read: each trip, the weights it uses
  (`weights_bytes`) and the cache (`cache_bytes`); once, before the loop, the weights as
  the prefill reads them (`prefill_bytes`; None: `weights_bytes`)."""
  trips: int
  note: str
  weights_bytes: float
  cache_bytes: float
  prefill_bytes: float | None = None


def weight_data_axes(program) -> tuple[str, ...]:
  """The data axes (of size > 1) that split some weight: FSDP's. A decode step's rows are
  whole over them (`Decodable.whole_rows`): each device multiplies its own weight shard by
  every row and the partial sums are reduced, instead of gathering each layer's weights for
  its few rows at every token; the prefill (many rows) keeps FSDP's gathers."""
  mesh_shape = dict(program.mesh.shape)
  specs = jax.tree.leaves(program.layout.split.params,
                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  split = {a for spec in specs for e in spec for a in sharding.entry_axes(e)}
  return tuple(a for a in program.task.batch_axes() if mesh_shape[a] > 1 and a in split)


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
  if execution is None:  # its own scan: the model is its canonical one (one layout trace)
    return model, model
  return model.with_pipeline(execution), model


def check_microbatches(task, global_size: int, mesh_shape) -> int:
  """task.train.num_microbatches (gradient accumulation), checked by `check_batch_split`
  against the program's mesh."""
  check_batch_split(global_size, task.train.num_microbatches, "task.train.num_microbatches",
                    task.batch_axes(), [("task.ici_mesh_shape", mesh_shape)])
  model = task.model
  if (task.train.num_microbatches > 1 and isinstance(model, Buffered)
      and model.has_buffers() and not model.buffers_accumulate()):
    raise ConfigError(
        f"task.train.num_microbatches={task.train.num_microbatches}: this model's buffers "
        "(delayed fp8 scaling's amax histories, task.model.quantization_scaling='delayed') "
        "take a step's maxima through their gradient slots, which microbatches sum; set "
        "task.train.num_microbatches=1 or task.model.quantization_scaling='current'.")
  return task.train.num_microbatches


TRAIN_BATCH = "datasets['train'].batch_size"  # every mode sets its program up on these rows


def check_batch_split(global_size: int, num_microbatches, microbatches_field: str,
                      batch_axes, meshes: Sequence[tuple[str, Any]]) -> int:
  """The microbatch size: the global train batch of `global_size` rows in `num_microbatches`
  (config field `microbatches_field`) equal microbatches whose rows divide over the data
  axes `batch_axes` of every mesh in `meshes` ((config field that shapes it, mesh shape)).
  The one check of a batch split (SPMD gradient accumulation, MPMD stages); ConfigError
  naming datasets['train'].batch_size, the microbatches field and the mesh field, with a
  batch size that works."""
  m = num_microbatches
  if not isinstance(m, int) or isinstance(m, bool) or m < 1:
    raise ConfigError(
        f"{microbatches_field}={m!r} must be a positive integer: the equal microbatches "
        f"{TRAIN_BATCH}={global_size} is split into (1 = no split).")
  shards = [(field, sharding.shards(tuple(batch_axes) or None, shape)) for field, shape in meshes]
  unit = m * math.lcm(*(d for _, d in shards))
  if global_size % unit == 0:
    return global_size // m
  if global_size % m:
    why = f"does not split into {microbatches_field}={m} equal microbatches"
  else:
    field, d = next((f, d) for f, d in shards if (global_size // m) % d)
    why = (f"split into {microbatches_field}={m} microbatches gives {global_size // m} rows each, "
           f"which do not divide over the data axes {tuple(batch_axes)} of {field} "
           f"({d} shards)")
  fields = " or ".join(dict.fromkeys(f.split("=")[0] for f, _ in shards))
  raise ConfigError(
      f"{TRAIN_BATCH}={global_size} {why}. Make the batch size a multiple of {unit} (e.g. "
      f"--fdl_set=\"{TRAIN_BATCH}={-(-global_size // unit) * unit}\"), or change "
      f"{microbatches_field} or the data axes' sizes in {fields}.")
