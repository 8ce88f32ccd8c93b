"""Pipeline schedules as data: per-stage ordered lists of actions on microbatches.

A schedule is what each stage (device group) does, in order. Sends and receives are not
written: they follow from the dependencies between actions (see `virtual_stage`).

Actions:
  F(m, c)  forward of microbatch m through chunk c of this stage.
  B(m, c)  full backward (input grads and weight grads together).
  I(m, c)  backward for the input grads only (zero-bubble split); W(m, c) the weight grads.

The model is cut into `num_stages * num_chunks` consecutive parts (virtual stages). Stage s
holds `num_chunks` of them; `placement` says which:
  'loop': chunk c of stage s is part c*p + s (interleaved 1F1B, circular);
  'v':    chunk 0 of stage s is part s, chunk 1 is part 2p - 1 - s (ZB-V, DualPipeV).
"""
import dataclasses

KINDS = ("F", "B", "I", "W")
PLACEMENTS = ("loop", "v")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
  """One unit of work on one stage: `kind` of `microbatch` through the stage's `chunk`."""
  kind: str
  microbatch: int
  chunk: int = 0

  def __str__(self) -> str:
    return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per-stage ordered actions. `actions[s]` is stage s's program, run front to back."""
  num_stages: int
  num_microbatches: int
  actions: tuple[tuple[Action, ...], ...]
  num_chunks: int = 1
  placement: str = "loop"

  def virtual_stage(self, stage: int, chunk: int) -> int:
    """The model part (0 .. num_stages*num_chunks - 1) that `chunk` of `stage` runs."""
    p = self.num_stages
    if self.placement == "v":
      return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage

  def owner(self, virtual: int) -> tuple[int, int]:
    """Inverse of `virtual_stage`: (stage, chunk) that runs model part `virtual`."""
    p = self.num_stages
    if self.placement == "v":
      return (virtual, 0) if virtual < p else (2 * p - 1 - virtual, 1)
    return virtual % p, virtual // p
