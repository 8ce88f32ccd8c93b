"""The loop's seam: a `Hook` runs around train steps; `Fetched` is what it is shown."""
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Fetched:
  """Metrics of the steps since the last fetch, and the throughput over them."""
  step: int                     # the last step in `metrics`
  metrics: list[dict]           # one dict of replicated scalars per step, as floats
  rates: dict[str, float]       # steps_per_sec, examples_per_sec, tokens_per_sec, mfu
  #                               (+ target_tokens_per_sec where the data has target masks)


class Hook:
  """Runs around train steps. Every method is optional; `step` counts completed steps."""

  def attach(self, program: Any, record: Any) -> None:
    """Called once, before `begin`, with the `core.program.Program` the steps run (its task,
    mesh and live layout) and the run's `goodput_events.Recorder` (a hook whose work is not
    a step's says so: `with record.phase('eval')`): for a hook made before them, as
    `loop.train`'s `hooks` are."""

  def begin(self, step: int) -> None:
    """Called once before the first step runs; `step` steps are already done."""

  def wants_metrics(self, step: int, last: bool) -> bool:
    """True if `on_metrics` should see the metrics up to `step` (forces a host fetch)."""
    return False

  def on_metrics(self, fetched: Fetched, last: bool) -> None:
    pass

  def after_step(self, step: int, state: Any, last: bool) -> None:
    pass

  def close(self) -> None:
    pass
