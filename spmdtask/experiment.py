"""Experiment base: what a registered config provides."""
from typing import Protocol, runtime_checkable

import fiddle as fdl

from spmdtask import task as task_lib


class Experiment:
  """An experiment: Task params plus its datasets, all as fiddle configs.

  Subclasses override `task()` and `datasets()`; `decode_datasets()` is optional.
  Configs stay unbuilt here so that the command line can override any field.
  `group` places it in --list_experiments (a key of spmdtask.registry.GROUPS; subclasses
  inherit their base's), and its docstring's first line says what it is for.
  """
  group = "other"

  def task(self) -> fdl.Config[task_lib.Task]:
    """The model, mesh and train params."""
    raise NotImplementedError(f"{type(self).__name__} must define task().")

  def datasets(self) -> dict[str, fdl.Config]:
    """Input configs by name. 'train' is the training input; any other is an eval set."""
    raise NotImplementedError(f"{type(self).__name__} must define datasets().")

  def decode_datasets(self) -> dict[str, fdl.Config]:
    """Prompt inputs for --mode=decode, by name. None by default."""
    return {}


@runtime_checkable
class ForFamily(Protocol):
  """An experiment over any imported family's model (configs/stages.py): `--family` (an
  import's model_overrides.txt, or --init_from's) picks the family."""

  def for_family(self, family: str | None) -> Experiment:
    """This experiment on `family`'s model; ConfigError naming --init_from where None."""

  def with_lora(self, cfg: fdl.Config, rank: int) -> None:
    """`--lora_rank`: new LoRA adapters of `rank` on `cfg`'s model (its fields resolved)."""


def run_config(experiment: Experiment) -> fdl.Config[task_lib.RunConfig]:
  """The root config of a run: `task`, `datasets`, `decode_datasets`."""
  return fdl.Config(task_lib.RunConfig, task=experiment.task(), datasets=experiment.datasets(),
                    decode_datasets=experiment.decode_datasets())
