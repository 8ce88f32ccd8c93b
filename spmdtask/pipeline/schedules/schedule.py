"""Pipeline schedules as data: per-stage ordered lists of actions on microbatches.

A schedule is what each stage (device group) does, in order. Sends and receives are not
written: they follow from the dependencies between actions (see `dependencies`).

Actions:
  F(m, c)  forward of microbatch m through chunk c of this stage.
  B(m, c)  full backward (input grads and weight grads together).
  I(m, c)  backward for the input grads only (zero-bubble split); W(m, c) the weight grads.

The model is cut into `num_stages * num_chunks` consecutive parts (virtual stages). Stage s
holds `num_chunks` of them; `placement` says which:
  'loop': chunk c of stage s is part c*p + s (interleaved 1F1B, circular);
  'v':    chunk 0 of stage s is part s, chunk 1 is part 2p - 1 - s (ZB-V, DualPipeV).

Text form (`dumps` / `loads`, lossless): an optional header line of `key=value` fields, then
one row per stage, actions separated by spaces and run left to right; `#` starts a comment.

    stages=2 microbatches=2 chunks=1 placement=loop
    stage0: F0 F1 B0 B1
    stage1: F0 B0 F1 B1

An action is written `<kind><microbatch>[.<chunk>]` (chunk 0 is left out): `F3`, `I3.1`.
Without a header the fields are inferred: stages from the rows, microbatches and chunks from
the largest indices used, placement 'loop'.

Execution model checked by `validate`: each stage runs its list in order; an action starts
once its inputs exist. Sends are asynchronous and receives block, so a schedule deadlocks
exactly when, running every list in order, no stage can start its next action.
"""
import dataclasses
import re

from spmdtask import fs
from spmdtask.errors import ConfigError

