"""The default execution strategy: the layer stack as one remat'd `nn.scan` (no pipeline).

`task.pipeline=None` means this strategy; `Scan()` states it explicitly. One SPMD program
(`spmd_program`) runs the task; the live layout is the canonical one.
"""
import dataclasses

from spmdtask.core import spmd_program
from spmdtask.core.strategy import StackFacts


@dataclasses.dataclass(frozen=True)
class Scan:
  """The layers scanned in one program, each rematerialized under the model's remat_policy."""

  def validate(self, stack: StackFacts) -> None:
    del stack  # a scan runs any stack on any mesh

  def apply_stack(self, runner, x, side, keys):
    return runner.scan_layers(x, side, keys)

  def layout_maps(self, path):
    del path
    return ()

  def build_program(self, task, example_local_batch, devices):
    return spmd_program.build(task, self, example_local_batch, devices)

  def facts(self) -> dict:
    return {"strategy": "scan"}

  def summary(self) -> str:
    return "strategy scan (one program, layers scanned)"

