"""The registered experiment whose model is exactly a HF config's architecture (a
published size, e.g. `llama.Llama32_1B`): that experiment decodes or trains an import as
it is, with its own mesh and batch.
"""
import dataclasses

import fiddle as fdl

from spmdtask import registry
from spmdtask.hf import deepseek, families


def published_experiment(cfg: dict) -> str | None:
  """`MODULE.NAME` (MODULE: the module of the family's import experiment), or None."""
  want, exp = families.model_fields(cfg), families.experiment(cfg)
  module = "configs." + exp.split(".")[0] + "."
  for name in registry.names():
    if not name.startswith(module) or name.endswith("." + exp.split(".")[-1]):
      continue
    model = fdl.build(registry.get(name)().task().model)
    got = {k: getattr(model, k) for k in want}
    if got["rope_scaling"] is not None:
      got["rope_scaling"] = dataclasses.asdict(got["rope_scaling"])
    got.update(deepseek.sub_fields(got, want))  # moe and mla as dicts
    if got == want:
      return name.removeprefix("configs.")
  return None
