"""Schedule generators: GPipe, 1F1B, interleaved 1F1B and ZB-H1 as `schedule.Schedule` data
(ZB-V and DualPipeV, two chunks per stage in a V, are in `generators_v`).

p stages, m microbatches, v chunks per stage. Each generator writes every stage's list in
closed form; `tests/pipeline/schedules/test_generators.py` validates them and `simulate` checks their bubbles
and peaks against the published formulas.

  gpipe             all forwards, then all backwards.
  1f1b              stage s runs min(p-1-s, m) warm-up forwards, then alternates one
                    forward and one backward, then drains the backwards (PipeDream-Flush).
  interleaved_1f1b  Megatron-LM's schedule: v chunks per stage ('loop' placement); forwards
                    go through the chunks in groups of p microbatches; warm-up of
                    2(p-1-s) + (v-1)p chunk forwards; m must be a multiple of p.
  zb_h1             1F1B's order with B split into I (input grads) and W (weight grads):
                    stage s keeps s weight-grad passes pending and runs them last, which fills
                    1F1B's cool-down bubble and keeps 1F1B's activation memory. With
                    F = I = W its bubble is (p-1)/(3m+p-1) when m >= p; with fewer
                    microbatches the schedule stays valid but the chain of I then W on
                    stage 0 cannot be hidden and the bubble is larger.
"""
from typing import Callable

from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules.generators_v import dualpipe_v, dualpipe_v_pairs, zb_v
from spmdtask.pipeline.schedules.schedule import Action, Schedule


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
  p, m = num_stages, num_microbatches
  row = tuple(Action("F", i) for i in range(m)) + tuple(Action("B", i) for i in range(m))
  return Schedule(p, m, (row,) * p)


def _one_f_one_b_order(p: int, m: int, s: int) -> list[tuple[str, int]]:
  """Stage s's 1F1B order as (kind, microbatch) with kind 'F' or 'B'."""
  warmup = min(p - 1 - s, m)
  order = [("F", i) for i in range(warmup)]
  for i in range(m - warmup):
    order += [("F", warmup + i), ("B", i)]
  return order + [("B", i) for i in range(m - warmup, m)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
  p, m = num_stages, num_microbatches
  rows = tuple(tuple(Action(k, i) for k, i in _one_f_one_b_order(p, m, s)) for s in range(p))
  return Schedule(p, m, rows)


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
  p, m, v = num_stages, num_microbatches, num_chunks
  if m % p:
    raise ConfigError(f"interleaved_1f1b needs the microbatches ({m}) to be a multiple of the "
                      f"stages ({p}): microbatches go through the chunks in groups of {p}. "
                      f"Use {m + (-m) % p} microbatches, or the 1f1b schedule.")
  total = m * v  # chunk forwards (and chunk backwards) per stage

  def forward(k):  # the k-th chunk forward of any stage, Megatron's order
    group, within = divmod(k, p * v)
    return Action("F", group * p + within % p, within // p)

  def backward(k):
    f = forward(k)
    return Action("B", f.microbatch, v - 1 - f.chunk)

  rows = []
  for s in range(p):
    warmup = min(2 * (p - 1 - s) + (v - 1) * p, total)
    row = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
      row += [forward(warmup + i), backward(i)]
    row += [backward(i) for i in range(total - warmup, total)]
    rows.append(tuple(row))
  return Schedule(p, m, tuple(rows), num_chunks=v, placement="loop")


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
  p, m = num_stages, num_microbatches
  rows = []
  for s in range(p):
    lag = min(s, m - 1)  # weight-grad passes stage s leaves pending in the steady state
    row, done_w = [], 0
    for kind, i in _one_f_one_b_order(p, m, s):
      if kind == "F":
        row.append(Action("F", i))
        continue
      row.append(Action("I", i))
      if i - done_w >= lag:
        row.append(Action("W", done_w))
        done_w += 1
    row += [Action("W", i) for i in range(done_w, m)]
    rows.append(tuple(row))
  return Schedule(p, m, tuple(rows))


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "zb_v": zb_v,              # two chunks per stage in a V (generators_v)
    "dualpipe_v": dualpipe_v,
}
V_SCHEDULES = ("zb_v", "dualpipe_v")


def generate_pairs(name: str, num_stages: int, num_microbatches: int) -> frozenset:
  """The overlapped (F, B) pairs of schedule `name` as `simulate(paired=)` takes them: DualPipe
  runs each pair as one unit; the other schedules have none."""
  return dualpipe_v_pairs(num_stages, num_microbatches) if name == "dualpipe_v" else frozenset()


def generate(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
  """The schedule `name` (a key of GENERATORS) for p stages, m microbatches, v chunks.

  Raises ConfigError for an unknown name or a (p, m, v) the schedule cannot take.
  """
  if name not in GENERATORS:
    raise ConfigError(f"Unknown pipeline schedule {name!r}; choose one of "
                      f"{', '.join(GENERATORS)}.")
  for field, value in (("stages", num_stages), ("microbatches", num_microbatches),
                       ("chunks", num_chunks)):
    if not isinstance(value, int) or value < 1:
      raise ConfigError(f"The {name} schedule needs {field} >= 1, got {value!r}.")
  if name == "interleaved_1f1b":
    return interleaved_1f1b(num_stages, num_microbatches, num_chunks)
  if name in V_SCHEDULES:
    if num_chunks != 2:
      raise ConfigError(f"The {name} schedule runs 2 chunks per stage in a V, got chunks="
                        f"{num_chunks}: set chunks=2 (stages x 2 parts).")
    return GENERATORS[name](num_stages, num_microbatches)
  if num_chunks != 1:
    raise ConfigError(f"The {name} schedule runs one chunk per stage, got chunks="
                      f"{num_chunks}; use interleaved_1f1b for several chunks per stage.")
  return GENERATORS[name](num_stages, num_microbatches)
