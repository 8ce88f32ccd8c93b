"""Dry run of a schedule: time line, makespan, bubble and activation memory per stage.

Costs are per microbatch through one whole stage; a chunk action costs 1/v of that:

  F -> forward / v      I -> backward / v      W -> weight / v
  B -> (backward + weight) / v                 (an unsplit backward does both)

An action starts when its stage is free and its inputs exist (`schedule.dependencies`); an
input made on another stage arrives `latency` later. Times are exact `Fraction`s.

Costs may differ per stage (a stage holding the embedding or the head is slower): pass a
sequence of `Costs`, one per stage (each chunk costs 1/v of its stage's, as above), or,
for v > 1, one per part (virtual stage, `schedule.virtual_stage`), each the cost of that
part itself (no 1/v). A hop into a stage (or part) takes that receiver's `latency`.

Activation memory is counted in sets (one microbatch's residuals through one whole stage; a
chunk holds 1/v): F adds a set, and B (or I, for the split backward) releases it. Releasing at
I matches the published accounting: the zero-bubble paper counts a microbatch's activation
memory M_B as freed by its input-gradient pass, and the weight-gradient pass then holds only
the smaller stash of layer inputs and output gradients (its M_W), reported separately here as
`peak_weight_grad_stash` (sets from I to W). With this accounting ZB-H1's peak equals
1F1B's, p on stage 0, as the paper states. A stage's peak depends on its own order only.
"""
import dataclasses
import math
from fractions import Fraction
from typing import Sequence

from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import schedule as schedule_lib
from spmdtask.pipeline.schedules.schedule import Action, Schedule


@dataclasses.dataclass(frozen=True)
class Costs:
  """Per-action costs, per microbatch through one whole stage, and the stage-to-stage latency."""
  forward: float = 1.0
  backward: float = 1.0  # input gradients (I); an unsplit B costs backward + weight
  weight: float = 1.0    # weight gradients (W)
  latency: float = 0.0   # transfer time of an activation or gradient between stages


@dataclasses.dataclass(frozen=True)
class Timed:
  stage: int
  action: Action
  start: Fraction
  end: Fraction


@dataclasses.dataclass(frozen=True)
class Simulation:
  """What `simulate` returns; every per-stage list is indexed by stage."""
  makespan: Fraction
  busy: tuple[Fraction, ...]
  bubble_fractions: tuple[Fraction, ...]        # 1 - busy / makespan
  peak_activations: tuple[Fraction, ...]         # live activation sets, F to B (or I)
  peak_weight_grad_stash: tuple[Fraction, ...]   # sets waiting for W, I to W
  timeline: tuple[tuple[Timed, ...], ...]        # per stage, in run order

  @property
  def bubble_fraction(self) -> Fraction:
    """The largest per-stage bubble fraction."""
    return max(self.bubble_fractions)


def _exact(value: float, name: str) -> Fraction:
  if not isinstance(value, (int, float, Fraction)) or not math.isfinite(value) or value < 0:
    raise ConfigError(f"Pipeline cost {name}={value!r} must be a finite number >= 0.")
  return Fraction(value).limit_denominator(1 << 20)


def durations(costs: Costs, num_chunks: int) -> dict[str, Fraction]:
  """Action kind -> its duration under `costs` (see the module docstring)."""
  f, b, w = (_exact(getattr(costs, n), n) for n in ("forward", "backward", "weight"))
  return {kind: cost / num_chunks for kind, cost in (("F", f), ("I", b), ("W", w), ("B", b + w))}


def part_durations(schedule: Schedule, costs: "Costs | Sequence[Costs]"
                   ) -> dict[tuple[int, int], tuple[dict[str, Fraction], Fraction]]:
  """(stage, chunk) -> (action kind -> duration, latency of a hop into it) under `costs`:
  one Costs for every stage, one per stage, or (v > 1) one per part (module docstring)."""
  S, V = schedule.num_stages, schedule.num_chunks
  if isinstance(costs, Costs):
    costs = (costs,) * S
  costs = tuple(costs)
  if len(costs) == S:
    pick = lambda s, c: (costs[s], V)
  elif len(costs) == S * V:
    pick = lambda s, c: (costs[schedule.virtual_stage(s, c)], 1)
  else:
    raise ConfigError(f"{len(costs)} pipeline Costs for a schedule of {S} stages x {V} chunks: "
                      f"give one Costs, one per stage ({S}) or one per part ({S * V}).")
  out = {}
  for s in range(S):
    for c in range(V):
      cost, share = pick(s, c)
      out[s, c] = durations(cost, share), _exact(cost.latency, "latency")
  return out


def peaks(schedule: Schedule) -> tuple[tuple[Fraction, ...], tuple[Fraction, ...]]:
  """Per stage: (peak live activation sets, peak weight-grad stash), in sets of 1/v chunks."""
  unit = Fraction(1, schedule.num_chunks)
  act_peaks, stash_peaks = [], []
  for row in schedule.actions:
    live = stash = act_peak = stash_peak = Fraction(0)
    for a in row:
      live += unit if a.kind == "F" else -unit if a.kind in ("B", "I") else 0
      stash += unit if a.kind == "I" else -unit if a.kind == "W" else 0
      act_peak, stash_peak = max(act_peak, live), max(stash_peak, stash)
    act_peaks.append(act_peak)
    stash_peaks.append(stash_peak)
  return tuple(act_peaks), tuple(stash_peaks)


