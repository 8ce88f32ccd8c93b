"""The frozen reference params of an objective that needs them (`Reference.PARAMS`).

Which params: the objective's own reference checkpoint (`reference_dir()`, e.g.
`task.objective.reference_checkpoint_dir`) if set, else `task.train.init_checkpoint_dir`'s
latest params (where the policy started), else the fresh init (deterministic from
`task.train.seed`). The rule reads the config, never the train state, so a resumed job gets
the SAME reference it started with, not its current params.
"""
from typing import Protocol, runtime_checkable

import jax

from spmdtask import fs
from spmdtask.core import sharding
from spmdtask.errors import ConfigError
from spmdtask.run import checkpoint_io, lora_base


@runtime_checkable
class HasReferenceDir(Protocol):
  """An objective with a field naming its reference checkpoint (a job dir, or None)."""

  def reference_dir(self) -> tuple[str, str | None]:
    """(the field's config path, its value)."""


def attach(task, program):
  """`program` with its reference params where it needs them (`program.needs_reference`),
  else `program` itself. Every process calls it."""
  if not program.needs_reference:
    return program
  return program.with_reference(canonical_params(task, program))


def canonical_params(task, program):
  """The reference's canonical params on `program.mesh` (module doc). ConfigError (one
  paragraph naming the field) when the checkpoint is missing or does not match the model."""
  field, directory = (task.objective.reference_dir() if isinstance(task.objective,
                                                                    HasReferenceDir)
                      else ("", None))
  if directory is None:
    field, directory = "task.train.init_checkpoint_dir", task.train.init_checkpoint_dir
  if directory is None:
    return program.to_canonical(program.init()).params
  return read_params(directory, program, field)


def read_params(job_dir: str, program, field: str):
  """The params of job `job_dir`'s latest checkpoint, as the program's canonical params (a
  LoRA job's with its adapters merged in: `lora_base.read`)."""
  fs.check_reachable(job_dir, field)
  directory = checkpoint_io.checkpoint_dir(job_dir)
  step = checkpoint_io.pick_step(directory, job_dir, None)
  mngr = checkpoint_io.manager(directory, read_only=True)
  try:
    own = checkpoint_io.read_meta(mngr, step).get(checkpoint_io.HELD_KEY) is None
    saved = mngr.item_metadata(step)["params"]
  finally:
    mngr.close()
  want = program.canonical_targets().params
  if own:  # a LoRA job's adapters alone are checked against its base when it is read
    _check_matches(lora_base.without_adapters(dict(getattr(saved, "tree", saved))), want,
                   field, job_dir)
  return lora_base.merged(want, lora_base.read(job_dir, program, step, field=field)[1])


def _flat(tree) -> dict:
  tree = tree.tree if hasattr(tree, "tree") else tree
  return {sharding.path_str(p): (tuple(x.shape),)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_matches(saved, want, field: str, job_dir: str) -> None:
  count, shown = checkpoint_io.differences(_flat(saved), _flat(want), 10)
  if count:
    raise ConfigError(
        f"{field}={job_dir!r} is not a reference for this model: the reference's params must "
        f"be the model's, by name and shape; {count} differ: {shown}. Point {field} at a "
        "checkpoint of this model's architecture (e.g. the SFT job the policy starts from, "
        "or tools/convert_hf.py --from_hf of the same model), or leave it None to use the "
        "policy's starting params.")