KINDS = ("F", "B", "I", "W")
PLACEMENTS = ("loop", "v")
_ACTION = re.compile(r"^([FBIW])(\d+)(?:\.(\d+))?$")
_ROW = re.compile(r"^stage(\d+)\s*:(.*)$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
  """One unit of work on one stage: `kind` of `microbatch` through the stage's `chunk`."""
  kind: str
  microbatch: int
  chunk: int = 0

  def __str__(self) -> str:
    return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

  @classmethod
  def parse(cls, text: str) -> "Action":
    """`F3` -> Action('F', 3, 0); `I3.1` -> Action('I', 3, 1). ValueError if malformed."""
    match = _ACTION.match(text)
    if not match:
      raise ValueError(f"{text!r} is not an action: write <kind><microbatch>[.<chunk>] with "
                       f"kind one of {'/'.join(KINDS)}, e.g. F3 or I3.1")
    return cls(match[1], int(match[2]), int(match[3] or 0))


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per-stage ordered actions. `actions[s]` is stage s's program, run front to back."""
  num_stages: int
  num_microbatches: int
  actions: tuple[tuple[Action, ...], ...]
  num_chunks: int = 1
  placement: str = "loop"

  @property
  def num_virtual(self) -> int:
    """The number of model parts (virtual stages)."""
    return self.num_stages * self.num_chunks

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


# ---------------------------------------------------------------------------------------------
# Text form.

def dumps(schedule: Schedule) -> str:
  """The text form (see the module docstring); `loads(dumps(s)) == s`."""
  lines = [f"stages={schedule.num_stages} microbatches={schedule.num_microbatches} "
           f"chunks={schedule.num_chunks} placement={schedule.placement}"]
  lines += [f"stage{s}: " + " ".join(map(str, row)) for s, row in enumerate(schedule.actions)]
  return "\n".join(lines) + "\n"


def loads(text: str, source: str = "the schedule text") -> Schedule:
  """Parses the text form. Raises ConfigError naming `source`, the line and the fix.

  The result is not validated: call `validate` (the rows may still break a rule).
  """
  header, rows = {}, {}
  for number, raw in enumerate(text.splitlines(), 1):
    line = raw.split("#", 1)[0].strip()
    if not line:
      continue
    where = f"{source}, line {number}"
    row = _ROW.match(line)
    if row:
      stage = int(row[1])
      if stage in rows:
        raise ConfigError(f"{where}: stage{stage} has a second row; give each stage one row.")
      try:
        rows[stage] = tuple(Action.parse(tok) for tok in row[2].split())
      except ValueError as e:
        raise ConfigError(f"{where}: stage{stage}: {e}.") from None
      continue
    if rows or header:
      raise ConfigError(f"{where}: {line!r} is neither a `stageN: actions...` row nor a "
                        "comment; the header (stages=P microbatches=M chunks=V placement=loop)"
                        " may only be the first line.")
    header = _parse_header(line, where)
  if not rows:
    raise ConfigError(f"{source} has no `stageN: actions...` rows.")
  num_stages = header.get("stages", len(rows))
  if sorted(rows) != list(range(num_stages)):
    raise ConfigError(f"{source} has rows for stages {sorted(rows)} but needs exactly one row "
                      f"for each of stage0 .. stage{num_stages - 1}.")
  actions = tuple(rows[s] for s in range(num_stages))
  used = [a for row in actions for a in row]
  return Schedule(
      num_stages=num_stages,
      num_microbatches=header.get("microbatches", 1 + max((a.microbatch for a in used), default=0)),
      actions=actions,
      num_chunks=header.get("chunks", 1 + max((a.chunk for a in used), default=0)),
      placement=header.get("placement", "loop"))


def _parse_header(line: str, where: str) -> dict:
  fields = {}
  for token in line.split():
    key, _, value = token.partition("=")
    if key == "placement" and value in PLACEMENTS:
      fields[key] = value
    elif key in ("stages", "microbatches", "chunks") and value.isdigit() and int(value) > 0:
      fields[key] = int(value)
    else:
      raise ConfigError(f"{where}: header field {token!r} is not understood; the header is "
                        "`stages=P microbatches=M chunks=V placement=loop|v` with positive "
                        "integers (every field optional).")
  return fields


def load(path: str) -> Schedule:
  """Reads a schedule file in the text form (not validated; see `validate`)."""
  try:
    text = fs.read_text(path)
  except OSError as e:
    raise ConfigError(f"Cannot read the schedule file {path!r}: {e.strerror or e}.") from None
  return loads(text, source=f"schedule file {path!r}")


def dump(schedule: Schedule, path: str) -> None:
  fs.write_text(path, dumps(schedule))


# ---------------------------------------------------------------------------------------------
# Dependencies, execution order and the validator.

def backward_kind(schedule: Schedule) -> dict[tuple[int, int, int], str]:
  """(stage, microbatch, chunk) -> 'B' or 'I': the action that produces its input gradient."""
  return {(s, a.microbatch, a.chunk): a.kind for s, row in enumerate(schedule.actions)
          for a in row if a.kind in ("B", "I")}


def dependencies(schedule: Schedule, stage: int, action: Action,
                 backward: dict | None = None) -> list[tuple[int, Action]]:
  """The (stage, action)s whose results `action` on `stage` consumes.

  F of virtual stage k needs F of k-1 (its input activation); B or I of k needs its own F
  (the residuals) and B or I of k+1 (the output gradient); W needs its own I.
  """
  backward = backward_kind(schedule) if backward is None else backward
  mb, k = action.microbatch, schedule.virtual_stage(stage, action.chunk)
  if action.kind == "F":
    if k == 0:
      return []
    s, c = schedule.owner(k - 1)
    return [(s, Action("F", mb, c))]
  if action.kind == "W":
    return [(stage, Action("I", mb, action.chunk))]
  deps = [(stage, Action("F", mb, action.chunk))]
  if k < schedule.num_virtual - 1:
    s, c = schedule.owner(k + 1)
    deps.append((s, Action(backward.get((s, mb, c), "B"), mb, c)))
  return deps


def execution_order(schedule: Schedule, source: str = "the schedule",
                    deps=None) -> list[tuple[int, Action]]:
  """Every (stage, action) in an order that respects each stage's list and every dependency.

  The one execution-order engine: the validator, the simulator and the MPMD runner use it.
  `deps(schedule, stage, action, backward)` gives the (stage, action)s an action waits for
  (default `dependencies`: the chain of parts; the MPMD runner passes the split's value
  graph, where a value may skip parts). Raises ConfigError if the lists deadlock (no stage
  can start its next action). Assumes the per-stage rules hold (`validate` checks those).
  """
  deps = deps or dependencies
  backward = backward_kind(schedule)
  done, order = set(), []
  next_index = [0] * schedule.num_stages
  total = sum(len(row) for row in schedule.actions)
  while len(order) < total:
    progressed = False
    for s, row in enumerate(schedule.actions):
      while next_index[s] < len(row):
        action = row[next_index[s]]
        if any(d not in done for d in deps(schedule, s, action, backward)):
          break
        done.add((s, action))
        order.append((s, action))
        next_index[s] += 1
        progressed = True
    if not progressed:
      stuck = [(s, row[next_index[s]]) for s, row in enumerate(schedule.actions)
               if next_index[s] < len(row)]
      waits = "; ".join(
          f"stage {s} at {a} waits for " + " and ".join(
              f"{d} on stage {ds}" for ds, d in deps(schedule, s, a, backward)
              if (ds, d) not in done) for s, a in stuck)
      s, a = stuck[0]
      raise ConfigError(
          f"{source}: stage {s}, action {a}: deadlock. Running every stage's list in order, no "
          f"stage can start its next action ({waits}). Rule: blocking receives must not wait "
          "in a cycle; reorder the rows so each action comes after the actions it waits for.")
  return order


def validate(schedule: Schedule, source: str = "the schedule") -> list[tuple[int, Action]]:
  """Checks every rule; returns `execution_order`. Raises ConfigError naming the first break.

  Rules: the fields are in range; each stage runs every (microbatch, chunk) it owns exactly
  once as F and once as B (or once as I and once as W); F comes before B/I of the same
  microbatch and chunk, I before W; the cross-stage dependencies cannot deadlock.
  """
  _check_fields(schedule, source)
  for s, row in enumerate(schedule.actions):
    _check_stage(schedule, s, row, source)
  return execution_order(schedule, source)


def _check_fields(schedule: Schedule, source: str) -> None:
  for name in ("num_stages", "num_microbatches", "num_chunks"):
    if not isinstance(getattr(schedule, name), int) or getattr(schedule, name) < 1:
      raise ConfigError(f"{source}: {name}={getattr(schedule, name)!r} must be an integer >= 1.")
  if schedule.placement not in PLACEMENTS:
    raise ConfigError(f"{source}: placement={schedule.placement!r} is not one of {PLACEMENTS}.")
  if schedule.placement == "v" and schedule.num_chunks != 2:
    raise ConfigError(f"{source}: placement='v' needs exactly 2 chunks per stage, got "
                      f"{schedule.num_chunks}.")
  if len(schedule.actions) != schedule.num_stages:
    raise ConfigError(f"{source}: {len(schedule.actions)} stage rows for num_stages="
                      f"{schedule.num_stages}; give one row per stage.")


def _check_stage(schedule: Schedule, s: int, row, source: str) -> None:
  def fail(action, problem, rule):
    raise ConfigError(f"{source}: stage {s}, action {action}: {problem}. Rule: {rule}.")

  seen = {}
  for position, a in enumerate(row):
    if a.kind not in KINDS:
      fail(a, f"unknown kind {a.kind!r}", f"kinds are {', '.join(KINDS)}")
    if not 0 <= a.microbatch < schedule.num_microbatches:
      fail(a, f"microbatch {a.microbatch} is out of range", f"microbatches are 0 .. "
           f"{schedule.num_microbatches - 1} (num_microbatches={schedule.num_microbatches})")
    if not 0 <= a.chunk < schedule.num_chunks:
      fail(a, f"chunk {a.chunk} is out of range",
           f"chunks are 0 .. {schedule.num_chunks - 1} (num_chunks={schedule.num_chunks})")
    if a in seen:
      fail(a, f"runs twice (positions {seen[a]} and {position})",
           "each stage runs every action it owns exactly once")
    seen[a] = position
    earlier = {kind for kind in KINDS if Action(kind, a.microbatch, a.chunk) in seen}
    if a.kind in ("B", "I") and "F" not in earlier:
      fail(a, f"runs before {Action('F', a.microbatch, a.chunk)}",
           "the forward of a microbatch comes before its backward (B or I)")
    if a.kind == "W" and "I" not in earlier:
      fail(a, f"runs before {Action('I', a.microbatch, a.chunk)}",
           "I (input grads) comes before W (weight grads) of the same microbatch")
    if {"B", "I"} <= earlier:
      fail(a, "mixes B with I/W for the same microbatch and chunk",
           "a backward is either one B or one I followed by one W")
  for mb in range(schedule.num_microbatches):
    for c in range(schedule.num_chunks):
      has = {kind for kind in KINDS if Action(kind, mb, c) in seen}
      for kind in ("F",) + (("W",) if "I" in has else ()):
        if kind not in has:
          fail(Action(kind, mb, c), "is missing",
               "each stage runs F and B (or I and W) of every microbatch and chunk it owns")
      if not has & {"B", "I"}:
        fail(Action("B", mb, c), "is missing (neither B nor I appears)",
             "each stage runs F and B (or I and W) of every microbatch and chunk it owns")