def peak_bytes(schedule: Schedule, set_bytes) -> tuple[int, ...]:
  """Per stage: the peak bytes of live activation sets, replaying its list with a set of part
  v weighing `set_bytes[v]` (F adds its set, B or I releases it): `peaks` in bytes, to set
  beside what an executor measures."""
  out = []
  for s, row in enumerate(schedule.actions):
    live = peak = 0
    for a in row:
      size = set_bytes[schedule.virtual_stage(s, a.chunk)]
      live += size if a.kind == "F" else -size if a.kind in ("B", "I") else 0
      peak = max(peak, live)
    out.append(peak)
  return tuple(out)


def simulate(schedule: Schedule, costs: "Costs | Sequence[Costs]" = Costs(),
             source: str = "the schedule", paired: frozenset = frozenset()) -> Simulation:
  """Validates `schedule` (ConfigError if broken) and runs it under `costs` (one Costs for
  every stage, or one per stage or part: `part_durations`).

  `paired`: (stage, position)s whose action and the next one run as one overlapped pair
  (DualPipe's F&B): the pair starts once the inputs of both exist. Empty: each action starts
  as soon as its own inputs exist (how the MPMD runner dispatches).
  """
  order = schedule_lib.validate(schedule, source)
  timing = part_durations(schedule, costs)
  latency = lambda s, a: timing[s, a.chunk][1]
  backward = schedule_lib.backward_kind(schedule)
  end, free = {}, [Fraction(0)] * schedule.num_stages
  timeline = [[] for _ in range(schedule.num_stages)]
  for s, a in order:  # dependencies come earlier in `order`, so their end times are known
    start = free[s]
    for ds, d in schedule_lib.dependencies(schedule, s, a, backward):
      start = max(start, end[ds, d] + (latency(s, a) if ds != s else 0))
    end[s, a] = free[s] = start + timing[s, a.chunk][0][a.kind]
    timeline[s].append(Timed(s, a, start, end[s, a]))
  if paired:
    timeline = _couple(schedule, timeline, end, paired, latency, backward)
    free = [row[-1].end if row else Fraction(0) for row in timeline]
  makespan = max(free)
  busy = tuple(sum((t.end - t.start for t in row), Fraction(0)) for row in timeline)
  bubbles = tuple(1 - b / makespan if makespan else Fraction(0) for b in busy)
  act, stash = peaks(schedule)
  return Simulation(makespan, busy, bubbles, act, stash, tuple(map(tuple, timeline)))


def _couple(schedule, timeline, end, paired, latency, backward):
  """Delays each paired action to when its partner's inputs exist too; repeats until no
  start moves (every move only delays, from the uncoupled times, so this terminates)."""
  def ready(s, a, skip=None):
    return max((end[ds, d] + (latency(s, a) if ds != s else 0)
                for ds, d in schedule_lib.dependencies(schedule, s, a, backward)
                if (ds, d) != skip), default=Fraction(0))

  rows = [[t.action for t in row] for row in timeline]
  changed = True
  while changed:
    changed = False
    for s, row in enumerate(rows):
      free, new = Fraction(0), []
      for i, a in enumerate(row):
        start = max(free, ready(s, a))
        if (s, i) in paired:
          start = max(start, ready(s, row[i + 1], skip=(s, a)))
        free = start + (timeline[s][i].end - timeline[s][i].start)
        changed |= free != end[s, a]
        end[s, a] = free
        new.append(Timed(s, a, start, free))
      timeline[s] = tuple(new)
  return timeline


def chart(sim: Simulation) -> str:
  """The time line as text: one row per stage, one cell per time unit, idle cells '.'.

  The time unit is the largest one that divides every start and end; each action's label
  (`F3`, `I2.1`) starts at its first cell.
  """
  times = [t for row in sim.timeline for x in row for t in (x.start, x.end)]
  unit = Fraction(math.gcd(*(t.numerator for t in times)) or 1,
                  math.lcm(*(t.denominator for t in times)))
  width = max((math.ceil((len(str(x.action)) + 1) / ((x.end - x.start) / unit))
               for row in sim.timeline for x in row if x.end > x.start), default=1)
  columns = int(sim.makespan / unit)
  lines = [f"time unit {unit} (one cell = {width} characters); '.' idle"]
  for s, row in enumerate(sim.timeline):
    cells = ["." * width] * columns
    for x in row:
      first, last = int(x.start / unit), int(x.end / unit)
      if last > first:
        text = str(x.action).ljust((last - first) * width)
        cells[first:last] = [text[i * width:(i + 1) * width] for i in range(last - first)]
    lines.append(f"stage{s}: " + "".join(cells).rstrip())
  return "\n".join(lines)
